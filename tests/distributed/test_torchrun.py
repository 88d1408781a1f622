"""Tensor parallelism also runs as a plain torchrun program: the ranks join from torchrun's environment."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("torchrun_forward.py")


@pytest.mark.skipif(shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
                    reason="torchrun is not installed")
def test_two_ranks_launched_by_torchrun_give_the_unsharded_logits():
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"world_size (\d+) max_abs_diff (\S+)", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    assert int(m.group(1)) == 2
    assert float(m.group(2)) < 1e-4
