"""Benchmarks: side-by-side comparisons in one run, reported as ratios and roofline units, saved as JSON.

``python -m minillm bench decode [--device cuda]``: greedy decode steps of the engine, eager against static buffers
(CUDA graphs on a GPU, the uncaptured padded path on CPU), beside transformers ``generate`` eager and — on CUDA —
with its static cache + ``torch.compile(mode="reduce-overhead")`` (gpt-fast's recipe), on the same random weights
in the same dtype, for the default model's shape and Llama-3.2-1B's, at batch 1, 8 and 32.  Per row: tok/s, ms per
step, µs per layer, kernels (ops) per step from ``torch.profiler``, GB/s from the cost model's bytes per step, and
that as a % of the copy bandwidth measured in the same run.  ``--model PATH`` benchmarks a real checkpoint instead.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from minillm.models.configs import hf_config_dict, llama32_1b_config, smollm2_135m_config

RESULTS_DIR = Path("benchmarks") / "results"

# Shapes from the models' config.json (``models.configs``; random weights: a decode step's time depends on shapes,
# not values), as LlamaConfig keyword dicts.
SHAPES: dict[str, dict] = {"default": hf_config_dict(smollm2_135m_config()),
                           "llama-3.2-1b": hf_config_dict(llama32_1b_config())}


def machine_info() -> dict:
    """Python, torch, platform, CPU name, threads, date (and the GPU's name when there is one)."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "processor": _cpu_name(), "threads": torch.get_num_threads(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    return info


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def save_results(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    """Write ``{"machine": machine_info(), **payload}`` to ``out_dir/name.json`` (default benchmarks/results)."""
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2, default=float))
    return path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of ``dst.copy_(src)`` counted as read + write (2 × size), median of ``repeats``: the practical
    roof a decode step's bytes are compared with (an H100's copy reaches ~3.0 of its rated 3.35 TB/s)."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 256 << 20)  # far past the L2 / last-level cache
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 sent to /dev/null for the block: the profiler's C++ side (Kineto) writes a log line to it
    when it starts and stops, which a notebook would show above its results.  Python exceptions still propagate."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def count_kernels(fn, device: torch.device) -> int:
    """Kernels ``fn()`` runs: device kernels (CUDA, graph replays included) or, on CPU, ATen ops (nested ones
    counted, as ``perf.profile``) plus native calls do not show (ctypes): a CPU count is a lower bound."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _quiet_stderr(), profile(activities=acts) as prof:
        fn()
        _sync(device)
    events = prof.events()
    if device.type == "cuda":
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events if e.name.startswith("aten::"))


@dataclass(frozen=True)
class DecodeRow:
    """One implementation at one (shape, dtype, batch): greedy decode steps after the prefill."""

    shape: str
    dtype: str
    batch: int
    impl: str
    tok_s: float  # batch × steps/s
    ms_per_step: float
    us_per_layer: float
    kernels_per_step: float | None
    gb_s: float  # the cost model's bytes per step × steps/s
    pct_copy_bandwidth: float
    error: str | None = None


# ------------------------------------------------------------------------------------------------ the models
def random_pair(shape: str | dict, dtype: torch.dtype, device: torch.device, with_hf: bool = True):
    """(minillm Transformer, transformers LlamaForCausalLM or None) on the same random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from minillm.config import ModelConfig
    from minillm.models.loader import build_model

    cfg = LlamaConfig(**(SHAPES[shape] if isinstance(shape, str) else shape))
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(cfg).to(dtype).eval()
    ours = build_model(ModelConfig.from_hf(cfg), hf.state_dict(), dtype=dtype, device=device)
    return ours, (hf if with_hf else None)


def _prompts(vocab: int, batch: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab, (batch, prompt_len), generator=g).tolist()


# ------------------------------------------------------------------------------------------------ minillm
ENGINE_MODES = ("eager", "graphs", "compiled", "auto")  # how ``time_engine`` runs the engine's decode steps


