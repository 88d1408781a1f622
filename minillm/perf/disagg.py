"""Prefill/decode disaggregation on the virtual clock: N GPUs as N colocated instances, or P prefill + D decode.

A colocated instance runs prefills and decodes in the same steps, so a long prompt's chunk stalls every decode
batched with it (a 2048-token chunk of Llama-2-7B is ~30 ms on an H100, against ~6 ms for a decode step): the
*prefill interference* that DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al., ISCA 2024) remove by
giving the two phases different GPUs.  The price: each request's K/V cache crosses a link once, and a fixed
number of GPUs split P:D may suit one workload's prefill/decode balance and not another's.

How a request flows here, all on the virtual clock and through the real ``Scheduler`` (``simulate.py``):

1. It arrives and goes, round robin, to one of the P prefill instances — ``simulate`` with ``max_tokens=1``: the
   instance computes the prompt, samples the first token, and is done with it.
2. Its K/V (``kv_transfer_bytes``: prompt tokens × 2 × layers × H_kv × D × dtype bytes) crosses the ``Link``:
   latency + bytes / bandwidth (``transfer_seconds``), starting when the prefill ends.
3. It joins, round robin in K/V arrival order, one of the D decode instances, whose scheduler admits it when KV
   blocks allow, with the prompt's tokens already computed (``KVReceivingScheduler``, what vLLM's KV connector
   reports as external hits) — so its first step there is a one-token decode.

Choices (simplifications) a reader should know:
- **TTFT counts the transfer**: the client's stream comes from the decode instance (as behind vLLM's disaggregation
  proxy), so the first token reaches it when the K/V has arrived: TTFT = queue + prefill + transfer.  Waiting for
  a decode seat shows up as the first inter-token gap (in TPOT), not in TTFT.  A 1-token request ends at the
  prefill instance (no transfer).
- The K/V waits on the prefill side until a decode instance admits it; that wait holds no prefill-side blocks here
  (a real prefill instance keeps them until the pull), and transfers never contend for the link.
- Round robin everywhere (colocated too): instances never see each other's load, so each is simulated on its own.
- A decode instance that preempts a request by recompute prefills it again itself (the K/V is not re-sent).
Read the ratios between deployments, not the absolute figures (the roofline prices every kernel at its roof).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from minillm.config import EngineConfig, ModelConfig
from minillm.dtypes import DType
from minillm.engine.scheduler import Scheduler
from minillm.engine.sequence import Request
from minillm.engine.sequence import Sequence as Seq
from minillm.kv.paged_cache import kv_bytes_per_block
from minillm.kv.quant import kv_bytes_per_token
from minillm.models.configs import llama3_8b_config  # noqa: F401  (re-exported)
from minillm.perf.simulate import (
    DUMMY_TOKEN,
    RequestRecord,
    ServingReport,
    StepTimeModel,
    _params,
    build_report,
    run_clock,
    simulate,
)
from minillm.perf.tp_cost import LINKS, Link
from minillm.perf.workloads import RequestSpec, make_trace, poisson_arrivals, uniform_lengths

__all__ = ["KV_LINKS", "KVReceivingScheduler", "PDSplit", "Workload", "best_split", "chat_workload", "colocated",
           "disaggregated", "kv_transfer_bytes", "llama3_8b_config", "long_prompt_workload", "max_rate_at_slo", "sweep",
           "transfer_seconds"]

KV_LINKS: dict[str, Link] = {
    # NVLink 4 (H100 SXM): 900 GB/s is both directions together; one GPU sends K/V at 450 GB/s.
    "NVLink": dataclasses.replace(LINKS["H100-NVLink"], name="NVLink"),
    # PCIe 5.0 x16: 32 GT/s × 16 lanes ≈ 64 GB/s per direction (PCI-SIG), e.g. two GPUs on one host without NVLink.
    "PCIe": dataclasses.replace(LINKS["H100-PCIe"], name="PCIe"),
    # InfiniBand NDR: 400 Gb/s per port = 50 GB/s (NVIDIA ConnectX-7), between nodes; latency assumed (RDMA ~µs,
    # plus setting up the transfer).
    "InfiniBand": Link("InfiniBand", 50e9, 30e-6, "InfiniBand NDR 400 Gb/s = 50 GB/s per port; α assumed"),
    # 25 Gb/s Ethernet ≈ 3.1 GB/s: the commodity cross-node bandwidth DistServe (§4.3) plans placement around;
    # latency assumed (TCP).  Here to show when the link, not the GPUs, decides.
    "Ethernet-25G": Link("Ethernet-25G", 25e9 / 8, 100e-6, "25 Gb/s Ethernet = 3.125 GB/s; α assumed"),
}


def kv_transfer_bytes(config: ModelConfig, num_tokens: int, dtype: DType = "bfloat16") -> float:
    """Bytes of K/V that ``num_tokens`` cached tokens hold: tokens × 2 (K and V) × layers × H_kv × D × dtype bytes.
    Llama-2-7B (MHA, 32 × 32 × 128) in bf16: 0.5 MiB per token, 2 GiB for a 4096-token prompt."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")
    return num_tokens * kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, "auto", dtype)


