"""Prefill with the native elementwise fusions at any row count vs capped at decode rows, in one process.

    python benchmarks/elementwise_prefill_ab.py THREADS ROUNDS

'before' swaps in the old rule (the fusions — rms_norm, add_rms_norm, rope, silu_and_mul — only up to
``native.MAX_ROWS`` rows, the ATen references past it), 'after' is the current ``native.elementwise_supports``;
the two alternate for ROUNDS rounds on the default model and the medians are printed for a 512-token prefill step
and a mixed step (a 256-token chunk beside 16 decode rows).  Ratios within one run only.
"""
import statistics
import sys
import time

import torch

from minillm import LLM, SamplingParams
from minillm.kernels.cpu import native

NEW_RULE = native.elementwise_supports


def old_rule(x, weight):
    return NEW_RULE(x, weight) and x.numel() // x.shape[-1] <= native.MAX_ROWS


def main(threads: int, rounds: int) -> None:
    torch.set_num_threads(threads)
    engine = LLM(max_num_batched_tokens=512, enable_prefix_caching=False, max_num_seqs=32).engine
    gen = torch.Generator().manual_seed(0)
    count = [0]

    def add(length: int, max_tokens: int) -> str:
        count[0] += 1
        engine.add_request(prompt=torch.randint(100, 49000, (length,), generator=gen).tolist(),
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           request_id=str(count[0]))
        return str(count[0])

    def timed_step(rule, length: int) -> float:
        """Seconds of the one step that prefills a new ``length``-token prompt, under ``rule``."""
        native.elementwise_supports = rule
        try:
            rid = add(length, 1)
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            while True:
                try:
                    engine.pop_output(rid)
                    return dt
                except KeyError:
                    engine.step()
        finally:
            native.elementwise_supports = NEW_RULE

    for phase, length in (("prefill512", 512), ("mixed256+16", 256)):
        if phase == "mixed256+16":
            for _ in range(16):
                add(64, 10**6)  # decode rows that never finish
            for _ in range(4):
                engine.step()
        timed_step(old_rule, length), timed_step(NEW_RULE, length)  # warm
        before, after = [], []
        for _ in range(rounds):
            before.append(timed_step(old_rule, length))
            after.append(timed_step(NEW_RULE, length))
        mb, ma = statistics.median(before), statistics.median(after)
        print(f"{phase}: before {length / mb:.0f} tok/s (median {mb * 1e3:.0f} ms)  after {length / ma:.0f} tok/s "
              f"({ma * 1e3:.0f} ms)  speedup {mb / ma:.2f}x", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, int(sys.argv[2]) if len(sys.argv) > 2 else 5)
