"""Where a decode token's time goes: ATen ops per token and milliseconds per token, split by phase.

At batch 1 a 135M model's decode step reads ~0.5 GB (fp32) of weights; below a few milliseconds per token the
roof is not bytes but the fixed cost of each op (a few µs of dispatch per ATen op, a ctypes call per native
kernel) and of the engine's Python bookkeeping.  ``profile_decode`` measures both for one batch-1 greedy decode:

- ``path="engine"``: ``LLM.stream`` (the engine: schedule → prepare → forward → sample → postprocess →
  detokenize, paged KV);
- ``path="cached"``: ``engine.simple.stream_cached`` (the teaching loop: contiguous KV, no scheduler).

Two passes, both over decode steps only (the first token, which carries the prefill, is excluded): a timed pass
(best of ``repeats``, no profiler, so the times are not inflated by it) whose phases are timed by wrapping the
engine's own methods on their instances for the duration of the call, and one pass under ``torch.profiler`` that
counts ATen ops (every ``aten::`` event, nested ones included: ``reshape`` → ``view`` counts 2).

``python -m minillm.perf.profile [--dtypes float32,bfloat16] [--tokens 64] [--threads N]`` prints the reports.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from minillm.engine.native_runner import NativeRunner
from minillm.sampling.params import SamplingParams

PATHS = ("engine", "cached")


@dataclass(frozen=True)
class DecodeProfile:
    """One batch-1 greedy decode, per decode token (the prefill token excluded).

    ``split_ms``: milliseconds per token by phase.  Engine: ``forward`` (layers + LM head), ``sampling`` (the rest
    of the runner's step: sampling, block copies), ``schedule``, ``prepare`` (packing inputs and attention
    metadata), ``postprocess`` (the scheduler's bookkeeping), ``detokenize`` (text deltas, stop strings),
    ``other`` (the rest of the step and the caller's loop).  Cached loop: ``forward`` and ``other`` (sampling,
    cache positions, the loop).  ``top_ops``: the most frequent ATen ops, (name, calls per token).
    """

    path: str
    dtype: str
    kernels: str
    threads: int
    n_tokens: int
    ms_per_token: float
    aten_ops_per_token: float
    split_ms: dict[str, float]
    top_ops: tuple[tuple[str, float], ...]

    @property
    def tokens_per_s(self) -> float:
        return 1e3 / self.ms_per_token

    def format(self) -> str:
        """A few readable lines."""
        split = ", ".join(f"{k} {v:.2f}" for k, v in self.split_ms.items())
        top = ", ".join(f"{name.removeprefix('aten::')} {n:.0f}" for name, n in self.top_ops)
        return (f"{self.path:6s} {self.dtype:8s} kernels={self.kernels} threads={self.threads}: "
                f"{self.ms_per_token:.2f} ms/token ({self.tokens_per_s:.1f} tok/s), "
                f"{self.aten_ops_per_token:.0f} ATen ops/token\n    ms/token: {split}\n    top ops/token: {top}")


class _Clock:
    """Seconds spent in each wrapped method, counted only while ``active`` (the decode steps)."""

    def __init__(self):
        self.active = False
        self.spent: Counter[str] = Counter()

    @contextlib.contextmanager
    def wrap(self, obj, method: str, bucket: str) -> Iterator[None]:
        """Time ``obj.method`` into ``bucket`` until the block exits (an instance attribute shadows the method,
        then is deleted: the object is as it was)."""
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.active:
                    self.spent[bucket] += time.perf_counter() - start

        setattr(obj, method, timed)
        try:
            yield
        finally:
            delattr(obj, method)


def _stream(llm, path: str, prompt: list[int], params: SamplingParams) -> Iterator:
    if path == "engine":
        return llm.stream([prompt], params)
    from minillm.engine.simple import stream_cached

    return stream_cached(llm.model, [prompt], [params])


def _wrapped(llm, path: str, clock: _Clock) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    model = llm.model
    stack.enter_context(clock.wrap(model, "hidden_states", "forward"))
    stack.enter_context(clock.wrap(model, "compute_logits", "forward"))
    if path == "engine":
        eng = llm.engine
        stack.enter_context(clock.wrap(eng, "step", "step"))
        stack.enter_context(clock.wrap(eng.runner, "run", "run"))
        stack.enter_context(clock.wrap(eng.runner, "prepare", "prepare"))
        if isinstance(eng.runner, NativeRunner):  # the fused native decode step: every layer (+ head) in one call
            stack.enter_context(clock.wrap(eng.runner.stack, "run_rows", "forward"))
        stack.enter_context(clock.wrap(eng.scheduler, "schedule", "schedule"))
        stack.enter_context(clock.wrap(eng.scheduler, "postprocess", "postprocess"))
        stack.enter_context(clock.wrap(eng, "_postprocess", "emit"))
    return stack


def _split(spent: Counter[str], total: float, path: str, n: int) -> dict[str, float]:
    ms = {k: v / n * 1e3 for k, v in spent.items()}
    if path != "engine":
        return {"forward": ms.get("forward", 0.0), "other": total - ms.get("forward", 0.0)}
    ms.setdefault("prepare", 0.0)  # a fused decode step (engine/native_runner.py) packs no prepared inputs
    ms.setdefault("forward", 0.0)
    split = {"forward": ms["forward"], "sampling": ms["run"] - ms["prepare"] - ms["forward"],
             "schedule": ms["schedule"], "prepare": ms["prepare"], "postprocess": ms["postprocess"],
             "detokenize": ms["emit"] - ms["postprocess"]}
    split["other"] = total - sum(split.values())
    return split


def _decode(llm, path: str, prompt: list[int], params: SamplingParams,
            on_first: Callable[[], None]) -> tuple[float, int]:
    """Run one request; ``on_first`` runs after the first token. -> (seconds after it, decode tokens)."""
    n, start = 0, 0.0
    for _ in _stream(llm, path, prompt, params):
        n += 1
        if n == 1:
            on_first()
            start = time.perf_counter()
    return time.perf_counter() - start, n - 1


def profile_decode(llm, path: str = "engine", n_tokens: int = 64, prompt_len: int = 32, repeats: int = 3,
                   top: int = 10) -> DecodeProfile:
    """Profile a batch-1 greedy decode of ``n_tokens`` after a ``prompt_len``-token prompt through ``llm`` (an
    ``LLM``), on ``path`` "engine" (``LLM.stream``) or "cached" (``engine.simple.stream_cached``).

    Times are the best of ``repeats`` runs (a shared machine is noisy: compare ratios taken in one run); the op
    count comes from one more run under ``torch.profiler``.  One warm-up run comes first.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if n_tokens < 2 or prompt_len < 1 or repeats < 1 or top < 0:
        raise ValueError(f"need n_tokens >= 2, prompt_len >= 1, repeats >= 1, top >= 0; got n_tokens={n_tokens}, "
                         f"prompt_len={prompt_len}, repeats={repeats}, top={top}")
    vocab = llm.model.config.vocab_size
    prompt = [(100 + 7919 * i) % vocab for i in range(prompt_len)]  # fixed, varied, no special tokens early
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    _decode(llm, path, prompt, params, lambda: None)  # warm-up: first-call allocations, native library load

    best: tuple[float, Counter[str]] | None = None
    for _ in range(repeats):
        clock = _Clock()
        with _wrapped(llm, path, clock):
            seconds, n = _decode(llm, path, prompt, params, lambda c=clock: setattr(c, "active", True))
        if best is None or seconds / n < best[0]:
            best = (seconds / n, clock.spent)
    ms_per_token = best[0] * 1e3

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    _, n = _decode(llm, path, prompt, params, prof.start)
    prof.stop()
    counts = Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    return DecodeProfile(path=path, dtype=str(llm.model.dtype).removeprefix("torch."), kernels=llm.model.kernels,
                         threads=torch.get_num_threads(), n_tokens=n, ms_per_token=ms_per_token,
                         aten_ops_per_token=sum(counts.values()) / n,
                         split_ms=_split(best[1], ms_per_token, path, n),
                         top_ops=tuple((name, c / n) for name, c in counts.most_common(top)))


def main(argv: list[str] | None = None) -> int:
    """Print ``profile_decode`` for the default model on both paths and each dtype."""
    p = argparse.ArgumentParser(prog="python -m minillm.perf.profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="hub id, directory or .gguf (default: the embedded model)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--kernels", default="auto", help="auto | torch | native | triton")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from minillm.llm import LLM

    for dtype in a.dtypes.split(","):
        llm = LLM(a.model, dtype=dtype, device="cpu", kernels=a.kernels)
        for path in a.paths.split(","):
            print(profile_decode(llm, path, n_tokens=a.tokens, repeats=a.repeats).format(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