def transfer_seconds(nbytes: float, link: Link) -> float:
    """Seconds to send ``nbytes`` over ``link``: its fixed latency + bytes / bandwidth (an infinite bandwidth
    leaves the latency).  ValueError for a negative or NaN byte count."""
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be a number >= 0 (bytes of K/V to send), got {nbytes!r}")
    return link.latency_s + nbytes / link.bandwidth


@dataclass(frozen=True)
class PDSplit:
    """``num_instances`` GPUs (one model replica each) as ``num_prefill`` prefill and ``num_decode`` decode
    instances, joined by ``link``."""

    num_instances: int
    num_prefill: int
    num_decode: int
    link: Link

    def __post_init__(self):
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"a disaggregated deployment needs >= 1 prefill and >= 1 decode instance, got "
                             f"num_prefill={self.num_prefill}, num_decode={self.num_decode}")
        if self.num_prefill + self.num_decode != self.num_instances:
            raise ValueError(f"num_prefill + num_decode must equal num_instances: {self.num_prefill} + "
                             f"{self.num_decode} != {self.num_instances}")

    @property
    def label(self) -> str:
        return f"{self.num_prefill}P:{self.num_decode}D {self.link.name}"


class KVReceivingScheduler(Scheduler):
    """A decode instance's scheduler: the real ``Scheduler``, except that a request's first admission finds all
    but its last token already computed — the prompt's K/V came over the link (vLLM's KV connector reports them
    the same way, as externally computed tokens the scheduler allocates blocks for and skips).  The last token is
    the first output token, sampled by the prefill instance; its K/V is the decode instance's first step.
    Admission still needs blocks for every token, so a full decode instance keeps new arrivals waiting."""

    def _start_running(self, seq: Seq, hits: int, now: float) -> None:
        if seq.metrics.first_scheduled_s is None:  # after a recompute preemption it prefills again, itself
            hits = max(hits, seq.num_tokens - 1)
        super()._start_running(seq, hits, now)


# ---------------------------------------------------------------------------------------------- deployments
def colocated(trace: Sequence[RequestSpec], model: ModelConfig, config: EngineConfig, step_time: StepTimeModel,
              num_instances: int, *, dtype: str = "bfloat16", ttft_slo_s: float = 1.0, tpot_slo_s: float = 0.1,
              label: str = "") -> ServingReport:
    """``num_instances`` instances that each prefill and decode (``simulate``), requests dealt round robin in
    arrival order; one report over all of them."""
    if num_instances < 1:
        raise ValueError(f"num_instances must be >= 1, got {num_instances!r}")
    order = sorted(range(len(trace)), key=lambda k: trace[k].arrival_s)
    records, steps, preemptions = [], 0, 0
    for i in range(num_instances):
        ids = order[i::num_instances]
        if not ids:
            continue
        rep = simulate([trace[k] for k in ids], model, config, step_time, dtype=dtype)
        records += [dataclasses.replace(r, request_id=str(ids[int(r.request_id)])) for r in rep.records]
        steps, preemptions = steps + rep.steps, preemptions + rep.preemptions
    records.sort(key=lambda r: int(r.request_id))
    return build_report(label or f"colocated x{num_instances}", records, ttft_slo_s=ttft_slo_s,
                        tpot_slo_s=tpot_slo_s, steps=steps, preemptions=preemptions)


