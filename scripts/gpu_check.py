"""``make gpu-check OUT=DIR``: everything a session measures on a lent GPU, in one command that cannot waste the lease.

    python scripts/gpu_check.py OUT_DIR [--budget-s 480] [--steps env,pytest_gpu,...]

A GPU is lent for minutes, with nothing to install on it: this script needs only the tracked working tree (it puts
the checkout on ``sys.path``) and what the machine has (torch, triton, transformers, pytest).  Every model it runs
has random weights of a real shape, so no checkpoint travels either (``scripts/gpu_check.carry`` lists what a
device call must carry besides the tree: nothing today).  Each step runs in a child process with its own timeout,
capped by what is left of ``--budget-s``: a hang costs that step, not the others.  Steps, in order:

- ``env``: GPU name, capability and memory, torch / triton / transformers versions, copy bandwidth and bf16 matmul
  TFLOP/s measured in the run (on CPU: versions only);
- ``pytest_gpu``: ``pytest -m gpu`` with a junit XML (and ``--timeout`` when pytest-timeout is installed) — among
  them the 8-bit GEMMs against their references: ``torch._int_mm`` (W8A8) and ``torch._scaled_mm`` (FP8, compute
  capability ≥ 8.9) in ``tests/quant/test_w8a8.py``;
- ``bench_decode``: ``bench decode --device cuda`` — the default model's shape and Llama-3.2-1B's, batch 1/8/32,
  eager vs CUDA graphs, beside transformers eager and static cache + ``torch.compile``;
- ``bench_attention``: ``bench attention --device cuda`` (the Triton kernels against SDPA);
- ``dequant_gemv``: the Triton int4 dequantizing GEMV on Llama-3.2-1B's linear shapes, GB/s of packed weights as a
  share of the copy bandwidth measured in the same step;
- ``serving``: a short continuous-batching run of the engine on CUDA (random default-shaped weights, 64 requests).

Writes ``OUT_DIR/summary.json`` (``validate_summary`` checks its schema), one ``OUT_DIR/<step>.json`` per step that
ran and its ``OUT_DIR/<step>.log``.  Without CUDA (CI's dry run) every GPU step is "skipped: no CUDA", and the
summary is still written and checked.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the device has the tree, not an installed minillm
    sys.path.insert(0, str(ROOT))

SCHEMA = 1
STATUSES = ("ok", "skipped", "failed", "timeout")


@dataclass(frozen=True)
class Step:
    """One measurement: ``name`` (its files), the seconds it may take, whether it needs CUDA."""

    name: str
    timeout_s: float
    needs_cuda: bool = True


# --smoke (tests on CPU): every step on a model this small, so the harness itself is checked where there is no GPU
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)

# Timeouts sum to the 480 s budget: an H100 run fits in 8 minutes even when every step runs to its limit.
STEPS = (Step("env", 45, needs_cuda=False), Step("pytest_gpu", 150), Step("bench_decode", 150),
         Step("bench_attention", 45), Step("dequant_gemv", 30), Step("serving", 60))


# ------------------------------------------------------------------------------------------------ the steps
def step_env(out: Path, device: str, smoke: bool) -> dict:
    import platform

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    for name in ("triton", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    if device == "cuda" and info["cuda"]:  # without CUDA (the dry run) the versions alone
        from minillm.kernels.probe import matmul_flops
        from minillm.perf.bench.decode import copy_bandwidth

        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", memory_gib=props.total_memory / 2**30,
                    copy_bandwidth_gb_s=copy_bandwidth(torch.device("cuda")) / 1e9,
                    bf16_matmul_tflops=matmul_flops("bfloat16", n=8192, device="cuda") / 1e12)
    return info


def step_pytest_gpu(out: Path, device: str, smoke: bool) -> dict:
    import importlib.util
    import xml.etree.ElementTree as ET

    xml = out / "pytest-gpu.xml"
    where = "tests/engine/test_cuda_graph_gpu.py" if smoke else "tests"  # smoke: one file, its tests skip on CPU
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", where, f"--junitxml={xml}", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append("--timeout=60")
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    suites = ET.parse(xml).getroot().iter("testsuite") if xml.exists() else []
    totals = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"returncode": rc, "junit": xml.name, **totals}


def step_bench_decode(out: Path, device: str, smoke: bool) -> dict:
    from minillm.perf.bench.decode import bench_decode

    if smoke:
        return bench_decode(device=device, shapes=(TINY,), batches=(1, 2), n_tokens=4, prompt_len=8, save=False,
                            hf_compile=False)
    return bench_decode(device=device, repeats=2, save=False)


def step_bench_attention(out: Path, device: str, smoke: bool) -> dict:
    from minillm.perf.bench.attention import bench_attention

    if smoke:
        return {"rows": bench_attention(device, batch_sizes=(1,), seq_lens=(64,), H_q=4, H_kv=2, D=32)}
    return {"rows": bench_attention(device)}


def step_dequant_gemv(out: Path, device: str, smoke: bool) -> dict:
    """y = x @ W^T, M = 1, Q4_1 at groups of 32, on Llama-3.2-1B's qkv, o, gate_up and down shapes (bf16 x)."""
    import statistics

    import torch

    from minillm.kernels.triton.dequant_gemv import int4_gemv_triton
    from minillm.perf.bench.decode import copy_bandwidth
    from minillm.quant.weight import quantize_int4

    dev = torch.device(device)
    copy_bw = copy_bandwidth(dev)
    rows = []
    for N, K in ((64, 64),) if smoke else ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)):
        w = quantize_int4(torch.randn(N, K, device=dev), 32)
        x = torch.randn(1, K, device=dev, dtype=torch.float32 if smoke else torch.bfloat16)
        nbytes = sum(t.numel() * t.element_size() for t in (w.packed, w.scales, w.mins))
        int4_gemv_triton(x, w)  # compile
        times = []
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        for _ in range(2 if smoke else 20):
            sync()
            t0 = time.perf_counter()
            int4_gemv_triton(x, w)
            sync()
            times.append(time.perf_counter() - t0)
        gb_s = nbytes / statistics.median(times) / 1e9
        rows.append({"N": N, "K": K, "bytes": nbytes, "us": statistics.median(times) * 1e6, "gb_s": gb_s,
                     "pct_copy_bandwidth": 100 * gb_s * 1e9 / copy_bw})
    return {"copy_bandwidth_gb_s": copy_bw / 1e9, "rows": rows}


