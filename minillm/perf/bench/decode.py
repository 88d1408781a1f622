"""Benchmarks: side-by-side comparisons in one run, reported as ratios and roofline units, saved as JSON.

``python -m minillm bench decode``: minillm vs transformers ``generate`` on the same weights and dtype
(batch-1 greedy decode tok/s, prefill tok/s, MBU against the read bandwidth measured here).
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from minillm.engine.simple import stream_cached
from minillm.sampling.params import SamplingParams

RESULTS_DIR = Path("benchmarks") / "results"


def machine_info() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "processor": _cpu_name(), "threads": torch.get_num_threads(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def save_results(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2, default=float))
    return path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# --- timing one decode run -------------------------------------------------------------------------------
def time_minillm_decode(model, prompt: list[int], n_tokens: int) -> tuple[float, float]:
    """Greedy batch-1 decode of ``n_tokens``; returns (ttft_s, decode tok/s over tokens 2..n)."""
    times = []
    start = time.perf_counter()
    for _ in stream_cached(model, [prompt], [SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)]):
        times.append(time.perf_counter())
    return times[0] - start, _rate(times)


def _rate(times: list[float]) -> float:
    """Tokens per second after the first token (nan with a single token)."""
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")


def time_hf_decode(hf_model, prompt: list[int], n_tokens: int) -> tuple[float, float]:
    """The same through transformers ``generate`` (timestamps taken by a streamer as each token arrives)."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []
            self.calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:  # the first call carries the prompt
                self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    ids = torch.tensor([prompt], device=hf_model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_tokens,
                          min_new_tokens=n_tokens, do_sample=False, streamer=clock, pad_token_id=0)
    return clock.times[0] - start, _rate(clock.times)


def _median_runs(fn: Callable[[], tuple[float, float]], repeats: int) -> tuple[float, float]:
    runs = [fn() for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def bench_decode(model_name: str | None = None, dtypes=("float32", "bfloat16"), n_tokens: int = 64,
                 prompt_len: int = 32, prefill_lens=(128, 512), repeats: int = 3, device: str | None = None,
                 save: bool = True) -> dict:
    """minillm vs transformers: batch-1 greedy decode tok/s and prefill tok/s per dtype, with MBU.

    Both run the same converted weights in the same dtype on the same device, alternating run by run so
    drift in the machine's speed hits both alike.  MBU = bytes read per decode step (weights + KV cache, from
    the cost model) × steps/s ÷ the read bandwidth measured on this machine now.
    """
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from minillm.models.loader import load_model, resolve, resolve_device
    from minillm.perf.machine import machine_spec
    from minillm.perf.roofline import decode_step_cost

    dev = resolve_device(device)
    peak = machine_spec(str(dev))  # this machine's roof, measured once and cached (perf.machine)
    bandwidth = peak.memory_bandwidth  # the highest read rate any probe reached here: the roof
    ckpt = resolve(model_name)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dt in tqdm(dtypes, desc="bench decode"):
        ours = load_model(model_name, dtype=dt, device=str(dev))
        cfg = ours.config
        theirs = AutoModelForCausalLM.from_pretrained(ckpt.directory, dtype=ours.dtype).to(dev).eval()
        prompt = torch.randint(100, cfg.vocab_size, (prompt_len,), generator=gen).tolist()
        time_minillm_decode(ours, prompt, 8)  # warm-up both (first-call allocations, native library load)
        time_hf_decode(theirs, prompt, 8)
        ours_runs, hf_runs = [], []
        for _ in range(repeats):
            ours_runs.append(time_minillm_decode(ours, prompt, n_tokens))
            hf_runs.append(time_hf_decode(theirs, prompt, n_tokens))
        ours_tps = statistics.median(r[1] for r in ours_runs)
        hf_tps = statistics.median(r[1] for r in hf_runs)
        step = decode_step_cost(cfg, batch=1, kv_len=prompt_len + n_tokens // 2, dtype=ours.dtype)
        row = {"dtype": dt, "minillm_decode_tok_s": ours_tps, "hf_decode_tok_s": hf_tps,
               "speedup": ours_tps / hf_tps, "bytes_per_step": step.bytes,
               "minillm_gb_s": step.bytes * ours_tps / 1e9, "hf_gb_s": step.bytes * hf_tps / 1e9,
               "minillm_mbu": step.bytes * ours_tps / bandwidth, "hf_mbu": step.bytes * hf_tps / bandwidth}
        for n in prefill_lens:
            p = torch.randint(100, cfg.vocab_size, (n,), generator=gen).tolist()
            ours_ttft = statistics.median(time_minillm_decode(ours, p, 1)[0] for _ in range(repeats))
            hf_ttft = statistics.median(time_hf_decode(theirs, p, 1)[0] for _ in range(repeats))
            row[f"minillm_prefill_{n}_tok_s"] = n / ours_ttft
            row[f"hf_prefill_{n}_tok_s"] = n / hf_ttft
        rows.append(row)
        del ours, theirs
    result = {"benchmark": "decode", "model": model_name or "default (SmolLM2-135M-Instruct Q4_1 dequantized)",
              "device": str(dev), "read_bandwidth_gb_s": bandwidth / 1e9, "n_tokens": n_tokens,
              "prompt_len": prompt_len, "repeats": repeats, "rows": rows}
    print_decode_table(result)
    if save:
        print(f"saved {save_results('decode-' + str(dev.type), result)}")
    return result


def print_decode_table(result: dict) -> None:
    print(f"\nbatch-1 greedy decode, {result['n_tokens']} tokens after a {result['prompt_len']}-token prompt, "
          f"median of {result['repeats']}; device {result['device']}, measured read bandwidth "
          f"{result['read_bandwidth_gb_s']:.1f} GB/s")
    head = (f"{'dtype':<9} {'minillm tok/s':>13} {'HF tok/s':>9} {'ratio':>6} {'minillm GB/s':>12} {'MBU':>6} "
            f"{'HF MBU':>7}")
    print(head + "".join(f" {'prefill ' + k.split('_')[2]:>12}" for k in result["rows"][0] if
                         k.startswith("minillm_prefill")))
    for r in result["rows"]:
        line = (f"{r['dtype']:<9} {r['minillm_decode_tok_s']:>13.1f} {r['hf_decode_tok_s']:>9.1f} "
                f"{r['speedup']:>5.2f}x {r['minillm_gb_s']:>12.1f} {r['minillm_mbu']:>6.0%} {r['hf_mbu']:>7.0%}")
        for k in r:
            if k.startswith("minillm_prefill"):
                hf_k = k.replace("minillm", "hf")
                line += f" {r[k]:>6.0f}/{r[hf_k]:<5.0f}"
        print(line)
    print("prefill columns: minillm/transformers prompt tok/s")