def disaggregated(trace: Sequence[RequestSpec], model: ModelConfig, config: EngineConfig,
                  step_time: StepTimeModel, split: PDSplit, *, decode_step_time: StepTimeModel | None = None,
                  dtype: str = "bfloat16", ttft_slo_s: float = 1.0, tpot_slo_s: float = 0.1,
                  label: str = "") -> ServingReport:
    """Serve ``trace`` on ``split.num_prefill`` prefill and ``split.num_decode`` decode instances (module
    docstring: the flow and the choices).  Every instance has ``config`` (its own KV blocks and queue);
    ``decode_step_time`` prices decode instances' steps (default ``step_time``)."""
    order = sorted(range(len(trace)), key=lambda k: trace[k].arrival_s)
    first_token: dict[int, tuple[float, RequestRecord]] = {}  # trace index -> (time sampled, prefill record)
    steps = preemptions = 0
    for i in range(split.num_prefill):  # 1. prefill instances: the prompt and its first token
        ids = order[i::split.num_prefill]
        if not ids:
            continue
        rep = simulate([dataclasses.replace(trace[k], max_tokens=1) for k in ids], model, config, step_time,
                       dtype=dtype)
        for r in rep.records:
            first_token[ids[int(r.request_id)]] = (r.arrival_s + r.ttft_s, r)
        steps, preemptions = steps + rep.steps, preemptions + rep.preemptions
    kv_at = {k: t + transfer_seconds(kv_transfer_bytes(model, len(trace[k].prompt_token_ids), dtype), split.link)
             for k, (t, _) in first_token.items() if trace[k].max_tokens > 1}  # 2. the K/V crosses the link
    by_arrival = sorted(kv_at, key=lambda k: (kv_at[k], k))
    decoded: dict[int, list[float]] = {}  # trace index -> times of tokens 2..n
    for i in range(split.num_decode):  # 3. decode instances
        ids = by_arrival[i::split.num_decode]
        if not ids:
            continue
        reqs = [Request(str(k), [*trace[k].prompt_token_ids, DUMMY_TOKEN], _params(trace[k].max_tokens - 1),
                        kv_at[k], [None]) for k in ids]
        s, p = _decode_instance(reqs, model, config, decode_step_time or step_time, dtype)
        steps, preemptions = steps + s, preemptions + p
        decoded.update((int(r.request_id), list(r.seqs[0].metrics.token_times_s)) for r in reqs)
    records = []
    for k in sorted(first_token):
        t_first, pre = first_token[k]
        times = [kv_at[k], *decoded[k]] if k in decoded else [t_first]
        itl = tuple(b - a for a, b in zip(times, times[1:], strict=False))
        records.append(RequestRecord(str(k), pre.arrival_s, pre.prompt_tokens, len(times), 0, pre.queue_s,
                                     times[0] - pre.arrival_s, sum(itl) / len(itl) if itl else 0.0,
                                     times[-1] - pre.arrival_s, itl, pre.num_preemptions))
    return build_report(label or split.label, records, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s, steps=steps,
                        preemptions=preemptions)


def _decode_instance(requests: Sequence[Request], model: ModelConfig, config: EngineConfig,
                     step_time: StepTimeModel, dtype: str, swap_bandwidth: float = 64e9) -> tuple[int, int]:
    """``simulate``'s clock (``run_clock``) with a ``KVReceivingScheduler``: each request joins at its
    ``arrival_time`` (its K/V has arrived).  Fills the requests' metrics; returns (steps, preemptions)."""
    max_model_len = min(model.max_position_embeddings, config.max_model_len or model.max_position_embeddings)
    block_bytes = kv_bytes_per_block(model, config.block_size, dtype)
    num_blocks = config.resolve_num_blocks(block_bytes, max_model_len)
    sched = KVReceivingScheduler(config, num_blocks, max_model_len,
                                 num_host_blocks=config.resolve_host_blocks(num_blocks))
    steps = len(run_clock(sched, requests, config, step_time, block_bytes, swap_bandwidth))
    return steps, sched.stats.preemptions


# ---------------------------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    """A trace shape: uniform prompt and output lengths, Poisson arrivals, and the SLO it is judged by."""

    name: str
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    ttft_slo_s: float
    tpot_slo_s: float

    def __post_init__(self):
        if not (1 <= self.prompt_len[0] <= self.prompt_len[1] and 1 <= self.output_len[0] <= self.output_len[1]):
            raise ValueError(f"{self.name}: need 1 <= lo <= hi for prompt_len and output_len")
        if not (self.ttft_slo_s > 0 and self.tpot_slo_s > 0):
            raise ValueError(f"{self.name}: SLOs must be > 0")

    def trace(self, n: int, rate: float, corpus: Sequence[int], seed: int = 0) -> list[RequestSpec]:
        """``n`` requests arriving as a Poisson stream of ``rate`` req/s; deterministic given ``seed``."""
        return make_trace(poisson_arrivals(n, rate, seed), uniform_lengths(n, *self.prompt_len, seed=seed + 1),
                          uniform_lengths(n, *self.output_len, seed=seed + 2), corpus, seed=seed + 3)