def step_serving(out: Path, device: str, smoke: bool) -> dict:
    """64 requests (prompts of 32–512 random tokens, 64 output tokens each) arriving at once, continuous batching
    (smoke: 4 requests of a tiny model)."""
    import random

    import torch

    from minillm import EngineConfig, LLMEngine, SamplingParams
    from minillm.perf.bench.decode import random_pair

    shape, dtype = (TINY, torch.float32) if smoke else ("default", torch.bfloat16)
    model, _ = random_pair(shape, dtype, torch.device(device), with_hf=False)
    rng, n = random.Random(0), 4 if smoke else 64
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(32, 512))] for _ in range(n)]
    params = SamplingParams(max_tokens=4 if smoke else 64, temperature=0, ignore_eos=True)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096), eos_token_ids=())
    engine.generate(prompts[:2], params)  # warm-up: graph capture happened at start, Triton compiles here
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    ttft = sorted(o.metrics.ttft_s for o in outs)
    tpot = sorted(o.metrics.tpot_s for o in outs)
    return {"requests": len(outs), "wall_s": wall, "output_tok_s": sum(len(o.token_ids) for o in outs) / wall,
            "ttft_ms_p50": 1e3 * ttft[len(ttft) // 2], "ttft_ms_p99": 1e3 * ttft[-1],
            "tpot_ms_p50": 1e3 * tpot[len(tpot) // 2], "tpot_ms_p99": 1e3 * tpot[-1]}


STEP_FUNCTIONS: dict[str, Callable[[Path, str, bool], dict]] = {
    "env": step_env, "pytest_gpu": step_pytest_gpu, "bench_decode": step_bench_decode,
    "bench_attention": step_bench_attention, "dequant_gemv": step_dequant_gemv, "serving": step_serving}


# ------------------------------------------------------------------------------------------------ the driver
def _run_child(step: Step, out: Path, timeout_s: float, smoke: bool) -> tuple[str, str]:
    """Run one step in a child process (its own process group, so a timeout kills what it started too);
    -> (status, detail)."""
    log = out / f"{step.name}.log"
    cmd = [sys.executable, __file__, str(out), "--child", step.name] + (["--smoke"] if smoke else [])
    env = {**os.environ, "TRITON_INTERPRET": "1"} if smoke else None  # Triton kernels on CPU tensors
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout", f"killed after {timeout_s:.0f} s"
    if rc == 0 and (out / f"{step.name}.json").exists():
        return "ok", ""
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    return "failed", f"exit code {rc}: {tail[0][:300]}"


def run_check(out: Path, budget_s: float = 480.0, steps: tuple[Step, ...] = STEPS, cuda: bool | None = None,
              smoke: bool = False) -> dict:
    """Run ``steps`` within ``budget_s`` seconds, write ``out/summary.json``; -> the summary.  ``smoke``: every
    step on CPU at tiny sizes (a test of the harness; the GPU steps are not skipped then)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results = {}
    for step in steps:
        t0, left = time.monotonic(), budget_s - (time.monotonic() - start)
        if step.needs_cuda and not cuda and not smoke:
            status, detail = "skipped", "no CUDA"
        elif left < 5:
            status, detail = "skipped", "the budget is spent"
        else:
            status, detail = _run_child(step, out, min(step.timeout_s, left), smoke)
        results[step.name] = {"status": status, "seconds": round(time.monotonic() - t0, 2), "detail": detail,
                              "result": f"{step.name}.json" if status == "ok" else None}
        print(f"[gpu-check] {step.name:16s} {status:8s} {results[step.name]['seconds']:7.1f} s  {detail}",
              flush=True)
    summary = {"schema": SCHEMA, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "cuda": cuda, "budget_s": budget_s, "wall_s": round(time.monotonic() - start, 2), "steps": results}
    validate_summary(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def validate_summary(summary: dict) -> None:
    """ValueError naming the first field that does not follow the schema (version ``SCHEMA``)."""
    expected = {"schema": int, "date": str, "cuda": bool, "budget_s": (int, float), "wall_s": (int, float),
                "steps": dict}
    for key, kind in expected.items():
        if not isinstance(summary.get(key), kind):
            raise ValueError(f"summary[{key!r}] must be {kind}, got {summary.get(key)!r}")
    if summary["schema"] != SCHEMA:
        raise ValueError(f"summary schema {summary['schema']} is not {SCHEMA}")
    for name, r in summary["steps"].items():
        if r.get("status") not in STATUSES or not isinstance(r.get("seconds"), (int, float)) \
                or not isinstance(r.get("detail"), str) or (r["status"] == "ok") != isinstance(r.get("result"), str):
            raise ValueError(f"summary['steps'][{name!r}] does not follow the schema: {r!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the directory the results go to (the device tool's $OUT)")
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds for all steps together (default 480)")
    p.add_argument("--steps", default=None, help="a comma list of step names (default: all, in order)")
    p.add_argument("--smoke", action="store_true", help="every step on CPU at tiny sizes: checks the harness itself")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # run one step in this process
    a = p.parse_args(argv)
    if a.child:
        a.out.mkdir(parents=True, exist_ok=True)
        result = STEP_FUNCTIONS[a.child](a.out, "cpu" if a.smoke else "cuda", a.smoke)
        (a.out / f"{a.child}.json").write_text(json.dumps(result, indent=1, default=str))
        return 0
    by_name = {s.name: s for s in STEPS}
    names = a.steps.split(",") if a.steps else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        p.error(f"unknown step {unknown[0]!r}; the steps are {', '.join(by_name)}")
    summary = run_check(a.out, a.budget_s, tuple(by_name[n] for n in names), smoke=a.smoke)
    return 0 if all(r["status"] in ("ok", "skipped") for r in summary["steps"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
