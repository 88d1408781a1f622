"""``python -m minillm bench serving``: paged KV memory, batching policies and prefix caching, measured in one run.

Sections (each prints its figures, the target of notebooks 05–06, the ratio and whether it was met):

1. **KV memory** — a chat-length trace (lognormal prompts and outputs, hundreds of tokens) is laid out in a real
   ``BlockManager`` at its actual lengths: slots wasted by paging (16-token blocks) vs a contiguous reservation of
   ``reserve_len`` tokens per request, and how many of those requests fit a fixed KV budget each way.
   Bookkeeping only: no model runs.
2. **Batching** — one skewed trace (90 % short answers, 10 % long; all requests waiting at t = 0, an offline job, so
   throughput is the machine's capacity) through the real engine under static, dynamic and continuous batching,
   static twice: fixed-shape batches (finished members' rows still computed on a pad token until the batch ends —
   the textbook baseline, ``pad_batches=True``) and batches that drop finished rows (``pad_batches=False``, which a
   compute-bound CPU rewards); and through transformers' padded batched ``generate`` (same weights and dtype; by
   default one batch of every
   request — more concurrency than the engine's ``max_num_seqs``, which on a CPU only helps it — left padding,
   ``max_new_tokens`` = the longest; only each request's own tokens count as output).  With arrivals at t = 0,
   dynamic batching forms full batches at once, so it should match static; its window only matters when requests
   trickle in (section 4 shows that).
3. **Prefix caching** — requests whose prompts share a 90 % prefix, sent one after another (TTFT is then mostly
   prefill), with the prefix cache on and off.
4. **Virtual clock** — the same scheduler on a modelled Llama-2-7B / H100-SXM (``simulate.py``), Poisson arrivals:
   what the batching policies do where decode is memory bound.  Modelled, not measured.

Timings are wall clock on a machine that may be shared: the JSON records ``torch.get_num_threads()`` and the load
average before and after.  ``threads`` sets torch's thread count (on a loaded 2-core box one thread is steadier).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch

from minillm.config import EngineConfig
from minillm.kv.block_allocator import contiguous_reservation_waste, paged_waste
from minillm.kv.block_manager import BlockManager
from minillm.perf.simulate import (
    RequestRecord,
    RooflineStepTime,
    ServingReport,
    build_report,
    format_reports,
    kv_cache_budget,
    llama2_7b_config,
    record_from_metrics,
    replay,
    simulate,
)
from minillm.perf.workloads import (
    RequestSpec,
    corpus_token_ids,
    lognormal_lengths,
    make_trace,
    random_corpus,
    shared_prefix_trace,
    skewed_trace,
    trace_stats,
)
from minillm.sampling.params import SamplingParams


@dataclass(frozen=True)
class ServingBenchSize:
    """How big each section is.  ``FULL`` aims at ~5 minutes on a quiet 2-core CPU with SmolLM2-135M;
    ``QUICK`` at seconds (tests, smoke runs)."""

    # 2. batching trace
    num_requests: int = 128
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    prompt_len: tuple[int, int] = (8, 24)
    short: tuple[int, int] = (8, 32)
    long: tuple[int, int] = (128, 256)
    long_fraction: float = 0.1
    ttft_slo_s: float = 5.0  # CPU-scale SLO for the goodput column
    tpot_slo_s: float = 0.25
    # 3. prefix caching
    prefix_requests: int = 8
    prefix_prompt_len: int = 569  # 512 shared (32 blocks of 16) + 57 distinct
    shared_fraction: float = 0.9
    # 1. KV memory (bookkeeping only)
    kv_requests: int = 1000
    reserve_len: int = 2048  # contiguous reservation per request: the max sequence length (the vLLM paper's 2048)
    kv_budget_tokens: int = 16384  # fixed KV budget for the concurrency comparison
    # 4. virtual clock
    sim_requests: int = 400
    sim_rate: float = 12.0  # requests/s, Poisson
    hf: bool = True  # run the transformers baseline
    hf_batch_size: int | None = None  # None: one padded batch of every request (its most efficient use of a CPU)


FULL = ServingBenchSize()
QUICK = ServingBenchSize(num_requests=8, max_num_seqs=4, prompt_len=(4, 8), short=(2, 4), long=(12, 16),
                         long_fraction=0.25, prefix_requests=3, prefix_prompt_len=80, kv_requests=200,
                         kv_budget_tokens=4096, reserve_len=512, sim_requests=60)

SHRINKING = "static, rows dropped"  # static batching with pad_batches=False (reported next to the textbook one)
ENGINE_RUNS = {"continuous": ("continuous", True), "static": ("static", True), SHRINKING: ("static", False),
               "dynamic": ("dynamic", True)}  # section 2's engine runs: label -> (policy, pad_batches)

TARGETS = {  # the targets of notebooks 05–06
    "paged_waste": 0.04,  # paged KV wastes < 4 % (only partial last blocks)
    "concurrency_ratio": 3.0,  # ≥ 3× more sequences in the same KV budget
    "continuous_vs_static": 2.0,  # ≥ 2× throughput
    "continuous_vs_hf": 2.0,
    "prefix_ttft_ratio": 3.0,  # prefix hits cut TTFT ≥ 3×
}


# ---------------------------------------------------------------------------------------------- 1. KV memory
def chat_lengths_trace(n: int, seed: int = 0) -> list[RequestSpec]:
    """Lengths only (prompt ids are placeholders): lognormal prompts (median 200, σ 0.8, 16–1024 tokens) and
    outputs (median 150, σ 0.9, 8–1024) — hundreds of tokens, the scale of chat traffic."""
    prompts = lognormal_lengths(n, 200, 0.8, 16, 1024, seed=seed)
    outputs = lognormal_lengths(n, 150, 0.9, 8, 1024, seed=seed + 1)
    return make_trace([0.0] * n, prompts, outputs, [0] * 1024, seed=seed)


def kv_memory(trace: Sequence[RequestSpec], *, block_size: int = 16, reserve_len: int = 2048,
              budget_tokens: int = 16384) -> dict:
    """Lay every request out at its final length (prompt + output) in a real ``BlockManager``.

    Waste: the fraction of slots in used blocks holding no token (``MemoryStats.waste``, checked against
    ``paged_waste``) vs ``contiguous_reservation_waste`` with ``reserve_len`` slots per request.
    Concurrency: requests taken in trace order until the next no longer fits ``budget_tokens`` slots of paged
    blocks, vs ``budget_tokens // reserve_len`` contiguous reservations.
    """
    lens = [min(r.total_len, reserve_len) for r in trace]
    bm = BlockManager(sum(-(-n // block_size) for n in lens), block_size, enable_prefix_caching=False)
    for i, n in enumerate(lens):
        bm.allocate(i, list(range(n)))
    paged = bm.stats().waste
    assert math.isclose(paged, paged_waste(lens, block_size)), "BlockManager and paged_waste disagree"
    fit = BlockManager(budget_tokens // block_size, block_size, enable_prefix_caching=False)
    count = 0
    for n in lens:
        if not fit.can_allocate(n):
            break
        fit.allocate(count, list(range(n)))
        count += 1
    contiguous_fit = budget_tokens // reserve_len
    return {"requests": len(lens), "mean_len": sum(lens) / len(lens), "block_size": block_size,
            "reserve_len": reserve_len, "paged_waste": paged,
            "contiguous_waste": contiguous_reservation_waste(lens, reserve_len), "budget_tokens": budget_tokens,
            "paged_fit": count, "contiguous_fit": contiguous_fit,
            "concurrency_ratio": count / contiguous_fit if contiguous_fit else math.inf}


# ---------------------------------------------------------------------------------------------- 2. transformers
def hf_padded_generate(hf_model, trace: Sequence[RequestSpec], batch_size: int, pad_token_id: int, *,
                       ttft_slo_s: float = 1.0, tpot_slo_s: float = 0.1) -> ServingReport:
    """transformers' static batching: batches of ``batch_size`` requests in trace order, left-padded to the
    batch's longest prompt, greedy ``generate`` of ``max_new_tokens = min_new_tokens`` = the batch's longest
    output.  Padded rows cost a full row of every matmul at every step; a request's tokens after its own
    ``max_tokens`` are discarded.  Token times come from a streamer (one ``put`` per step), so TTFT / ITL / E2E
    are what a streaming client would see; every request is taken to arrive at t = 0 (an offline batch)."""
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []
            self.first = True

        def put(self, value):
            if self.first:  # the first call carries the prompt
                self.first = False
            else:
                self.times.append(time.perf_counter())

        def end(self):
            pass

    device = hf_model.device
    records: list[RequestRecord] = []
    steps = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    for k in range(0, len(trace), batch_size):
        batch = trace[k : k + batch_size]
        L = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), L), pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding: every prompt ends at column L - 1
            ids[i, L - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            mask[i, L - r.prompt_len :] = 1
        n_new = max(r.max_tokens for r in batch)
        clock = StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=n_new,
                              min_new_tokens=n_new, do_sample=False, pad_token_id=pad_token_id, streamer=clock)
        steps += n_new
        for i, r in enumerate(batch):
            t = clock.times[: r.max_tokens]
            itl = tuple(b - a for a, b in zip(t, t[1:], strict=False))
            tpot = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0
            records.append(RequestRecord(str(k + i), 0.0, r.prompt_len, len(t), 0, start - t0, t[0] - t0, tpot,
                                         t[-1] - t0, itl))
    return build_report("transformers padded", records, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s, steps=steps,
                        cpu_s=time.process_time() - cpu0)


# ---------------------------------------------------------------------------------------------- the run
def bench_serving(model: str | None = None, device: str | None = None, *, dtype: str | None = None,
                  threads: int | None = None, quick: bool = False, size: ServingBenchSize | None = None,
                  seed: int = 0, save: bool = True, out_dir=None) -> dict:
    """Run the four sections on ``model`` (default: the embedded SmolLM2-135M-Instruct) and print them;
    returns the results (also saved as ``benchmarks/results/serving-<device>.json`` unless ``save=False``)."""
    from minillm.models.loader import load_model, load_tokenizer, resolve, resolve_device

    size = size or (QUICK if quick else FULL)
    if threads is not None:
        torch.set_num_threads(threads)
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    dev = resolve_device(device)
    ours = load_model(model, dtype=dtype, device=str(dev))
    try:
        corpus = corpus_token_ids(load_tokenizer(model))
        corpus_name = "pydoc_data.topics through the model's tokenizer"
    except (FileNotFoundError, OSError, ValueError):
        corpus = random_corpus(ours.config.vocab_size, seed=seed)
        corpus_name = "uniform random token ids (no tokenizer)"
    print(f"bench serving: {model or 'default (SmolLM2-135M-Instruct)'}, {ours.dtype}, {dev}, "
          f"torch threads {torch.get_num_threads()}, load average {load_before[0]:.2f}")
    result: dict = {"benchmark": "serving", "model": model or "default (SmolLM2-135M-Instruct Q4_1 dequantized)",
                    "device": str(dev), "dtype": str(ours.dtype), "threads": torch.get_num_threads(),
                    "size": asdict(size), "corpus": corpus_name, "targets": TARGETS, "seed": seed}
    checks: list[tuple[str, float, str, bool]] = []

    # 1. KV memory
    kv = kv_memory(chat_lengths_trace(size.kv_requests, seed), reserve_len=size.reserve_len,
                   budget_tokens=size.kv_budget_tokens)
    result["kv_memory"] = kv
    _print_kv(kv)
    checks.append(("paged KV waste", kv["paged_waste"], f"< {TARGETS['paged_waste']:.0%}",
                   kv["paged_waste"] < TARGETS["paged_waste"]))
    checks.append(("sequences in a fixed KV budget, paged / contiguous", kv["concurrency_ratio"],
                   f">= {TARGETS['concurrency_ratio']:.0f}x", kv["concurrency_ratio"] >= TARGETS["concurrency_ratio"]))

    # 2. batching
    bat = batching(ours, resolve(model).directory if size.hf else None, corpus, size, seed)
    result.update(bat)
    by = bat["batching"]
    cont = by["continuous"]["output_tok_s"]
    ratio = cont / by["static"]["output_tok_s"]
    checks.append(("throughput continuous / static", ratio, f">= {TARGETS['continuous_vs_static']:.0f}x",
                   ratio >= TARGETS["continuous_vs_static"]))
    checks.append(("throughput continuous / static, rows dropped", cont / by[SHRINKING]["output_tok_s"],
                   "(no target)", True))
    checks.append(("throughput continuous / dynamic", cont / by["dynamic"]["output_tok_s"], "(no target)", True))
    if size.hf:
        ratio = cont / by["transformers padded"]["output_tok_s"]
        checks.append(("throughput continuous / transformers", ratio, f">= {TARGETS['continuous_vs_hf']:.0f}x",
                       ratio >= TARGETS["continuous_vs_hf"]))
    per_cpu = {k: v["output_tok_per_cpu_s"] for k, v in by.items()}  # the same ratios in CPU time (shared machine)
    for other in ("static", SHRINKING, "transformers padded"):
        if other in per_cpu:
            checks.append((f"  same per CPU-second, continuous / {other.replace(' padded', '')}",
                           per_cpu["continuous"] / per_cpu[other], "(no target)", True))

    # 3. prefix caching
    prefix = prefix_caching(ours, corpus, size, seed)
    result["prefix_caching"] = prefix
    checks.append(("TTFT p50 prefix cache off / on", prefix["ttft_ratio"], f">= {TARGETS['prefix_ttft_ratio']:.0f}x",
                   prefix["ttft_ratio"] >= TARGETS["prefix_ttft_ratio"]))

    # 4. virtual clock
    result["virtual_clock"] = virtual_clock(size, seed)

    result["targets_met"] = {name: bool(ok) for name, _, _, ok in checks}
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}
    result["runtime_s"] = time.perf_counter() - t_start
    print("\ntargets (notebooks 05-06)")
    for name, value, target, ok in checks:
        shown = f"{value:.1%}" if name == "paged KV waste" else f"{value:.2f}x"
        verdict = "" if target == "(no target)" else ("met" if ok else "NOT met")
        print(f"  {name:<52} {shown:>8}  {target:<8} {verdict}")
    print(f"runtime {result['runtime_s']:.0f} s; load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f} "
          f"({os.cpu_count()} cores, torch threads {torch.get_num_threads()})")
    if save:
        from minillm.perf.bench.decode import save_results

        print(f"saved {save_results('serving-' + dev.type, result, out_dir)}")
    return result


def batching(model, hf_checkpoint, corpus: Sequence[int], size: ServingBenchSize, seed: int = 0) -> dict:
    """Section 2: the skewed trace through the engine (continuous, static, dynamic), then through transformers'
    padded ``generate`` loaded from ``hf_checkpoint`` (skipped when None).  Prints progress and the table."""
    from transformers import AutoModelForCausalLM

    from minillm.engine.llm_engine import LLMEngine

    trace = skewed_trace(size.num_requests, corpus, prompt_len=size.prompt_len, short=size.short, long=size.long,
                         long_fraction=size.long_fraction, seed=seed)
    stats = trace_stats(trace)
    hf_batch = size.hf_batch_size or len(trace)
    print(f"\n2. batching: {stats['requests']} requests at t=0, prompts {size.prompt_len[0]}-{size.prompt_len[1]} "
          f"tokens, outputs {1 - size.long_fraction:.0%} in {size.short} / {size.long_fraction:.0%} in {size.long} "
          f"(mean {stats['output_mean']:.1f}, max {stats['output_max']}); max_num_seqs {size.max_num_seqs}; "
          f"SLO TTFT <= {size.ttft_slo_s} s and TPOT <= {size.tpot_slo_s * 1e3:.0f} ms"
          + (f"; transformers in batches of {hf_batch}" if hf_checkpoint is not None else ""), flush=True)
    longest = max(r.total_len for r in trace)
    blocks = size.max_num_seqs * -(-longest // 16) + 16  # every running sequence at full length: no preemption
    reports = []
    for label, (policy, pad) in ENGINE_RUNS.items():
        engine = LLMEngine(model, config=replace(engine_config(size, blocks, policy), pad_batches=pad))
        reports.append(replay(engine, trace, label=label, ttft_slo_s=size.ttft_slo_s, tpot_slo_s=size.tpot_slo_s,
                              warmup=True))
        padding = engine.stats.padding_rows
        print(f"   {label}: {reports[-1].duration_s:.1f} s"
              + (f", {padding} pad rows ({padding / (padding + reports[-1].output_tokens):.0%} of decode rows)"
                 if padding else ""), flush=True)
        del engine  # frees its KV cache
    if hf_checkpoint is not None:
        hf = AutoModelForCausalLM.from_pretrained(hf_checkpoint, dtype=model.dtype).to(model.device).eval()
        pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
        hf_padded_generate(hf, trace[:2], 2, pad)  # warm-up
        reports.append(hf_padded_generate(hf, trace, hf_batch, pad, ttft_slo_s=size.ttft_slo_s,
                                          tpot_slo_s=size.tpot_slo_s))
        print(f"   transformers padded: {reports[-1].duration_s:.1f} s", flush=True)
        del hf
    print(format_reports(reports))
    print("   output tokens per CPU-second: " + ", ".join(f"{r.label} {r.output_tokens / r.cpu_s:.1f}"
                                                          for r in reports))
    kv = kv_memory(trace, reserve_len=size.reserve_len, budget_tokens=size.kv_budget_tokens)
    print(f"   (this trace's own KV waste: paged {kv['paged_waste']:.1%} — short sequences, mean "
          f"{kv['mean_len']:.0f} tokens, each wasting ~half a block — contiguous {kv['contiguous_waste']:.1%})")
    by = {r.label: r for r in reports}
    model_here = roofline_here(model, trace, engine_config(size, blocks, "continuous"))
    measured = {k: by["continuous"].output_tok_s / by[k].output_tok_s for k in ("static", SHRINKING)}
    print(f"   roofline model of this machine (measured now: {model_here['read_gb_s']:.0f} GB/s read, "
          f"{model_here['peak_gflop_s']:.0f} GFLOP/s {model_here['dtype']} matmul; ridge "
          f"{model_here['ridge_flop_per_byte']:.1f} FLOP/byte, so a decode step is compute bound from ~"
          f"{model_here['ridge_batch']:.0f} sequences on): continuous / static modelled "
          f"{model_here['continuous_vs_static']:.2f}x, measured {measured['static']:.2f}x; continuous / static with "
          f"rows dropped modelled {model_here['continuous_vs_static_shrinking']:.2f}x, measured "
          f"{measured[SHRINKING]:.2f}x")
    return {"batching_trace": stats, "batching_trace_kv": kv, "batching": {r.label: r.as_dict() for r in reports},
            "batching_roofline_model": model_here}


def engine_config(size: ServingBenchSize, num_kv_blocks: int, policy: str) -> EngineConfig:
    """Section 2's engine: ``max_num_seqs`` and the token budget from ``size``, enough KV blocks that nothing is
    preempted, no prefix caching (the comparison is about batching alone)."""
    return EngineConfig(policy=policy, max_num_seqs=size.max_num_seqs,
                        max_num_batched_tokens=size.max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
                        enable_prefix_caching=False)


def roofline_here(model, trace: Sequence[RequestSpec], config: EngineConfig) -> dict:
    """The batching comparison on a virtual clock priced by *this* machine's measured roofline
    (``measure_device(quick=True)``, no per-step overhead): what the cost model expects continuous / static to
    gain here.  A decode step's intensity is ≈ 2·B / bytes-per-weight FLOP/byte, so past the ridge it is compute
    bound and its cost grows with B — and a static batch that drops its finished rows gets cheap steps."""
    from minillm.perf.hardware import dtype_bytes, dtype_name
    from minillm.perf.machine import machine_spec
    from minillm.perf.roofline import ridge_point

    spec = machine_spec(str(model.device), quick=True)
    dtype = dtype_name(model.dtype)
    step = RooflineStepTime(model.config, spec, dtype)
    runs = {label: simulate(trace, model.config, replace(config, policy=p, pad_batches=pad), step, dtype=dtype)
            for label, (p, pad) in ENGINE_RUNS.items() if label != "dynamic"}  # dynamic = static at t = 0
    ridge = ridge_point(spec, dtype)
    return {"read_gb_s": spec.memory_bandwidth / 1e9, "peak_gflop_s": spec.peak(dtype) / 1e9, "dtype": dtype,
            "ridge_flop_per_byte": ridge, "ridge_batch": ridge * dtype_bytes(dtype) / 2,
            "static_s": runs["static"].duration_s, "continuous_s": runs["continuous"].duration_s,
            "continuous_vs_static": runs["continuous"].output_tok_s / runs["static"].output_tok_s,
            "continuous_vs_static_shrinking": runs["continuous"].output_tok_s / runs[SHRINKING].output_tok_s}


def prefix_caching(model, corpus: Sequence[int], size: ServingBenchSize, seed: int = 0) -> dict:
    """TTFT of requests sharing ``shared_fraction`` of their prompt, sent one at a time, prefix cache on vs off.

    Two engines (cache on, cache off) take the requests in turn — request k goes to one, then the other, the
    order alternating — so a noisy neighbour slowing the machine for a while hits both alike.
    """
    from minillm.engine.llm_engine import LLMEngine

    trace = shared_prefix_trace(size.prefix_requests, corpus, prompt_len=size.prefix_prompt_len,
                                shared_fraction=size.shared_fraction, seed=seed)
    engines = {on: LLMEngine(model, config=EngineConfig(enable_prefix_caching=on, max_num_seqs=4,
                                                        max_num_batched_tokens=1024)) for on in (True, False)}
    for engine in engines.values():  # warm-up on unrelated tokens: first-call costs, no cache entries that matter
        engine.generate([list(range(1, 9))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    records: dict[bool, list[RequestRecord]] = {True: [], False: []}
    for k, spec in enumerate(trace):
        for on in ((True, False) if k % 2 == 0 else (False, True)):
            t0 = time.perf_counter()
            out = engines[on].generate([list(spec.prompt_token_ids)],
                                       SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True))[0]
            records[on].append(record_from_metrics(str(k), out.metrics, t0))
    on, off = (build_report(f"prefix cache {'on' if x else 'off'}", records[x]) for x in (True, False))
    hits = sum(r.prefix_hit_tokens for r in on.records)
    prompt_tokens = sum(r.prompt_tokens for r in on.records)
    out = {"requests": len(trace), "prompt_len": size.prefix_prompt_len,
           "shared_tokens": round(size.shared_fraction * size.prefix_prompt_len), "hit_rate": hits / prompt_tokens,
           "ttft_on": on.latency("ttft"), "ttft_off": off.latency("ttft"),
           "ttft_on_s": [r.ttft_s for r in on.records], "ttft_off_s": [r.ttft_s for r in off.records],
           "ttft_ratio": off.latency("ttft")["p50"] / on.latency("ttft")["p50"]}
    print(f"\n3. prefix caching: {len(trace)} requests of {size.prefix_prompt_len} tokens, the first "
          f"{out['shared_tokens']} shared, sent one after another to a cache-on and a cache-off engine in turn; "
          f"{hits} of {prompt_tokens} prompt tokens hit the cache ({out['hit_rate']:.0%})")
    print(f"   TTFT p50 off {out['ttft_off']['p50'] * 1e3:.0f} ms, on {out['ttft_on']['p50'] * 1e3:.0f} ms "
          f"(the first request, a miss: {on.records[0].ttft_s * 1e3:.0f} ms on, "
          f"{off.records[0].ttft_s * 1e3:.0f} ms off)")
    return out


def virtual_clock(size: ServingBenchSize, seed: int = 0) -> dict:
    """Static / dynamic / continuous for Llama-2-7B bf16 on an H100-SXM (roofline step times + 2 ms per step) on
    one request set, twice: all at t = 0 (capacity, comparable with section 2) and arriving as a Poisson stream at
    ``sim_rate`` (latency and goodput under load).  Lengths are section 2's shape scaled up ~4×."""
    from minillm.perf.hardware import get_spec

    cfg, spec = llama2_7b_config(), get_spec("H100-SXM")
    step = RooflineStepTime(cfg, spec, "bfloat16", overhead_s=2e-3)  # ~2 ms of CPU work per step (assumed)
    corpus = random_corpus(cfg.vocab_size, seed=seed)
    shape = {"prompt_len": (64, 512), "short": (32, 128), "long": (512, 1024), "long_fraction": 0.1, "seed": seed}
    engine = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_bytes=kv_cache_budget(cfg, spec),
                          dynamic_window_s=0.1)
    print(f"\n4. virtual clock (modelled, not measured): Llama-2-7B bf16 on {spec.name}, roofline step + 2 ms; "
          f"{size.sim_requests} requests, prompts 64-512, outputs 90% 32-128 / 10% 512-1024; max_num_seqs 64; "
          "SLO TTFT <= 500 ms and TPOT <= 50 ms")
    out = {"model": "Llama-2-7B", "hardware": spec.name, "overhead_s": step.overhead_s}
    for name, rate in (("offline", math.inf), ("poisson", size.sim_rate)):
        trace = skewed_trace(size.sim_requests, corpus, rate=rate, **shape)
        reports = [simulate(trace, cfg, replace(engine, policy=p), step, label=f"sim {p}", ttft_slo_s=0.5,
                            tpot_slo_s=0.05) for p in ("static", "dynamic", "continuous")]
        print(f"   {'all at t=0' if name == 'offline' else f'Poisson arrivals at {rate:g}/s'}:")
        print(format_reports(reports))
        by = {r.label: r for r in reports}
        out[name] = {"trace": trace_stats(trace), "reports": {r.label: r.as_dict() for r in reports},
                     "continuous_vs_static": by["sim continuous"].output_tok_s / by["sim static"].output_tok_s}
    return out


def _print_kv(kv: dict) -> None:
    print(f"\n1. KV memory: {kv['requests']} chat-length requests (mean {kv['mean_len']:.0f} tokens at the end), "
          f"blocks of {kv['block_size']} vs a contiguous {kv['reserve_len']}-token reservation each")
    print(f"   waste: paged {kv['paged_waste']:.1%}, contiguous {kv['contiguous_waste']:.1%}; "
          f"a {kv['budget_tokens']}-token KV budget holds {kv['paged_fit']} sequences paged, "
          f"{kv['contiguous_fit']} contiguous")


__all__ = ["FULL", "QUICK", "TARGETS", "ServingBenchSize", "bench_serving", "chat_lengths_trace",
           "hf_padded_generate", "kv_memory", "prefix_caching", "virtual_clock"]
