"""``python -m minillm bench disagg``: prefill/decode disaggregation vs colocated serving, on the virtual clock.

Llama-3-8B bf16 on H100-SXM GPUs (roofline step times + 2 ms per step, ``perf/simulate.py``), one replica per GPU.
For each workload (long prompts with short answers; short-prompt chat), each N (4 and 8 GPUs; ``--quick``: 4),
every P:D split over every link of ``perf.disagg.KV_LINKS`` and the colocated baseline serve the same Poisson
traces at a grid of offered rates; goodput at the SLO is the highest rate whose SLO attainment stays ≥ 90 %
(DistServe's definition).  Modelled, not measured: read the ratios.  Results go to
``benchmarks/results/disagg-sim.json`` and a figure (goodput vs P:D per link) next to it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from minillm.config import EngineConfig
from minillm.perf.disagg import (
    KV_LINKS,
    Workload,
    best_split,
    chat_workload,
    llama3_8b_config,
    long_prompt_workload,
    sweep,
)


@dataclass(frozen=True)
class DisaggBenchSize:
    """How big a sweep: GPU counts; per workload the offered rates per GPU (req/s; × N for the whole deployment)
    and the requests per trace, raised so that arrivals last ``duration_s`` (several request lifetimes: a shorter
    burst ends before the queues reach their steady state, and every deployment looks fine)."""

    num_instances: tuple[int, ...]
    long_requests: int
    long_rates_per_gpu: tuple[float, ...]
    chat_requests: int
    chat_rates_per_gpu: tuple[float, ...]
    duration_s: float = 3.0


FULL = DisaggBenchSize((4, 8), 160, (4, 5, 6, 8, 10, 12), 400, (50, 70, 90, 110))
QUICK = DisaggBenchSize((4,), 120, (4, 6, 8, 10), 400, (50, 70, 90))


def setup():
    """(model config, engine config, step time) of the simulated deployment: Llama-3-8B bf16, one H100-SXM per
    instance, its KV budget what 90 % of 80 GB leaves after the weights, vLLM-like batch limits."""
    from minillm.perf.hardware import get_spec
    from minillm.perf.simulate import RooflineStepTime, kv_cache_budget

    cfg, spec = llama3_8b_config(), get_spec("H100-SXM")
    step = RooflineStepTime(cfg, spec, "bfloat16", overhead_s=2e-3)  # ~2 ms of CPU work per step (assumed)
    engine = EngineConfig(max_num_seqs=128, max_num_batched_tokens=2048, kv_cache_bytes=kv_cache_budget(cfg, spec))
    return cfg, engine, step


def run_sweeps(size: DisaggBenchSize, links=None, seed: int = 0) -> list[dict]:
    """Every (workload, N) sweep of ``size``: rows of ``perf.disagg.sweep``."""
    from minillm.perf.workloads import random_corpus

    cfg, engine, step = setup()
    corpus = random_corpus(cfg.vocab_size, n=65_536, seed=seed)
    links = list(KV_LINKS.values()) if links is None else links
    rows = []
    for wl, per_gpu, count in ((long_prompt_workload(), size.long_rates_per_gpu, size.long_requests),
                               (chat_workload(), size.chat_rates_per_gpu, size.chat_requests)):
        for n in size.num_instances:
            rows += sweep(wl, cfg, engine, step, num_instances=n, rates=[r * n for r in per_gpu], links=links,
                          num_requests=count * n // 4, corpus=corpus, seed=seed, min_duration_s=size.duration_s)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (workload, N, link): colocated goodput, the best P:D split's, and their ratio."""
    out = []
    for (wl, n) in dict.fromkeys((r["workload"], r["num_instances"]) for r in rows):
        group = [r for r in rows if (r["workload"], r["num_instances"]) == (wl, n)]
        colo = next(r for r in group if r["link"] is None)["goodput_at_slo"]
        for link in dict.fromkeys(r["link"] for r in group if r["link"]):
            best = best_split(group, link)
            out.append({"workload": wl, "num_instances": n, "link": link, "colocated": colo,
                        "best_split": best["deployment"].split()[0], "best": best["goodput_at_slo"],
                        "ratio": best["goodput_at_slo"] / colo if colo else float("inf")})
    return out


