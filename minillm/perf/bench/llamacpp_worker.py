"""llama.cpp (``llama-cpp-python``) measured in its own process: ``python -m minillm.perf.bench.llamacpp_worker``.

A llama.cpp built with ``-march=native`` (``GGML_NATIVE=ON``) can die of SIGILL on a host whose CPU reports an
instruction set the virtual machine does not enable (AMX tiles under KVM: ``tilezero`` faults).  Run in this
process, it cannot take the benchmark down with it: ``LlamaCppPeer`` sees the signal in the return code and reports
it.  Protocol, one JSON object per line: the worker loads the GGUF and writes ``{"ready": true, "version": ...}``;
then for each request line ``{"op": "decode", "prompt": [ids], "n": N}`` or ``{"op": "prefill", "prompt": [ids]}``
it writes ``{"tok_s": rate}``; end of input ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def decode_rate(llm, prompt: list[int], n: int) -> float:
    """Greedy batch-1 decode: ``prompt`` evaluated (untimed), then ``n`` single-token steps, each the argmax of the
    last logits (llama.cpp's ``eval`` is the forward; the argmax over V is numpy's) -> tokens/s."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(n):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return n / (time.perf_counter() - start)


def prefill_rate(llm, prompt: list[int]) -> float:
    """``prompt`` through an empty context in llama.cpp's batches (``n_batch``) -> prompt tokens/s."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - start)


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
