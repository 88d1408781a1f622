"""Replaying a trace: on the wall clock through the real engine, or on a virtual clock through the real scheduler.

- ``replay(engine, trace)`` adds each request to a real ``LLMEngine`` once the wall clock passes its arrival time
  and steps the engine otherwise.  What it measures is this machine.
- ``simulate(trace, model, config, step_time)`` runs the *same* ``Scheduler`` and ``BlockManager`` with no model at
  all: each step's duration comes from a cost model and the clock jumps by it; tokens are dummies and EOS never
  comes (lengths are the trace's).  ``RooflineStepTime`` prices a step on a datasheet machine —
  max(bytes / bandwidth, FLOPs / peak) + a fixed overhead — so "continuous vs static batching for Llama-2-7B on
  an H100" takes a second on a laptop.  The answer is as good as the roofline: it assumes every kernel reaches
  the roof, so read the ratios between policies, not the absolute figures.

Both return a ``ServingReport`` (per-request records; throughput; TTFT, TPOT, ITL and end-to-end percentiles;
goodput under an SLO), so a notebook can put measured and modelled runs side by side (``format_reports``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from minillm.config import EngineConfig, ModelConfig
from minillm.dtypes import DType, dtype_bytes, dtype_name
from minillm.engine.scheduler import Scheduler, SchedulerOutput
from minillm.engine.sequence import Request
from minillm.kv.paged_cache import kv_bytes_per_block
from minillm.kv.quant import kv_bytes_per_token
from minillm.models.configs import llama2_7b_config  # noqa: F401  (re-exported)
from minillm.outputs import RequestMetrics
from minillm.perf.hardware import HardwareSpec
from minillm.perf.metrics import goodput, summarize
from minillm.perf.roofline import Cost, attention_cost, linear_cost
from minillm.perf.workloads import RequestSpec
from minillm.sampling.params import SamplingParams

__all__ = ["RequestRecord", "RooflineStepTime", "ServingReport", "StepChunk", "StepRecord", "StepTimeModel",
           "build_report",
           "format_reports", "kv_cache_budget", "llama2_7b_config", "record_from_metrics", "replay", "simulate",
           "step_cost"]

DUMMY_TOKEN = 0  # what the virtual model "samples"; never EOS (the simulated scheduler has no EOS ids)


# ---------------------------------------------------------------------------------------------- the scorecard
@dataclass(frozen=True)
class RequestRecord:
    """What one request experienced, in seconds from the start of the replay (``arrival_s``) or as durations."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_hit_tokens: int  # prompt tokens served by the prefix cache
    queue_s: float  # arrival -> first scheduled
    ttft_s: float  # arrival -> first token
    tpot_s: float  # mean gap between output tokens after the first
    e2e_s: float  # arrival -> last token
    itl_s: tuple[float, ...]  # every gap between consecutive output tokens
    num_preemptions: int = 0

    @property
    def finish_s(self) -> float:
        return self.arrival_s + self.e2e_s


def record_from_metrics(request_id: str, m: RequestMetrics, t0: float) -> RequestRecord:
    """A ``RequestRecord`` from the engine's ``RequestMetrics`` (absolute times; ``t0`` = the replay's start)."""
    return RequestRecord(request_id, m.start_s - t0, m.prompt_tokens, m.output_tokens, m.prefix_hit_tokens, m.queue_s,
                         m.ttft_s, m.tpot_s, m.latency_s, tuple(m.itl_s), m.num_preemptions)


