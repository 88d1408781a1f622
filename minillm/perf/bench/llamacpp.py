"""llama.cpp (``llama-cpp-python``) measured in its own process: ``python -m minillm.perf.bench.llamacpp`` is the
worker, ``LlamaCppPeer`` the benchmark's side of it.

A llama.cpp built with ``-march=native`` (``GGML_NATIVE=ON``) can die of SIGILL on a host whose CPU reports an
instruction set the virtual machine does not enable (AMX tiles under KVM: ``tilezero`` faults).  Run in a process
of its own, it cannot take the benchmark down with it: ``LlamaCppPeer`` sees the signal in the return code and reports
it.  Protocol, one JSON object per line: the worker loads the GGUF and writes ``{"ready": true, "version": ...}``;
then for each request line ``{"op": "decode", "prompt": [ids], "n": N}`` or ``{"op": "prefill", "prompt": [ids]}``
it writes ``{"tok_s": rate}``; end of input ends it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def decode_rate(llm, prompt: list[int], n: int) -> float:
    """Greedy batch-1 decode: ``prompt`` evaluated (untimed), then ``n`` single-token steps, each the argmax of the
    last position's logits (llama.cpp's ``eval`` is the forward; the argmax over V is numpy's) -> tokens/s.  The
    logits are read from the context (``llama_get_logits_ith(ctx, -1)``): without ``logits_all`` ``Llama.eval``
    no longer copies them into ``Llama.scores``."""
    import llama_cpp
    import numpy as np

    vocab = llm.n_vocab()
    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(n):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        llm.eval([int(np.argmax(logits))])
    return n / (time.perf_counter() - start)


def prefill_rate(llm, prompt: list[int]) -> float:
    """``prompt`` through an empty context in llama.cpp's batches (``n_batch``) -> prompt tokens/s."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - start)


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors one decode step reads: all of them but an untied embedding (a row lookup)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    return sum(n for name, n in tensors.items() if name != "token_embd.weight" or "output.weight" not in tensors)


class PeerDied(RuntimeError):
    """A peer's process ended before answering (a signal such as SIGILL, or an error it printed)."""


def describe_exit(returncode: int | None, stderr: str = "") -> str:
    """Why a worker process ended: the signal (SIGILL with its usual cause) or the exit status and its last words."""
    if returncode is not None and returncode < 0:
        sig = signal.Signals(-returncode).name
        why = f"killed by {sig}"
        if sig == "SIGILL":
            why += (" (an instruction this CPU or VM does not run: a llama.cpp built with GGML_NATIVE=ON on a host "
                    "whose AMX tiles are not enabled faults on tilezero; rebuild it with the flags BENCHMARKS.md "
                    "gives)")
        return why
    tail = stderr.strip().splitlines()[-3:]
    return f"exited with status {returncode}" + (f": {' | '.join(tail)}" if tail else "")


class LlamaCppPeer:
    """llama.cpp through ``llama-cpp-python`` in a worker process (this module's ``main``) on a GGUF; the same
    ``decode`` / ``prefill`` / ``load`` / ``close`` as ``cpu_peers``' in-process peers."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, *, threads: int, n_ctx: int, command: tuple[str, ...] | None = None):
        self.gguf, self.threads, self.n_ctx, self.proc = Path(gguf), threads, n_ctx, None
        self.command = command or (sys.executable, "-m", "minillm.perf.bench.llamacpp")
        self.version: str | None = None
        self.log = None

    @staticmethod
    def unavailable() -> str | None:
        """Why llama.cpp cannot run here, or None (found without importing it: a bad build must not load here)."""
        from minillm.models.synthetic import llama_cpp_unavailable

        return llama_cpp_unavailable()

    def load(self) -> None:
        import minillm

        root = str(Path(minillm.__file__).resolve().parents[1])  # the worker imports this minillm
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        cmd = [*self.command, str(self.gguf), "--threads", str(self.threads), "--n-ctx", str(self.n_ctx)]
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty llama.cpp never blocks on it
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        self.version = self._answer().get("version")

    def weight_bytes(self) -> int:
        """The bytes of the GGUF's tensors its decode step reads (``gguf_weight_bytes``)."""
        return gguf_weight_bytes(self.gguf)

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
            rc = self.proc.wait(60)
            self.log.seek(0)
            raise PeerDied(describe_exit(rc, self.log.read()))
        return json.loads(line)

    def _ask(self, request: dict) -> float:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: _answer says how
        return self._answer()["tok_s"]

    def decode(self, prompt: list[int], n: int) -> float:
        return self._ask({"op": "decode", "prompt": prompt, "n": n})

    def prefill(self, prompt: list[int]) -> float:
        return self._ask({"op": "prefill", "prompt": prompt})

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()  # end of input: the worker returns
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
        self.proc = self.log = None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("gguf")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--n-ctx", type=int, required=True)
    a = p.parse_args(argv)
    import llama_cpp

    llm = llama_cpp.Llama(model_path=a.gguf, n_ctx=a.n_ctx, n_threads=a.threads, n_threads_batch=a.threads,
                          verbose=False)
    print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        rate = (decode_rate(llm, req["prompt"], req["n"]) if req["op"] == "decode"
                else prefill_rate(llm, req["prompt"]))
        print(json.dumps({"tok_s": rate}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