def plot(rows: list[dict], path: Path | None = None):
    """Goodput at the SLO against the P:D split, one line per link, colocated dashed; one panel per (workload, N)."""
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["workload"], r["num_instances"]) for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, (wl, n) in zip(axes[0], groups, strict=True):
        group = [r for r in rows if (r["workload"], r["num_instances"]) == (wl, n)]
        colo = next(r for r in group if r["link"] is None)
        for link in dict.fromkeys(r["link"] for r in group if r["link"]):
            pts = [r for r in group if r["link"] == link]
            ax.plot([r["num_prefill"] for r in pts], [r["goodput_at_slo"] for r in pts], "o-", label=link)
        ax.axhline(colo["goodput_at_slo"], color="k", linestyle="--", label="colocated")
        ax.set_xticks(range(1, n), [f"{p}:{n - p}" for p in range(1, n)])
        ax.set(title=f"{wl}, {n} GPUs", xlabel="prefill : decode GPUs", ylabel="goodput at SLO (req/s)")
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def bench_disagg(*, quick: bool = False, seed: int = 0, save: bool = True, out_dir=None) -> dict:
    """Run the sweeps, print the table, save JSON and the figure (unless ``save=False``); returns the results."""
    size = QUICK if quick else FULL
    cfg, engine, step = setup()
    t0 = time.perf_counter()
    rows = run_sweeps(size, seed=seed)
    table = summary(rows)
    print("prefill/decode disaggregation (modelled, not measured): Llama-3-8B bf16, one H100-SXM per instance, "
          "roofline step + 2 ms; goodput = highest offered rate with >= 90 % of requests within the SLO")
    for wl in (long_prompt_workload(), chat_workload()):
        print(f"  {wl.name}: prompts {wl.prompt_len}, outputs {wl.output_len}, SLO TTFT <= {wl.ttft_slo_s * 1e3:.0f} "
              f"ms, TPOT <= {wl.tpot_slo_s * 1e3:.0f} ms")
    print(f"{'workload':<13} {'N':>2} {'link':<13} {'colocated':>9} {'best P:D':>8} {'goodput':>8} {'ratio':>6}")
    for s in table:
        print(f"{s['workload']:<13} {s['num_instances']:>2} {s['link']:<13} {s['colocated']:>9.0f} "
              f"{s['best_split']:>8} {s['best']:>8.0f} {s['ratio']:>6.2f}")
    result = {"model": "Llama-3-8B", "hardware": "H100-SXM", "overhead_s": step.overhead_s,
              "engine": {"max_num_seqs": engine.max_num_seqs, "max_num_batched_tokens": engine.max_num_batched_tokens,
                         "kv_cache_bytes": engine.kv_cache_bytes},
              "workloads": [asdict(w) for w in (long_prompt_workload(), chat_workload())],
              "links": {k: asdict(v) for k, v in KV_LINKS.items()}, "size": asdict(size), "seed": seed,
              "summary": table, "rows": rows, "sim_seconds": time.perf_counter() - t0}
    if save:
        from minillm.perf.bench.decode import RESULTS_DIR, save_results

        path = save_results("disagg-sim", result, out_dir)
        fig = plot(rows, Path(out_dir or RESULTS_DIR) / "disagg-sim.png")
        print(f"saved {path} and {path.with_suffix('.png')}")
        import matplotlib.pyplot as plt

        plt.close(fig)
    return result


__all__ = ["FULL", "QUICK", "DisaggBenchSize", "Workload", "bench_disagg", "plot", "run_sweeps", "setup", "summary"]