@dataclass(frozen=True)
class ServingReport:
    """A replay's results.  Throughputs are over ``duration_s``, first arrival to last finish (as vLLM's
    ``benchmark_serving`` counts them): output tok/s counts generated tokens, prefill tok/s the prompt tokens that
    were computed (prefix-cache hits excluded).  Latency summaries are {mean, p50, p90, p99, max} in seconds; ITL
    pools every inter-token gap of every request; TPOT is per request (requests with ≥ 2 output tokens)."""

    label: str
    records: tuple[RequestRecord, ...]
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    steps: int = 0
    preemptions: int = 0
    cpu_s: float | None = None  # process CPU seconds spent (wall-clock replays): steadier than wall time when
    #                             other processes share the cores, since time spent descheduled is not counted
    step_log: tuple[StepRecord, ...] = ()  # what the scheduler ran each step (``simulate``; empty otherwise)

    @property
    def duration_s(self) -> float:
        return max(r.finish_s for r in self.records) - min(r.arrival_s for r in self.records)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.records)

    @property
    def prefill_tokens(self) -> int:
        return sum(r.prompt_tokens - r.prefix_hit_tokens for r in self.records)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.duration_s

    @property
    def request_s(self) -> float:
        return len(self.records) / self.duration_s

    def latency(self, name: str) -> dict[str, float]:
        """Summary of "ttft", "tpot", "itl" or "e2e" (NaNs when no request has one, e.g. TPOT of 1-token outputs)."""
        if name == "itl":
            values = [g for r in self.records for g in r.itl_s]
        elif name == "tpot":
            values = [r.tpot_s for r in self.records if r.output_tokens >= 2]
        else:
            values = [getattr(r, f"{name}_s") for r in self.records]
        return summarize(values) if values else dict.fromkeys(("mean", "p50", "p90", "p99", "max"), math.nan)

    @property
    def goodput_req_s(self) -> float:
        """Requests/s that met TTFT ≤ ``ttft_slo_s`` and TPOT ≤ ``tpot_slo_s`` (``metrics.goodput``)."""
        return goodput(self.records, self.duration_s, ttft_slo_s=self.ttft_slo_s, tpot_slo_s=self.tpot_slo_s)

    @property
    def slo_attainment(self) -> float:
        """Fraction of requests that met the SLO."""
        good = goodput(self.records, 1.0, ttft_slo_s=self.ttft_slo_s, tpot_slo_s=self.tpot_slo_s)  # a count
        return good / len(self.records)

    def as_dict(self, with_records: bool = False) -> dict:
        d = {"label": self.label, "requests": len(self.records), "duration_s": self.duration_s,
             "output_tokens": self.output_tokens, "prefill_tokens": self.prefill_tokens,
             "output_tok_s": self.output_tok_s, "prefill_tok_s": self.prefill_tok_s, "request_s": self.request_s,
             **{name: self.latency(name) for name in ("ttft", "tpot", "itl", "e2e")},
             "ttft_slo_s": self.ttft_slo_s, "tpot_slo_s": self.tpot_slo_s, "goodput_req_s": self.goodput_req_s,
             "slo_attainment": self.slo_attainment, "steps": self.steps, "preemptions": self.preemptions,
             "cpu_s": self.cpu_s, "output_tok_per_cpu_s": self.output_tokens / self.cpu_s if self.cpu_s else None}
        if with_records:
            d["records"] = [dataclasses.asdict(r) for r in self.records]
        return d


def build_report(label: str, records: Sequence[RequestRecord], **kw) -> ServingReport:
    if not records:
        raise ValueError("a report needs at least one finished request")
    return ServingReport(label, tuple(records), **kw)


