"""minillm.openmp: libgomp's spin is capped when minillm loads torch, and only then (each case a fresh process)."""

import json
import os
import subprocess
import sys
import threading

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


POOL_PROBE = """
import json, os, threading, time, torch, minillm
from minillm.openmp import release_thread_pool

def threads():
    return len(os.listdir("/proc/self/task"))

def work():  # parallel regions: the calling thread's pool (OMP_NUM_THREADS=2: one worker)
    for _ in range(20):
        torch.ones(1 << 22).add_(1).sum()

before = threads()
work()
built = threads()
released = release_thread_pool()
deadline = time.time() + 10
while threads() >= built and time.time() < deadline:
    time.sleep(0.05)
after = threads()
t = threading.Thread(target=lambda: (work(), time.sleep(0.5)))
t.start(); time.sleep(0.3)
print(json.dumps([before, built, released, after, threads()]))
t.join()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool is found through /proc/self/maps")
def test_release_thread_pool_frees_the_builders_workers_and_another_thread_gets_its_own():
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    r = subprocess.run([sys.executable, "-c", POOL_PROBE], capture_output=True, text=True, timeout=120,
                       env={**base, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr
    before, built, released, after, in_thread = json.loads(r.stdout.strip().splitlines()[-1])
    assert built == before + 1  # the main thread's pool: one worker
    assert released and after == before  # gone: the worker exited
    assert in_thread == before + 2  # the new thread and its own pool's worker


def test_the_server_frees_the_building_threads_pool_when_its_engine_loop_starts(monkeypatch):
    from minillm.entrypoints.openai import engine_loop

    calls = []
    monkeypatch.setattr(engine_loop, "release_thread_pool", lambda: calls.append(threading.current_thread()))
    started = []
    loop = engine_loop.EngineLoop.__new__(engine_loop.EngineLoop)
    loop._thread = threading.Thread(target=lambda: started.append(calls[:]))
    loop.start()
    loop._thread.join()
    assert calls == [threading.current_thread()] and started == [calls]  # freed here, before the loop ran


def test_decode_threads_leave_the_cpus_other_work_keeps_busy():
    from minillm.openmp import DecodeThreads

    t, busy = [0.0], [0]
    gov = DecodeThreads(interval_s=0.25, window=3, busy=lambda: busy[0], clock=lambda: t[0], cpus=4)
    assert gov.threads(4) == 4 and gov.threads(2) == 2  # quiet: the configured count
    busy[0] = 3
    for _ in range(3):  # a neighbour that stays: once the whole window has seen it
        t[0] += 0.3
        gov.threads(4)
    assert gov.threads(4) == 1 and gov.threads(1) == 1
    busy[0] = 9
    t[0] += 0.3
    assert gov.threads(4) == 1  # never fewer than one
    busy[0] = 0
    t[0] += 0.3
    assert gov.threads(4) == 4  # the neighbour left: one quiet sample is enough to take the CPUs back


def test_decode_threads_ignore_a_process_that_runs_for_a_moment():
    from minillm.openmp import DecodeThreads

    t, busy = [0.0], [0]
    gov = DecodeThreads(interval_s=0.25, window=4, busy=lambda: busy[0], clock=lambda: t[0], cpus=2)
    gov.threads(2)
    busy[0] = 1
    t[0] += 0.3
    assert gov.threads(2) == 2  # one busy sample among quiet ones
    calls = [0]
    gov2 = DecodeThreads(interval_s=10.0, busy=lambda: calls.__setitem__(0, calls[0] + 1) or 0, clock=lambda: 0.0)
    for _ in range(100):
        gov2.threads(2)
    assert calls[0] == 1  # sampled at most once per interval: a step pays a clock read


def test_num_threads_sets_the_openmp_thread_count_for_the_block_and_restores_it():
    if not openmp._omp_setters():
        pytest.skip("no OpenMP runtime found in this process")
    rt = openmp._omp_setters()[0]
    before = rt.omp_get_max_threads()
    with openmp.num_threads(1):
        assert rt.omp_get_max_threads() == 1
    assert rt.omp_get_max_threads() == before


def test_other_cpu_use_counts_a_busy_process_beside_us():
    import time

    from minillm.openmp import DecodeThreads, OtherCpuUse

    if not os.path.exists("/proc/stat"):
        pytest.skip("needs /proc")
    assert isinstance(DecodeThreads().busy, OtherCpuUse)  # the governor's default measure
    use = OtherCpuUse()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        use()
        time.sleep(0.6)
        assert use() >= 1
    finally:
        spinner.kill()
        spinner.wait()


def test_other_cpu_use_is_the_average_since_the_last_call_less_our_own_time():
    """Host CPU-seconds less ours, over the wall time between calls, rounded: our own threads never count, and a
    process that ran for a moment of the interval (a client reading streamed tokens) is no CPU."""
    from minillm.openmp import OtherCpuUse

    t = [0.0]
    reads = iter([(100.0, 10.0), (101.5, 10.9), (103.4, 12.8), (103.5, 12.85), (104.0, 13.1)])
    use = OtherCpuUse(read=lambda: next(reads), clock=lambda: t[0])
    assert use() == 0  # no interval yet
    t[0] = 1.0
    assert use() == 1  # 1.5 host CPU-s, 0.9 ours: 0.6 of a CPU another process used
    t[0] = 2.0
    assert use() == 0  # 1.9 host CPU-s, all of them ours (two busy threads of this process)
    t[0] = 3.0
    assert use() == 0  # 0.05 CPU-s of others in a second: a moment, not a neighbour
    t[0] = 3.5
    assert use() == 1  # 0.25 CPU-s of others in half a second: half a CPU
    gone = OtherCpuUse(read=lambda: (_ for _ in ()).throw(OSError("no /proc")), clock=lambda: t[0])
    assert gone() == 0 and gone() == 0


def test_decode_threads_keep_the_configured_count_when_pinned_to_some_cpus(monkeypatch):
    from minillm.openmp import DecodeThreads

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity on this platform")
    monkeypatch.setattr(os, "cpu_count", lambda: len(os.sched_getaffinity(0)) + 8)  # other CPUs than ours exist
    gov = DecodeThreads(busy=lambda: 5, clock=lambda: 0.0)
    assert not gov.active and gov.threads(2) == 2  # host-wide running counts say nothing about our CPUs


def test_num_threads_refuses_a_count_below_one():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="int >= 1"):
            openmp.num_threads(bad)