def time_engine(model, prompts: list[list[int]], n_tokens: int, mode: str) -> tuple[float, int | None]:
    """Greedy decode of ``n_tokens`` for every prompt in one batch on an ``LLMEngine``; ``mode`` "eager"
    (``enforce_eager=True``: every layer from Python) | "graphs" (``enforce_eager=False``) | "compiled"
    (kernels="compiled") | "auto" (``enforce_eager=None``: the engine's own pick, the fused native step on CPU
    fp32).  -> (median seconds per decode step, kernels of one decode step).  The whole batch prefills in the first
    step, so every later step is a decode.  ``ValueError`` for another ``mode``."""
    from minillm import EngineConfig, LLMEngine, SamplingParams

    if mode not in ENGINE_MODES:
        raise ValueError(f"mode must be one of {', '.join(ENGINE_MODES)}, got {mode!r}")
    B, P = len(prompts), len(prompts[0])
    kernels = model.kernels
    if mode == "compiled":
        model.set_kernels("compiled")
    try:
        eager = {"eager": True, "auto": None}.get(mode, False)
        cfg = EngineConfig(max_num_seqs=B, max_num_batched_tokens=max(512, B * P), enforce_eager=eager,
                           max_model_len=P + n_tokens + 1, num_kv_blocks=B * (-(-(P + n_tokens + 1) // 16)) + 1)
        eng = LLMEngine(model, config=cfg)
        params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
        for p in prompts:
            eng.add_request(p, params)
        eng.step()  # the prefill (and first tokens)
        eng.step()  # the first decode step: compiles (kernels="compiled"), allocates
        ops = count_kernels(eng.step, model.device) if n_tokens > 4 else None
        times = []
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            eng.step()  # returns sampled tokens on the host: the device work of the step is done
            times.append(time.perf_counter() - t0)
        return statistics.median(times), ops
    finally:
        model.set_kernels(kernels)


# ------------------------------------------------------------------------------------------------ transformers
def _hf_generate(hf, ids: torch.Tensor, n_tokens: int, streamer=None) -> None:
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                    do_sample=False, streamer=streamer, pad_token_id=0)


def time_hf(hf, prompts: list[list[int]], n_tokens: int, count_ops: bool = True) -> tuple[float, float | None]:
    """transformers ``generate`` on the batch: (median seconds between decode steps, kernels per decode step as
    the difference between a 6-token and a 2-token generate, divided by 4; None without ``count_ops``)."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):
            self.times.append(time.perf_counter())  # the first put carries the prompt

        def end(self):
            pass

    ids = torch.tensor(prompts, device=hf.device)
    _hf_generate(hf, ids, 4)  # warm-up (and, compiled, the compilation)
    clock = Clock()
    _hf_generate(hf, ids, n_tokens, clock)
    steps = [b - a for a, b in zip(clock.times[2:], clock.times[3:], strict=False)]  # decode steps only
    if not count_ops:
        return statistics.median(steps), None
    long = count_kernels(lambda: _hf_generate(hf, ids, 6), hf.device)
    short = count_kernels(lambda: _hf_generate(hf, ids, 2), hf.device)
    return statistics.median(steps), (long - short) / 4


def hf_static_compiled(hf):
    """transformers with a static KV cache and ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) on its
    forward: gpt-fast's recipe as transformers documents it.  Returns a callable that undoes it."""
    forward, cache = hf.forward, hf.generation_config.cache_implementation
    hf.generation_config.cache_implementation = "static"
    hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)

    def undo():
        hf.forward = forward
        hf.generation_config.cache_implementation = cache

    return undo


# ------------------------------------------------------------------------------------------------ the benchmark
def _measure(where: tuple, impl: str, repeats: int, run) -> DecodeRow:
    """``run()`` -> (seconds per step, kernels per step), ``repeats`` times -> the row; an exception becomes the
    row's ``error`` (a peer that fails here — no compiler, an unsupported transformers — is reported, not fatal).
    ``where``: (shape, dtype, batch, cost-model bytes per step, copy bandwidth, layers)."""
    shape, dtype, batch, cost_bytes, copy_bw, layers = where
    try:
        results = [run() for _ in range(repeats)]
    except Exception as e:  # noqa: BLE001
        nan = float("nan")
        return DecodeRow(shape, dtype, batch, impl, nan, nan, nan, None, nan, nan, f"{type(e).__name__}: {e}")
    step_s = statistics.median(r[0] for r in results)
    return DecodeRow(shape, dtype, batch, impl, batch / step_s, step_s * 1e3, step_s * 1e6 / layers, results[0][1],
                     cost_bytes / step_s / 1e9, 100 * cost_bytes / step_s / copy_bw)


