"""One roofline per machine: measured once (best of runs), cached per machine key, re-measured on demand."""

from __future__ import annotations

import json

import pytest
import torch

from minillm.perf import machine
from minillm.perf.hardware import MeasuredSpec, _plan


class FakeMeasure:
    """Stands in for the uncached ``hardware._measure``: each call returns the next scripted read bandwidth."""

    def __init__(self, reads: list[float]):
        self.reads, self.calls = list(reads), []
        self.__wrapped__ = self._run

    def _run(self, device: str, quick: bool) -> MeasuredSpec:
        self.calls.append((device, quick))
        read = self.reads[(len(self.calls) - 1) % len(self.reads)]
        return MeasuredSpec(
            name="Test CPU (2 threads)", peak_flops={"float32": 1e11 + read}, memory_bandwidth=read,
            memory_capacity=0, source="fake", device=device, read_bandwidth=read, read_by_impl={"torch": read},
            copy_bandwidth=read / 2, gemv_bandwidth={"torch": {"float32": read / 3}},
            method={**_plan(device, quick), "gemv_shapes": [], "gemv_layers_timed": {}, "matmul_n_timed": {}})


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE_DIR", str(tmp_path))
    measure = FakeMeasure([20e9, 35e9, 28e9])
    monkeypatch.setattr(machine, "_measure", measure)
    return measure


def test_first_call_measures_every_run_and_keeps_each_probes_best(fake, tmp_path):
    spec = machine.machine_spec("cpu", runs=3)
    assert len(fake.calls) == 3 and fake.calls[0] == ("cpu", False)
    assert spec.memory_bandwidth == 35e9 and spec.read_by_impl["torch"] == 35e9
    assert spec.copy_bandwidth == 17.5e9 and spec.peak("float32") == 1e11 + 35e9
    assert spec.gemv_bandwidth["torch"]["float32"] == pytest.approx(35e9 / 3)
    assert spec.method["runs"] == 3 and "best of 3" in spec.method["statistic"]
    assert spec.measured_at.startswith("20") and spec.measured_at.endswith("+00:00")  # ISO 8601, UTC
    path = machine.cache_path("cpu")
    assert path.parent == tmp_path / "roofline" and path.exists()
    assert json.loads(path.read_text())["key"]["device"] == "cpu"


def test_later_calls_read_the_cache_and_force_measures_again(fake):
    first = machine.machine_spec("cpu", runs=2)
    again = machine.machine_spec(torch.device("cpu"), runs=2)
    assert len(fake.calls) == 2 and again == first  # read back, not measured: same roof, same timestamp
    fake.reads = [50e9]
    redone = machine.machine_spec("cpu", runs=1, force=True)
    assert len(fake.calls) == 3 and redone.memory_bandwidth == 50e9
    assert machine.machine_spec("cpu").memory_bandwidth == 50e9  # the re-measurement replaced the file


def test_a_quick_measurement_answers_quick_requests_only(fake):
    machine.machine_spec("cpu", quick=True, runs=1)
    machine.machine_spec("cpu", quick=True, runs=1)
    assert fake.calls == [("cpu", True)]
    full = machine.machine_spec("cpu", runs=1)  # a full request replaces the quick one ...
    assert fake.calls[-1] == ("cpu", False) and not full.method["quick"]
    machine.machine_spec("cpu", quick=True)  # ... which then answers quick requests too
    assert len(fake.calls) == 2


def test_the_cache_is_keyed_by_machine_and_torch_version(fake, monkeypatch):
    machine.machine_spec("cpu", runs=1)
    before = machine.cache_path("cpu")
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    assert machine.cache_path("cpu") != before
    machine.machine_spec("cpu", runs=1)
    assert len(fake.calls) == 2
    monkeypatch.setattr(machine, "_device_name_and_memory", lambda device: ("Another CPU (8 threads)", 0))
    assert machine.machine_key("cpu")["name"] == "Another CPU (8 threads)"
    assert machine.cache_path("cpu") != before


def test_a_torn_cache_file_is_measured_again(fake):
    machine.machine_spec("cpu", runs=1)
    machine.cache_path("cpu").write_text("{not json")
    spec = machine.machine_spec("cpu", runs=1)
    assert len(fake.calls) == 2 and spec.memory_bandwidth > 0


def test_cache_dir_defaults_to_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("MINILLM_CACHE_DIR", raising=False)
    monkeypatch.delenv("MINILLM_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert machine.cache_dir() == tmp_path / ".cache" / "minillm"
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "shared"))  # the kernels' and models' variable
    assert machine.cache_dir() == tmp_path / "shared"


def test_describe_says_when_it_was_measured_and_how_to_redo_it(fake, capsys):
    spec = machine.machine_spec("cpu", runs=1, verbose=True)
    line = capsys.readouterr().out
    assert spec.measured_at in line and "--remeasure" in line and "35.0 GB/s" not in line and "20.0 GB/s" in line


def test_remeasure_flag_of_the_command_line_measures_again(fake, capsys):
    from minillm.entrypoints.cli import main

    assert main(["roofline", "--device", "cpu", "--runs", "1"]) == 0
    assert main(["roofline", "--device", "cpu", "--runs", "1"]) == 0
    assert len(fake.calls) == 1
    assert main(["roofline", "--device", "cpu", "--runs", "1", "--remeasure"]) == 0
    assert len(fake.calls) == 2
    assert "measured 20" in capsys.readouterr().out


def test_rejects_zero_runs(fake):
    with pytest.raises(ValueError, match="runs must be >= 1, got 0"):
        machine.machine_spec("cpu", runs=0, force=True)
    with pytest.raises(ValueError, match="at least one"):
        machine.best_of([])
