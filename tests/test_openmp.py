"""minillm.openmp: libgomp's spin is capped when minillm loads torch, and only then (each case a fresh process)."""

import json
import os
import subprocess
import sys

import pytest

from minillm import openmp

PROBE = "import json, os, {first}; print(json.dumps([minillm.openmp.applied, os.environ.get('GOMP_SPINCOUNT')]))"


def _run(first: str = "minillm", **env: str) -> tuple[list, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MINILLM_OMP_SPIN")}
    r = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True, timeout=120,
                       env={**base, "OMP_DISPLAY_ENV": "verbose", **env})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _runtime_spin(stderr: str) -> str:
    """GOMP_SPINCOUNT as libgomp itself reports it at load (OMP_DISPLAY_ENV)."""
    return next(line.split("=")[1].strip().strip("'") for line in stderr.splitlines() if "GOMP_SPINCOUNT" in line)


def test_minillm_caps_the_spin_while_torch_loads_and_leaves_children_the_default():
    (applied, after), stderr = _run()
    assert applied == {"GOMP_SPINCOUNT": str(openmp.SPIN_COUNT)}
    assert _runtime_spin(stderr) == str(openmp.SPIN_COUNT)  # the runtime really read it
    assert after is None  # gone from the environment: a peer started from this process gets libgomp's default


@pytest.mark.parametrize("env", [{"GOMP_SPINCOUNT": "123"}, {"OMP_WAIT_POLICY": "active"},
                                 {"MINILLM_OMP_SPIN": "default"}])
def test_a_users_choice_is_left_alone(env):
    (applied, after), stderr = _run(**env)
    assert applied is None
    assert after == env.get("GOMP_SPINCOUNT")
    if "GOMP_SPINCOUNT" in env:
        assert _runtime_spin(stderr) == "123"


def test_too_late_once_torch_is_imported():
    (applied, _), stderr = _run(first="torch, minillm")
    assert applied is None and _runtime_spin(stderr) != str(openmp.SPIN_COUNT)
