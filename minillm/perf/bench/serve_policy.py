"""``python -m minillm.perf.bench.serve_policy``: ``bench serve``'s trace through the real scheduler on a virtual
clock, under several scheduling policies with the same step costs — is a server's TTFT its policy or its steps?

A measured TTFT (``bench serve``) mixes what the scheduler chose to run each step (token budget, seats, the order
of decodes, running prefills and admissions) with how long each step took.  Two servers with different TTFTs may
differ in either.  This replay holds the costs fixed and varies only the policy: the same requests (the load
generator's prompts through the chat template, its arrival times, ``max_tokens`` each) go through
``perf.simulate.simulate`` — minillm's ``Scheduler`` and ``BlockManager``, prefix cache included — once per
policy, and each step takes what ``MeasuredStepTime`` says.  Nothing is timed, so it runs beside anything.

Policies: ``minillm`` (``EngineConfig``'s defaults) and ``vllm-cpu`` (vLLM's defaults for its OpenAI server on a
CPU: a 2048-token budget and 128 seats, its ``EngineArgs``; like minillm it chunks prefills and schedules the
running requests before admitting waiting ones), plus any ``--budgets``.  The table gives TTFT/TPOT percentiles,
the longest gap between two tokens and the deepest waiting queue; the JSON keeps every step's ``StepRecord``
(prefill tokens, decode rows, queue) and, per policy, the steps the slowest first token waited through.  If the
policies agree, the TTFT gap between two servers is in their step costs: replay again with another server's
costs (``--prefill-tok-s``, ``--decode-step-ms``) to see how much of the gap those explain.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from minillm.config import EngineConfig
from minillm.perf.simulate import ServingReport, StepChunk, simulate
from minillm.perf.workloads import RequestSpec

# vLLM's defaults for `vllm serve` on a CPU platform (EngineArgs: max_num_batched_tokens 2048, max_num_seqs 128
# per rank; chunked prefill and prefix caching on), against minillm's EngineConfig defaults.
POLICIES = {"minillm": {}, "vllm-cpu": {"max_num_batched_tokens": 2048, "max_num_seqs": 128}}


@dataclass(frozen=True)
class MeasuredStepTime:
    """A step's seconds, linear in its work, with constants a machine measured (not a roofline).

    A step with any prefill chunk runs the eager forward: ``step_s + prefill_s_per_token × tokens`` (its decode
    rows count as tokens); a decode-only step runs the fused decode step: ``decode_step_s + decode_s_per_row ×
    (rows − 1)``.  The defaults are the default model's fp32 costs on a 2-core quiet host (BENCHMARKS.md, the fp32
    row of the W8A8 table: prefill of 512 tokens, batch-1 and batch-32 decode); pass a machine's own.
    """

    prefill_s_per_token: float = 1 / 462  # prefill 512: 462 tok/s
    step_s: float = 1 / 39.0  # a forward's fixed cost, taken as the batch-1 decode step (39.0 tok/s)
    decode_step_s: float = 1 / 39.0  # batch-1 decode: 39.0 tok/s
    decode_s_per_row: float = (32 / 434.6 - 1 / 39.0) / 31  # batch 32 (434.6 tok/s) over batch 1, per extra row

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) >= 0:
                raise ValueError(f"MeasuredStepTime.{f.name} must be >= 0 seconds, got {getattr(self, f.name)!r}")

    def __call__(self, chunks: Sequence[StepChunk]) -> float:
        tokens = sum(c.num_new for c in chunks)
        if tokens == len(chunks):  # one token each: a decode-only step
            return self.decode_step_s + self.decode_s_per_row * (len(chunks) - 1)
        return self.step_s + self.prefill_s_per_token * tokens


def trace_specs(tokenizer, num_prompts: int, rate: float, max_tokens: int, seed: int = 0,
                burstiness: float = 1.0) -> list[RequestSpec]:
    """``bench serve``'s trace (chat endpoint) as the simulator's requests: each prompt as the server tokenizes it
    (one user message through the chat template), at the same arrival time, wanting ``max_tokens`` tokens."""
    from minillm.engine.inputs import chat_prompt_ids
    from minillm.perf.bench.serve import make_trace

    return [RequestSpec(r.arrival_s, tuple(chat_prompt_ids(tokenizer, [{"role": "user", "content": r.prompt}])),
                        r.max_tokens) for r in make_trace(num_prompts, rate, max_tokens, seed, burstiness)]


def slowest_first_token(report: ServingReport) -> dict:
    """The request with the longest TTFT and what the steps between its arrival and its first token ran."""
    worst = max(report.records, key=lambda r: r.ttft_s)
    first = worst.arrival_s + worst.ttft_s
    steps = [s for s in report.step_log if s.start_s + s.duration_s > worst.arrival_s and s.start_s < first]
    return {"request_id": worst.request_id, "arrival_s": worst.arrival_s, "prompt_tokens": worst.prompt_tokens,
            "ttft_s": worst.ttft_s, "steps": len(steps),
            "prefill_tokens_ahead": sum(s.prefill_tokens for s in steps) - (worst.prompt_tokens
                                                                            - worst.prefix_hit_tokens),
            "step_log": [dataclasses.asdict(s) for s in steps]}


def replay_policies(specs: Sequence[RequestSpec], model_config, step_time, policies: dict[str, dict], *,
                    enable_prefix_caching: bool = True) -> dict[str, ServingReport]:
    """One ``simulate`` per policy (``EngineConfig`` overrides by name) on the same requests and step costs."""
    return {name: simulate(specs, model_config, EngineConfig(enable_prefix_caching=enable_prefix_caching, **kw),
                           step_time, dtype="float32", label=name)
            for name, kw in policies.items()}


def format_policies(reports: dict[str, ServingReport], policies: dict[str, dict]) -> str:
    """One line per policy: budget, seats, TTFT p50/p99, TPOT p50/p99, ITL max (ms), steps, deepest queue."""
    lines = [f"{'policy':12} {'budget':>6} {'seats':>5}  {'TTFT p50':>8} {'p99':>6}  {'TPOT p50':>8} {'p99':>5}  "
             f"{'ITL max':>7}  {'steps':>5}  {'queue':>5}"]
    for name, rep in reports.items():
        cfg = EngineConfig(**policies[name])
        t, p, i = rep.latency("ttft"), rep.latency("tpot"), rep.latency("itl")
        lines.append(f"{name:12} {cfg.max_num_batched_tokens:>6} {cfg.max_num_seqs:>5}  {t['p50'] * 1e3:8.0f} "
                     f"{t['p99'] * 1e3:6.0f}  {p['p50'] * 1e3:8.0f} {p['p99'] * 1e3:5.0f}  {i['max'] * 1e3:7.0f}  "
                     f"{rep.steps:>5}  {max((s.waiting for s in rep.step_log), default=0):>5}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from minillm.models.loader import load_config, load_tokenizer, resolve
    from minillm.perf.bench.decode import save_results

    p = argparse.ArgumentParser(prog="python -m minillm.perf.bench.serve_policy", description=__doc__.split("\n\n")[0])
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budgets", default="", help="more policies: comma list of max_num_batched_tokens values")
    p.add_argument("--prefill-tok-s", type=float, default=None, help="prefill rate of a step (default: the model's)")
    p.add_argument("--decode-step-ms", type=float, default=None, help="a batch-1 decode step (and a forward's "
                                                                       "fixed cost)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args(argv)
    try:
        for flag, value in (("--prefill-tok-s", a.prefill_tok_s), ("--decode-step-ms", a.decode_step_ms)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0, got {value!r}")
        base = MeasuredStepTime()
        step_time = dataclasses.replace(
            base, **({} if a.prefill_tok_s is None else {"prefill_s_per_token": 1 / a.prefill_tok_s}),
            **({} if a.decode_step_ms is None else {"step_s": a.decode_step_ms / 1e3,
                                                    "decode_step_s": a.decode_step_ms / 1e3}))
        policies = {**POLICIES, **{f"budget {b}": {"max_num_batched_tokens": int(b)}
                                   for b in a.budgets.split(",") if b.strip()}}
        specs = trace_specs(load_tokenizer(), a.num_prompts, a.request_rate, a.max_tokens, a.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reports = replay_policies(specs, load_config(resolve(None)), step_time, policies,
                              enable_prefix_caching=not a.no_prefix_caching)
    print(f"{a.num_prompts} requests at {a.request_rate:g} req/s, {a.max_tokens} output tokens each, the same step "
          f"costs for every policy: {step_time}")
    print(format_policies(reports, policies))
    if not a.no_save:
        payload = {"benchmark": "serve-policy", "request_rate": a.request_rate, "num_prompts": a.num_prompts,
                   "max_tokens": a.max_tokens, "seed": a.seed, "step_time": dataclasses.asdict(step_time),
                   "prefix_caching": not a.no_prefix_caching,
                   "policies": {name: {"overrides": policies[name], **rep.as_dict(),
                                       "slowest_first_token": slowest_first_token(rep),
                                       "step_log": [dataclasses.asdict(s) for s in rep.step_log]}
                                for name, rep in reports.items()}}
        path = save_results(f"serve-policy-rate{a.request_rate:g}", payload,
                            Path(a.result_dir) if a.result_dir else None)
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
