"""``kernels.probe.available_memory`` on fake ``/proc/meminfo`` files and a fake ``sysconf``: MemAvailable when the
kernel reports it, the free physical pages when it does not, 0 where the OS reports neither."""

from __future__ import annotations

import os

import pytest

from minillm.kernels import probe

MEMINFO = """MemTotal:       16318464 kB
MemFree:          812344 kB
MemAvailable:    9876543 kB
Buffers:          123456 kB
"""


def fake_sysconf(values: dict[str, int]):
    """``os.sysconf`` answering ``values`` and raising ValueError (as Python does) for any other name."""
    def sysconf(name: str) -> int:
        if name not in values:
            raise ValueError("unrecognized configuration name")
        return values[name]
    return sysconf


@pytest.fixture
def meminfo(tmp_path, monkeypatch):
    """Write the fake meminfo text given and point the probe at it; free pages: 1000 of 4096 bytes."""
    path = tmp_path / "meminfo"
    monkeypatch.setattr(probe, "MEMINFO", str(path))
    monkeypatch.setattr(os, "sysconf", fake_sysconf({"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}))
    return path


def test_available_memory_is_memavailable_in_bytes(meminfo):
    meminfo.write_text(MEMINFO)
    assert probe.available_memory() == 9876543 * 1024


def test_without_a_memavailable_line_it_is_the_free_physical_pages(meminfo):
    meminfo.write_text(MEMINFO.replace("MemAvailable:    9876543 kB\n", ""))
    assert probe.available_memory() == 1000 * 4096


@pytest.mark.parametrize("text", [None, "MemAvailable:\n", "MemAvailable: lots kB\n"],
                         ids=["no file", "no value", "not a number"])
def test_an_unreadable_meminfo_falls_back_to_the_free_physical_pages(meminfo, text):
    if text is not None:
        meminfo.write_text(text)
    assert probe.available_memory() == 1000 * 4096


def test_where_the_os_reports_nothing_it_is_zero(meminfo, monkeypatch):
    monkeypatch.setattr(os, "sysconf", fake_sysconf({"SC_PAGE_SIZE": 4096}))  # macOS: no SC_AVPHYS_PAGES
    assert probe.available_memory() == 0
    monkeypatch.delattr(os, "sysconf")  # Windows: no sysconf at all
    assert probe.available_memory() == 0


def test_this_machine_reports_some_memory():
    got = probe.available_memory()
    assert isinstance(got, int) and got > 0
