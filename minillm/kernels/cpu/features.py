"""What this CPU can do natively, read from the operating system (never from a timing).

``cpu_has_native_bf16()`` decides whether bf16 is a sensible CPU dtype: with AVX512-BF16 / AMX-BF16 (x86: Zen 4,
Sapphire Rapids) or the Armv8.6 BF16 extension (Graviton 3, Apple M2+) PyTorch's bf16 matmul runs at fp32's rate
or better; without them (AVX2-only hosts such as Zen 3, most laptops) it is emulated element by element, orders
of magnitude slower than fp32.
"""

from __future__ import annotations

import platform
import subprocess
from functools import cache

import torch

X86_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names (Linux arch/x86 cpufeatures)
ARM_BF16_FLAGS = frozenset({"bf16"})  # /proc/cpuinfo "Features" on aarch64 Linux (HWCAP2_BF16)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU in ``cpuinfo`` ("flags" on x86, "Features" on Arm); empty if unreadable."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    return frozenset(value.split())
    except OSError:  # not Linux
        pass
    return frozenset()


def _torch_says_bf16() -> bool:
    """PyTorch's own CPU probe (cpuinfo library), where this torch has one: x86 only."""
    caps = getattr(torch.cpu, "get_capabilities", None)  # torch ≥ 2.9
    if caps is not None:
        found = caps()
        return any(found.get(flag, False) for flag in X86_BF16_FLAGS)
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)  # older torch
    return bool(probe and probe())


def _macos_says_bf16() -> bool:
    """macOS on Apple silicon: ``sysctl hw.optional.arm.FEAT_BF16`` is 1 on M2 and later."""
    try:
        out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == "1"


def native_bf16_from(machine: str, flags: frozenset[str]) -> bool | None:
    """Whether ``flags`` (of a ``machine`` such as "x86_64", "aarch64") include a bf16 arithmetic extension;
    None when ``flags`` is empty (nothing read: ask another source)."""
    if not flags:
        return None
    wanted = ARM_BF16_FLAGS if machine.lower() in ("aarch64", "arm64") else X86_BF16_FLAGS
    return bool(wanted & flags)


@cache  # the hardware does not change while a process runs
def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 in hardware (x86 AVX512-BF16 or AMX-BF16, Arm BF16), so a bf16 matmul
    runs at least as fast as fp32; False when bf16 would be emulated (AVX2-only x86, older Arm) or unknown."""
    machine = platform.machine()
    found = native_bf16_from(machine, cpu_flags())
    if found is not None:
        return found
    if platform.system() == "Darwin" and machine.lower() in ("arm64", "aarch64"):
        return _macos_says_bf16()
    if machine.lower() in ("x86_64", "amd64", "i386", "i686"):
        return _torch_says_bf16()
    return False
