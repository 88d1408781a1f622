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


def test_two_ranks_launched_with_the_env_variables_alone_give_the_unsharded_logits():
    """No torchrun agent (no TORCHELASTIC_USE_AGENT_STORE): rank 0 hosts the store at MASTER_PORT itself, as torch's
    ``env://`` convention has it for launchers such as mpirun or a job scheduler."""
    from minillm.distributed.worker import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    procs = [subprocess.Popen([sys.executable, str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    m = re.search(r"world_size (\d+) max_abs_diff (\S+)", outs[0][0])
    assert m and int(m.group(1)) == 2 and float(m.group(2)) < 1e-4, outs[0]