def long_prompt_workload() -> Workload:
    """Long documents, short answers (summarisation, RAG): prompts 2–8 k tokens, outputs 32–128; SLO TTFT ≤ 1 s,
    TPOT ≤ 15 ms (about twice an unloaded Llama-3-8B decode step on an H100 with 2 ms of overhead)."""
    return Workload("long prompts", (2048, 8064), (32, 128), 1.0, 0.015)


def chat_workload() -> Workload:
    """Chat: prompts 64–512 tokens, outputs 32–256; SLO TTFT ≤ 200 ms, TPOT ≤ 15 ms."""
    return Workload("chat", (64, 512), (32, 256), 0.2, 0.015)


# ---------------------------------------------------------------------------------------------- the sweep
def max_rate_at_slo(rates: Sequence[float], attainment: Sequence[float], target: float = 0.9) -> float:
    """Goodput as DistServe defines it: the highest offered rate (req/s) whose SLO attainment is ≥ ``target``,
    read off a sweep (``rates`` ascending); 0 if none meets it.  Rates after the first miss do not count (a noisy
    recovery above the knee is not capacity).  ValueError when the lists differ in length or ``target`` is not
    a share in (0, 1]."""
    if len(rates) != len(attainment):
        raise ValueError(f"rates and attainment must pair up: {len(rates)} rates, {len(attainment)} shares")
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target is the share of requests within the SLO, in (0, 1]; got {target!r}")
    best = 0.0
    for rate, share in zip(rates, attainment, strict=True):
        if share < target:
            break
        best = rate
    return best


def sweep(workload: Workload, model: ModelConfig, config: EngineConfig, step_time: StepTimeModel, *,
          num_instances: int, rates: Sequence[float], links: Iterable[Link], num_requests: int,
          corpus: Sequence[int], seed: int = 0, target: float = 0.9, min_duration_s: float = 0.0) -> list[dict]:
    """Colocated and every P:D split of ``num_instances`` over every link, at each offered rate (req/s over the
    whole deployment).  One row per deployment: SLO attainment and goodput (req/s) per rate, and
    ``goodput_at_slo`` = ``max_rate_at_slo``.  The same trace (per rate) for every deployment: ``num_requests``, or
    more so that arrivals last ``min_duration_s`` — a burst shorter than a request's life never finds the knee."""
    traces = {r: workload.trace(max(num_requests, math.ceil(r * min_duration_s)), r, corpus, seed) for r in rates}
    kw = {"ttft_slo_s": workload.ttft_slo_s, "tpot_slo_s": workload.tpot_slo_s}
    runs = [("colocated", None, lambda t: colocated(t, model, config, step_time, num_instances, **kw))]
    for link in links:
        for p in range(1, num_instances):
            split = PDSplit(num_instances, p, num_instances - p, link)
            runs.append((split.label, split,
                         lambda t, s=split: disaggregated(t, model, config, step_time, s, **kw)))
    rows = []
    for name, split, run in runs:
        reports = [run(traces[r]) for r in rates]
        attain = [rep.slo_attainment for rep in reports]
        rows.append({"deployment": name, "workload": workload.name, "num_instances": num_instances,
                     "num_prefill": split.num_prefill if split else 0, "num_decode": split.num_decode if split else 0,
                     "link": split.link.name if split else None, "rates": list(rates), "slo_attainment": attain,
                     "goodput_req_s": [rep.goodput_req_s for rep in reports],
                     "ttft_p90_s": [rep.latency("ttft")["p90"] for rep in reports],
                     "tpot_p90_s": [rep.latency("tpot")["p90"] for rep in reports],
                     "goodput_at_slo": max_rate_at_slo(rates, attain, target)})
    return rows


def best_split(rows: Sequence[dict], link: str) -> dict:
    """The row of ``sweep`` with the highest goodput at the SLO among ``link``'s P:D splits (ties: fewer prefill
    instances)."""
    candidates = [r for r in rows if r["link"] == link]
    if not candidates:
        raise ValueError(f"no disaggregated rows for link {link!r}")
    return max(candidates, key=lambda r: (r["goodput_at_slo"], -r["num_prefill"]))
