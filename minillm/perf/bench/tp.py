"""``python -m minillm bench tp``: what tensor parallelism costs and buys on this machine, and on paper on an H100.

1. The all-reduce a row-parallel layer does, timed over two gloo processes: [1, hidden] fp32 (one decode token),
   median of many calls; a decoder layer does two.
2. Decode tok/s of one request at TP=1 (one process, all cores) and TP=2 (two processes, cores split), on a model
   of the default model's size with random weights — TP=2 twice: SPMD (each rank runs its own engine, no step
   messages) and through ``TPDriver`` as ``LLM`` runs it (one scheduler; each step's inputs sent once).
   SmolLM2-135M has 9 query / 3 K/V heads, which 2 does not divide, so the bench uses 8 query / 2 K/V heads of 64
   (hidden 576, 30 layers, MLP 1536, vocab 49152 as the default).
3. The cost model's per-layer figures for Llama-2-7B and 70B on an H100 NVLink / PCIe node
   (``perf/tp_cost.py``).
4. Pipeline parallelism over two processes: the bubble of a micro-batched forward measured at several micro-batch
   counts m against GPipe's (p − 1)/(m + p − 1) and against ``gpipe_schedule`` fed the measured stage times.
Results go to ``benchmarks/results/tp-cpu.json``.  On a shared machine both TP runs see the same neighbours only
roughly: run it when the machine is quiet and read the ratio, not the absolute figures.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from minillm.config import ModelConfig
from minillm.models.configs import smollm2_135m_config

PROMPT = list(range(1, 17))


def default_like_config() -> ModelConfig:
    """SmolLM2-135M's shape with heads that 2 divides (8 × 64 query, 2 × 64 K/V instead of 9 and 3)."""
    return dataclasses.replace(smollm2_135m_config(), num_heads=8, num_kv_heads=2, max_position_embeddings=2048)


def random_model(config: ModelConfig, seed: int = 0):
    """A ``Transformer`` of ``config`` with N(0, 0.02) weights and unit norms (fp32, CPU)."""
    from minillm.models.llama import Transformer

    torch.manual_seed(seed)
    model = Transformer(config)
    for name, p in model.named_parameters():
        torch.nn.init.ones_(p) if "norm" in name else torch.nn.init.normal_(p, std=0.02)
    return model.requires_grad_(False).eval()


def _allreduce_worker(ctx, hidden: int, iters: int) -> float:
    from minillm.distributed import comm

    x = torch.randn(1, hidden)
    times = []
    for i in range(iters + 20):  # 20 warm-up calls: connection set-up and first-touch costs
        comm.barrier(ctx)  # start together: otherwise the time includes waiting for the other rank
        t = time.perf_counter()
        comm.all_reduce(x.clone(), ctx)
        if i >= 20:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def allreduce_worker(ctx, numels: list[int], iters: int) -> dict[int, float]:
    """Median seconds of one all-reduce of ``n`` fp32 values, for each n in ``numels`` (run by ``run_workers``)."""
    return {n: _allreduce_worker(ctx, n, iters) for n in numels}


def decode_tok_s(ctx, model, n_tokens: int, repeats: int) -> float:
    """Best decode tok/s of one request of ``n_tokens`` on this rank's shard of ``model`` (run by ``run_workers``)."""
    return _decode_worker(ctx, model, n_tokens, repeats)


def _decode_worker(ctx, model, n_tokens: int, repeats: int) -> float:
    from minillm.config import EngineConfig
    from minillm.distributed.executor import rank_model
    from minillm.engine.llm_engine import LLMEngine

    return _best_decode(LLMEngine(rank_model(ctx, model), None, EngineConfig(max_num_seqs=1, num_kv_blocks=64)),
                        n_tokens, repeats)


def _best_decode(engine, n_tokens: int, repeats: int) -> float:
    """Best decode tok/s of one request of ``n_tokens`` over ``repeats`` runs after a warm-up run."""
    from minillm.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    best = 0.0
    for _ in range(repeats + 1):  # the first run warms caches and the native kernels' build
        out = engine.generate([PROMPT], params)[0]
        best = max(best, out.metrics.decode_tokens_per_s)
    return best


def driver_decode_tok_s(model, n_tokens: int, repeats: int, tp: int = 2, threads: int = 1) -> float:
    """Best decode tok/s of one request through ``TPDriver`` (what ``LLM(tensor_parallel_size=tp)`` runs): this
    process is rank 0 and schedules, samples and sends each step (a pipe header and one broadcast) to ``tp − 1``
    persistent workers; ``threads`` torch threads per rank, this process's own restored afterwards."""
    from minillm.config import EngineConfig
    from minillm.distributed.driver import TPDriver
    from minillm.engine.llm_engine import LLMEngine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    driver = TPDriver(model, tp, threads_per_worker=threads)
    try:
        config = EngineConfig(max_num_seqs=1, num_kv_blocks=64)
        return _best_decode(LLMEngine(driver.model, None, config, executor=driver), n_tokens, repeats)
    finally:
        driver.shutdown()
        torch.set_num_threads(before)