def bench_decode(model_name: str | None = None, dtypes=None, n_tokens: int = 64, prompt_len: int = 32,
                 repeats: int = 1, device: str | None = None, save: bool = True,
                 shapes=None, batches=(1, 8, 32), modes=("eager", "graphs"),
                 hf: bool = True, hf_compile: bool | None = None, out_dir: Path | None = None) -> dict:
    """Decode steps per implementation, side by side (see the module docstring).  ``shapes``: names of
    ``SHAPES`` or LlamaConfig keyword dicts (random weights; default both shapes on CUDA, the default model's on
    CPU, where the 1B shape's fp32 copies take 10 GB and minutes per row); ``model_name`` instead benchmarks that
    checkpoint (minillm only).  ``dtypes``: default bf16 on CUDA, fp32 on CPU.  ``modes``: minillm's "eager", "graphs",
    "compiled".  ``hf_compile`` (default: on CUDA) adds transformers' static cache + compile; its failure is
    recorded in the row, not raised.  ``repeats`` > 1 takes the median step time over that many runs."""
    from tqdm.auto import tqdm

    from minillm.models.loader import load_model, resolve_device
    from minillm.perf.roofline import decode_step_cost

    dev = resolve_device(device)
    dtypes = dtypes or (("bfloat16",) if dev.type == "cuda" else ("float32",))
    hf_compile = dev.type == "cuda" if hf_compile is None else hf_compile
    shapes = shapes or (("default", "llama-3.2-1b") if dev.type == "cuda" else ("default",))
    copy_bw = copy_bandwidth(dev)
    rows: list[DecodeRow] = []
    plan = [(s, d) for s in ([model_name] if model_name else shapes) for d in dtypes]
    for shape, dt in tqdm(plan, desc="bench decode"):
        dtype = getattr(torch, dt)
        if model_name:
            ours, theirs = load_model(model_name, dtype=dt, device=str(dev)), None
        else:
            ours, theirs = random_pair(shape, dtype, dev, with_hf=hf)
        name = shape if isinstance(shape, str) else f"custom-{ours.config.num_layers}L"
        for B in batches:
            prompts = _prompts(ours.config.vocab_size, B, prompt_len)
            cost = decode_step_cost(ours.config, batch=B, kv_len=prompt_len + n_tokens // 2, dtype=dtype).bytes
            where = (name, dt, B, cost, copy_bw, ours.config.num_layers)
            for mode in modes:
                rows.append(_measure(where, f"minillm {mode}", repeats,
                                     partial(time_engine, ours, prompts, n_tokens, mode)))
            if theirs is not None:
                rows.append(_measure(where, "hf eager", repeats, partial(time_hf, theirs, prompts, n_tokens)))
                if hf_compile:
                    undo = hf_static_compiled(theirs)
                    try:
                        rows.append(_measure(where, "hf static+compile", repeats,
                                             partial(time_hf, theirs, prompts, n_tokens)))
                    finally:
                        undo()
        ours = theirs = None  # free this shape's weights before the next is built
    result = {"benchmark": "decode", "device": str(dev), "copy_bandwidth_gb_s": copy_bw / 1e9,
              "n_tokens": n_tokens, "prompt_len": prompt_len, "repeats": repeats,
              "rows": [asdict(r) for r in rows]}
    print_decode_table(result)
    if save:
        print(f"saved {save_results('decode-' + dev.type, result, out_dir)}")
    return result


def print_decode_table(result: dict) -> None:
    """The rows as a table, with the copy bandwidth they are a percentage of."""
    print(f"\ngreedy decode steps after a {result['prompt_len']}-token prompt ({result['n_tokens']} tokens), device "
          f"{result['device']}, copy bandwidth measured now {result['copy_bandwidth_gb_s']:.1f} GB/s")
    print(f"{'shape':<14} {'dtype':<9} {'B':>3} {'impl':<19} {'tok/s':>9} {'ms/step':>8} {'µs/layer':>9} "
          f"{'kernels':>8} {'GB/s':>7} {'% copy':>7}")
    for r in result["rows"]:
        if r["error"]:
            print(f"{r['shape']:<14} {r['dtype']:<9} {r['batch']:>3} {r['impl']:<19} failed: {r['error'][:80]}")
            continue
        k = "-" if r["kernels_per_step"] is None else f"{r['kernels_per_step']:.0f}"
        print(f"{r['shape']:<14} {r['dtype']:<9} {r['batch']:>3} {r['impl']:<19} {r['tok_s']:>9.1f} "
              f"{r['ms_per_step']:>8.2f} {r['us_per_layer']:>9.1f} {k:>8} {r['gb_s']:>7.1f} "
              f"{r['pct_copy_bandwidth']:>6.1f}%")
    print("kernels: CUDA kernels per decode step (graph replays included); on CPU, ATen ops (native calls unseen)")
