"""scripts/gpu_check.py (``make gpu-check``): the dry run on a machine without CUDA reports every GPU step skipped
and writes a summary that follows the schema; a step that overruns its timeout is killed and reported, and the
schema check refuses a malformed summary."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(SPEC)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up there
SPEC.loader.exec_module(gpu_check)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a machine without CUDA does")
def test_the_dry_run_skips_every_gpu_step_and_writes_a_valid_summary(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", str(tmp_path), "--budget-s", "120"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    gpu_check.validate_summary(summary)
    steps = summary["steps"]
    assert list(steps) == [s.name for s in gpu_check.STEPS] and summary["cuda"] is False
    assert steps["env"]["status"] == "ok"
    assert {(r["status"], r["detail"]) for name, r in steps.items() if name != "env"} == {("skipped", "no CUDA")}
    env = json.loads((tmp_path / steps["env"]["result"]).read_text())
    assert env["torch"] == torch.__version__ and env["cuda"] is False
    assert "pytest_gpu" in proc.stdout and "skipped" in proc.stdout  # the table a session reads


def test_a_step_over_its_timeout_is_killed_and_the_rest_still_run(tmp_path):
    steps = (gpu_check.Step("env", 0.05, needs_cuda=False), gpu_check.Step("serving", 60))
    summary = gpu_check.run_check(tmp_path, budget_s=30, steps=steps, cuda=False)
    assert summary["steps"]["env"]["status"] == "timeout" and "killed" in summary["steps"]["env"]["detail"]
    assert summary["steps"]["serving"]["status"] == "skipped"
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_the_schema_check_refuses_a_malformed_summary():
    good = {"schema": gpu_check.SCHEMA, "date": "2026-11-26", "cuda": False, "budget_s": 1, "wall_s": 0.5,
            "steps": {"env": {"status": "ok", "seconds": 0.4, "detail": "", "result": "env.json"}}}
    gpu_check.validate_summary(good)
    with pytest.raises(ValueError, match="steps"):
        gpu_check.validate_summary({**good, "steps": {"env": {**good["steps"]["env"], "status": "great"}}})
    with pytest.raises(ValueError, match="steps"):  # ok without a result file
        gpu_check.validate_summary({**good, "steps": {"env": {**good["steps"]["env"], "result": None}}})
    with pytest.raises(ValueError, match="cuda"):
        gpu_check.validate_summary({**good, "cuda": "no"})


def test_every_step_runs_end_to_end_at_tiny_sizes_on_cpu(tmp_path):
    """--smoke: the GPU steps' own code (benchmarks, the Triton GEMV under the interpreter, the engine run, the
    junit parsing) on CPU, so a lent GPU's minutes are not spent debugging the harness."""
    summary = gpu_check.run_check(tmp_path, budget_s=400, smoke=True)
    assert {name: r["status"] for name, r in summary["steps"].items()} == {s.name: "ok" for s in gpu_check.STEPS}
    decode = json.loads((tmp_path / "bench_decode.json").read_text())
    assert {r["impl"] for r in decode["rows"]} >= {"minillm eager", "minillm graphs"}
    assert all(r["tok_s"] > 0 for r in decode["rows"] if r["error"] is None)
    gemv = json.loads((tmp_path / "dequant_gemv.json").read_text())["rows"]
    assert gemv and all(r["gb_s"] > 0 for r in gemv)
    serving = json.loads((tmp_path / "serving.json").read_text())
    assert serving["requests"] == 4 and serving["output_tok_s"] > 0
    junit = json.loads((tmp_path / "pytest_gpu.json").read_text())
    assert junit["returncode"] == 0 and junit["tests"] > 0 and (tmp_path / junit["junit"]).exists()
