"""The repository's lint, as ``make lint`` runs it: ruff over the package, the tests and the course sources (with the
per-file policy in pyproject.toml), and unused imports in the executed solutions (the course sources import names
their rendered exercises use, so F401 is only meaningful there)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is not installed (the dev extra pins it)")
@pytest.mark.parametrize("args", [["minillm", "tests", "course"], ["--select", "F401", "solutions"]],
                         ids=["package-tests-course", "solutions-unused-imports"])
def test_ruff_is_clean(args):
    r = subprocess.run([RUFF, "check", "--no-cache", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