def format_reports(reports: Sequence[ServingReport]) -> str:
    """A side-by-side table: throughput, TTFT / TPOT / ITL p50 and p99 (ms), E2E (s), share of requests meeting
    the SLO (goodput = that share × requests / duration)."""
    head = (f"{'run':<22} {'req':>4} {'time s':>7} {'out tok/s':>9} {'pre tok/s':>9} {'TTFT p50/p99 ms':>17} "
            f"{'TPOT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'E2E p50/p99 s':>14} {'SLO met':>8}")
    lines = [head]
    for r in reports:
        t, p, i, e = (r.latency(n) for n in ("ttft", "tpot", "itl", "e2e"))
        lines.append(f"{r.label:<22} {len(r.records):>4} {r.duration_s:>7.2f} {r.output_tok_s:>9.1f} "
                     f"{r.prefill_tok_s:>9.1f} {t['p50'] * 1e3:>8.0f}/{t['p99'] * 1e3:<8.0f}"
                     f"{p['p50'] * 1e3:>8.1f}/{p['p99'] * 1e3:<7.1f}{i['p50'] * 1e3:>7.1f}/{i['p99'] * 1e3:<7.1f}"
                     f"{e['p50']:>7.2f}/{e['p99']:<6.2f} {r.slo_attainment:>7.0%}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- wall clock
def replay(engine, trace: Sequence[RequestSpec], *, max_concurrency: int | None = None, label: str = "",
           ttft_slo_s: float = 1.0, tpot_slo_s: float = 0.1, warmup: bool = False) -> ServingReport:
    """Serve ``trace`` with a real ``LLMEngine`` on the wall clock; returns its ``ServingReport``.

    A request is added as soon as the clock passes its arrival (while a step runs, new arrivals wait in the
    "network" and that wait counts in their TTFT: their arrival time is the trace's, not when they were added).
    ``max_concurrency`` caps requests in flight, like a fixed pool of clients: with arrivals all at 0 and
    ``max_concurrency=1`` each request is sent when the previous one finished (its arrival is then that moment).
    Greedy decoding with ``ignore_eos``: every request produces exactly its ``max_tokens``.
    ``warmup`` first runs one short request untimed (first-call allocations and library loading).
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be None or >= 1, got {max_concurrency!r}")
    if engine.has_unfinished_requests():
        raise ValueError("replay needs an idle engine: finish or abort its requests first")
    if warmup:
        engine.generate([list(trace[0].prompt_token_ids[:8])], _params(2))
    order = sorted(range(len(trace)), key=lambda k: trace[k].arrival_s)
    in_flight: set[str] = set()
    done: dict[str, RequestMetrics] = {}
    preemptions0 = engine.stats.preemptions
    steps = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    i = 0
    while i < len(order) or in_flight:
        now = time.perf_counter()
        while i < len(order) and t0 + trace[order[i]].arrival_s <= now and (
                max_concurrency is None or len(in_flight) < max_concurrency):
            spec = trace[order[i]]
            arrival = t0 + spec.arrival_s if max_concurrency is None else max(t0 + spec.arrival_s, now)
            in_flight.add(engine.add_request(list(spec.prompt_token_ids), _params(spec.max_tokens),
                                             request_id=str(order[i]), arrival_time=arrival))
            i += 1
        if not in_flight:  # idle until the next arrival
            time.sleep(max(0.0, t0 + trace[order[i]].arrival_s - time.perf_counter()))
            continue
        tokens_before = engine.stats.tokens
        updates = engine.step()
        steps += engine.stats.tokens > tokens_before  # count steps that ran something
        for u in updates:
            if u.finished:
                done[u.request_id] = engine.pop_output(u.request_id).metrics
                in_flight.discard(u.request_id)
        if not updates and not engine.scheduler.running:
            time.sleep(1e-3)  # a dynamic batch still collecting: let the clock move
    cpu_s = time.process_time() - cpu0
    records = [record_from_metrics(rid, done[rid], t0) for rid in sorted(done, key=int)]
    return build_report(label or engine.config.policy, records, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
                        steps=steps, preemptions=engine.stats.preemptions - preemptions0, cpu_s=cpu_s)


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------------------------------------- cost of a step
@dataclass(frozen=True)
class StepRecord:
    """What one simulated step ran: it started at ``start_s`` on the virtual clock and took ``duration_s``;
    ``prefill_tokens`` prompt (or re-prefill) tokens in ``prefill_chunks`` chunks beside ``decode_rows`` decodes;
    ``waiting`` sequences were still queued after it was scheduled, ``running`` held seats."""

    start_s: float
    duration_s: float
    prefill_tokens: int
    prefill_chunks: int
    decode_rows: int
    waiting: int
    running: int


@dataclass(frozen=True)
class StepChunk:
    """``num_new`` tokens of one sequence fed on top of ``num_past`` cached ones; ``samples`` if its last row goes
    through the LM head (a decode, or a prompt's last chunk)."""

    num_new: int
    num_past: int
    samples: bool = True


def step_cost(config: ModelConfig, chunks: Sequence[StepChunk], dtype: DType, kv_dtype: DType | None = None, *,
              weight_dtype: DType | None = None) -> Cost:
    """FLOPs and bytes of one packed engine step: all chunks' T = Σ num_new tokens go through every linear layer
    together (weights read **once**), attention runs per chunk over its own past + new keys, the new tokens' K/V
    are written, and the LM head runs only on sampling rows.

    The same arithmetic as ``roofline.prefill_cost`` / ``decode_step_cost``, generalised to a mixed batch: a single
    chunk (n, p) equals ``prefill_cost(config, 1, n, past_len=p)``; B one-token chunks over kv_len − 1 cached
    tokens equal ``decode_step_cost(config, B, kv_len)`` (the tests hold them together).
    """
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    c = config
    T = sum(ch.num_new for ch in chunks)
    rows = sum(ch.samples for ch in chunks)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    lin = {"dtype": dtype, "weight_dtype": weight_dtype}
    norm_bytes = 2 * c.hidden_size * dtype_bytes(dtype)  # input and post-attention RMSNorm weights
    dense = (linear_cost(T, c.hidden_size, c.q_size + 2 * c.kv_size, bias=c.qkv_bias, **lin)  # fused q/k/v
             + linear_cost(T, c.q_size, c.hidden_size, **lin)  # o_proj
             + linear_cost(T, c.hidden_size, 2 * c.intermediate_size, **lin)  # fused gate/up
             + linear_cost(T, c.intermediate_size, c.hidden_size, **lin)  # down_proj
             + Cost(0, norm_bytes, {"weights": norm_bytes}))
    # attention: per chunk (its own keys), accumulated as plain numbers (a step may hold hundreds of decodes)
    flops = kv = acts = 0.0
    for ch in chunks:
        a = attention_cost(1, ch.num_new, ch.num_past + ch.num_new, c.num_heads, c.num_kv_heads, c.head_dim, dtype,
                           kv_dtype=kv_dtype)
        flops, kv, acts = flops + a.flops, kv + a.breakdown["kv_cache"], acts + a.breakdown["activations"]
    attn = Cost(flops, kv + acts, {"kv_cache": kv, "activations": acts}, {"attention": flops})
    kv_write = T * kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, "auto", kv_dtype)  # new K/V
    lookup = T * c.hidden_size * dtype_bytes(dtype)  # embedding rows gathered
    final_norm = c.hidden_size * dtype_bytes(dtype)
    extra = Cost(0, kv_write + lookup + final_norm,
                 {"kv_cache": kv_write, "activations": lookup, "weights": final_norm})
    total = c.num_layers * (dense + attn) + extra
    if rows:  # the LM head reads its whole V × hidden matrix once, for the sampling rows only
        total = total + linear_cost(rows, c.hidden_size, c.vocab_size, **lin)
    return total


class StepTimeModel(Protocol):
    """Seconds one engine step takes, given its chunks."""

    def __call__(self, chunks: Sequence[StepChunk]) -> float: ...


@dataclass(frozen=True)
class RooflineStepTime:
    """A step on ``hardware`` takes max(bytes / bandwidth, FLOPs / peak(dtype)) + ``overhead_s``.

    The max over the *whole* step assumes memory traffic and math overlap perfectly and every kernel reaches its
    roof — a lower bound on a real step.  ``overhead_s`` stands for the per-step CPU work a real engine does
    (scheduling, launching kernels, sampling); a few ms in Python engines without CUDA graphs.
    """

    model: ModelConfig
    hardware: HardwareSpec
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    overhead_s: float = 0.0

    def __post_init__(self):
        dtype_name(self.dtype)  # validates
        self.hardware.peak(self.dtype)  # the machine must list a peak for it
        if not self.overhead_s >= 0:
            raise ValueError(f"overhead_s must be >= 0, got {self.overhead_s!r}")

    def cost(self, chunks: Sequence[StepChunk]) -> Cost:
        return step_cost(self.model, chunks, self.dtype, self.kv_dtype)

    def __call__(self, chunks: Sequence[StepChunk]) -> float:
        c = self.cost(chunks)
        return max(c.bytes / self.hardware.memory_bandwidth, c.flops / self.hardware.peak(self.dtype)) + self.overhead_s


def kv_cache_budget(model: ModelConfig, hardware: HardwareSpec, dtype: DType = "bfloat16",
                    utilization: float = 0.9) -> int:
    """Bytes left for the KV cache: ``utilization`` of the device memory (vLLM's default
    ``gpu_memory_utilization=0.9``) minus the weights.  Llama-2-7B bf16 on an 80 GB H100: 72 − 13.5 ≈ 58.5 GB."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    budget = int(hardware.memory_capacity * utilization - model.num_parameters() * dtype_bytes(dtype))
    if budget <= 0:
        raise ValueError(f"{hardware.name} ({hardware.memory_capacity / 1e9:.0f} GB at {utilization:.0%}) has no room "
                         f"for a KV cache after this model's {model.num_parameters() / 1e9:.1f}B weights")
    return budget


# ---------------------------------------------------------------------------------------------- virtual clock
def simulate(trace: Sequence[RequestSpec], model: ModelConfig, config: EngineConfig, step_time: StepTimeModel, *,
             dtype: str = "bfloat16", swap_bandwidth: float = 64e9, label: str = "", ttft_slo_s: float = 1.0,
             tpot_slo_s: float = 0.1) -> ServingReport:
    """Serve ``trace`` on a virtual clock: the real ``Scheduler`` (policy, token budget, chunked prefill, KV blocks,
    preemption) decides each step, ``step_time`` says how long it took, and the clock jumps by that.

    KV blocks come from ``config`` as in ``LLMEngine`` (``num_kv_blocks``, or ``kv_cache_bytes`` of K/V in ``dtype``
    — see ``kv_cache_budget``).  Swap copies cost block bytes / ``swap_bandwidth`` (default 64e9: PCIe 5.0 x16,
    nominal per direction); copy-on-write copies within the device are left out (µs).  When nothing can run, the
    clock jumps to the next arrival or to the end of the dynamic-batching window.
    """
    max_model_len = min(model.max_position_embeddings, config.max_model_len or model.max_position_embeddings)
    block_bytes = kv_bytes_per_block(model, config.block_size, dtype)
    num_blocks = config.resolve_num_blocks(block_bytes, max_model_len)
    sched = Scheduler(config, num_blocks, max_model_len, num_host_blocks=config.resolve_host_blocks(num_blocks))
    requests = [Request(str(k), list(spec.prompt_token_ids), _params(spec.max_tokens), spec.arrival_s, [None])
                for k, spec in enumerate(trace)]
    log = run_clock(sched, requests, config, step_time, block_bytes, swap_bandwidth)
    records = [record_from_metrics(r.request_id, r.seqs[0].metrics, 0.0) for r in requests]
    records.sort(key=lambda r: int(r.request_id))
    return build_report(label or config.policy, records, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
                        steps=len(log), preemptions=sched.stats.preemptions, step_log=tuple(log))


def run_clock(sched: Scheduler, requests: Sequence[Request], config: EngineConfig, step_time: StepTimeModel,
              block_bytes: int, swap_bandwidth: float) -> list[StepRecord]:
    """Drive ``sched`` on a virtual clock from 0: each request is added at its ``arrival_time`` (``sched.add``
    raises ValueError for one that could never fit, as the engine does), every non-empty step advances the clock by
    ``step_time`` plus its swap copies, an idle scheduler jumps to its next wake-up.  Fills the requests' metrics;
    returns what each step ran (``StepRecord``).  ``simulate`` and ``disagg``'s decode instances share it."""
    pending = sorted(requests, key=lambda r: r.arrival_time)
    now, i, log = 0.0, 0, []
    while i < len(pending) or sched.has_unfinished():
        while i < len(pending) and pending[i].arrival_time <= now:
            sched.add(pending[i])
            i += 1
        out = sched.schedule(now)
        copy_s = _swap_seconds(out, block_bytes, swap_bandwidth)
        if out.is_empty:
            wake = _next_wake(sched, pending[i].arrival_time if i < len(pending) else math.inf, config)
            if math.isinf(wake) and not copy_s:
                raise RuntimeError("the simulated scheduler stopped making progress with requests unfinished")
            now = max(now + copy_s, wake if wake > now else math.nextafter(now, math.inf))
            continue
        chunks = [StepChunk(s.num_tokens, s.start, s.samples) for s in out.scheduled]
        chunks += [StepChunk(1, 0, True)] * out.num_padding  # a fixed-shape batch's finished rows: one token each
        prefills = [s.num_tokens for s in out.scheduled if s.start < s.seq.num_prompt_tokens or s.num_tokens > 1]
        duration = step_time(chunks) + copy_s
        log.append(StepRecord(now, duration, sum(prefills), len(prefills), len(out.scheduled) - len(prefills),
                              len(sched.waiting), len(sched.running)))
        now += duration
        sched.postprocess(out, [[DUMMY_TOKEN] * s.num_samples for s in out.scheduled if s.samples], now)
    return log


def _swap_seconds(out: SchedulerOutput, block_bytes: int, bandwidth: float) -> float:
    from minillm.kv.block_allocator import CopyKind

    swaps = sum(c.kind is not CopyKind.COPY_ON_WRITE for c in out.copies)
    return swaps * block_bytes / bandwidth


def _next_wake(sched: Scheduler, next_arrival: float, config: EngineConfig) -> float:
    """When an idle scheduler may next have work: the next arrival, or a dynamic batch's window closing."""
    if sched.waiting and not sched.running and config.policy == "dynamic":
        oldest = min(s.request.arrival_time for s in sched.waiting)
        return min(next_arrival, oldest + config.dynamic_window_s)
    return next_arrival