def _bubble_worker(ctx, model, input_ids, positions, microbatches: list[int], repeats: int, all_logits: bool):
    from minillm.distributed.pipeline import PipelineStage, stage_forward

    stage = PipelineStage(model, ctx.rank, ctx.world_size)
    stage_forward(ctx, stage, input_ids, positions, 1, all_logits)  # warm-up: first-touch and kernel builds
    return {m: [stage_forward(ctx, stage, input_ids, positions, m, all_logits)[1] for _ in range(repeats)]
            for m in microbatches}


def measure_bubble(model, pp: int = 2, microbatches: tuple[int, ...] = (1, 2, 4, 8), batch: int = 8,
                   seq_len: int = 32, repeats: int = 3, threads_per_worker: int = 1,
                   all_logits: bool = False) -> list[dict]:
    """The bubble of a pipelined forward of ``batch`` × ``seq_len`` tokens at each micro-batch count m, measured
    (1 − Σ busy / (p × wall), the fastest of ``repeats``) beside GPipe's formula and ``gpipe_schedule``'s
    prediction from the measured per-micro-batch stage times (which includes unequal stages; not transfers).
    ``all_logits``: the last stage computes logits for every position (a heavier last stage) instead of the last."""
    from minillm.distributed.pipeline import bubble_fraction, gpipe_bubble, gpipe_schedule
    from minillm.distributed.worker import run_workers

    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    pos = torch.arange(seq_len).expand(batch, seq_len)
    per_rank = run_workers(_bubble_worker, pp, (model, ids, pos, list(microbatches), repeats, all_logits),
                           threads_per_worker=threads_per_worker)
    rows = []
    for m in microbatches:
        runs = [[per_rank[r][m][k] for r in range(pp)] for k in range(repeats)]
        best = min(runs, key=lambda stages: max(s.wall_s for s in stages))
        wall = max(s.wall_s for s in best)
        measured = 1 - sum(s.busy_s for s in best) / (pp * wall)
        predicted = bubble_fraction(gpipe_schedule([s.compute_s for s in best]))
        rows.append(dict(pp=pp, m=len(best[0].compute_s), all_logits=all_logits, measured=measured,
                         formula=gpipe_bubble(pp, m), schedule=predicted, wall_ms=wall * 1e3,
                         busy_ms=[s.busy_s * 1e3 for s in best]))
    return rows


def bench_tp(n_tokens: int = 32, repeats: int = 2, allreduce_iters: int = 500, save: bool = True) -> dict:
    """Run the three parts above; print them; -> the results (also saved as ``tp-cpu.json``)."""
    from minillm.distributed.worker import run_workers
    from minillm.perf.tp_cost import report

    cores = os.cpu_count() or 1
    cfg = default_like_config()
    ar = run_workers(_allreduce_worker, 2, (cfg.hidden_size, allreduce_iters), threads_per_worker=1)[0]
    print(f"gloo all-reduce [1, {cfg.hidden_size}] fp32, 2 processes: {ar * 1e6:.1f} µs median "
          f"-> {2 * ar * 1e6:.1f} µs per layer (2 all-reduces), {2 * ar * cfg.num_layers * 1e3:.2f} ms per token "
          f"over {cfg.num_layers} layers")
    model = random_model(cfg)
    tok_s = {}
    for tp in (1, 2):
        tok_s[tp] = run_workers(_decode_worker, tp, (model, n_tokens, repeats),
                                threads_per_worker=max(1, cores // tp))[0]
        print(f"decode, 1 request, TP={tp} ({tp} process(es) × {max(1, cores // tp)} thread(s)): "
              f"{tok_s[tp]:.1f} tok/s")
    print(f"TP=2 / TP=1: {tok_s[2] / tok_s[1]:.2f}×  (a shared machine: other processes compete for the cores)")
    driver = driver_decode_tok_s(model, n_tokens, repeats, 2, max(1, cores // 2))
    print(f"decode, 1 request, TP=2 through the driver (this process schedules and sends each step to a persistent "
          f"worker, as LLM does): {driver:.1f} tok/s, {driver / tok_s[2]:.2f}× the SPMD TP=2 above")
    rows = report()
    for r in rows:
        print("{model:12s} {link:12s} tp={tp} layer: compute {compute_us:7.1f} µs, all-reduces {comm_us:5.1f} µs "
              "({comm_bytes:6.0f} B, {comm_fraction:4.0%} of the layer), speedup {layer_speedup:4.2f}×".format(**r))
    bubble = measure_bubble(random_model(dataclasses.replace(cfg, num_layers=8)), batch=8, seq_len=16)
    for r in bubble:
        print("pipeline p={pp} m={m}: bubble measured {measured:5.1%}, GPipe formula {formula:5.1%}, schedule of the "
              "measured stage times {schedule:5.1%} ({wall_ms:.1f} ms)".format(**r))
    result = {"benchmark": "tp", "cores": cores, "config": {k: v for k, v in vars(cfg).items() if k != "rope_scaling"},
              "allreduce_us": ar * 1e6, "allreduce_per_layer_us": 2 * ar * 1e6, "n_tokens": n_tokens,
              "decode_tok_s": {**{f"tp{k}": v for k, v in tok_s.items()}, "tp2_driver": driver}, "cost_model": rows,
              "pipeline_bubble": bubble}
    if save:
        from minillm.perf.bench.decode import save_results

        print(f"saved {save_results('tp-cpu', result)}")
    return result
