"""CPU feature detection reads /proc/cpuinfo-style text: x86 "flags", Arm "Features"."""

import platform

import pytest

from minillm.kernels.cpu.features import cpu_flags, cpu_has_native_bf16, native_bf16_from

ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f amx_tile amx_bf16 amx_int8\n"
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics\n"


@pytest.mark.parametrize(("machine", "text", "native"), [
    ("x86_64", ZEN3, False), ("x86_64", ZEN4, True), ("x86_64", SAPPHIRE_RAPIDS, True),
    ("aarch64", GRAVITON3, True), ("aarch64", GRAVITON2, False),
])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, machine, text, native):
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    assert native_bf16_from(machine, cpu_flags(str(info))) is native


def test_unreadable_cpuinfo_means_ask_another_source(tmp_path):
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()
    assert native_bf16_from("x86_64", frozenset()) is None


def test_this_cpus_answer_agrees_with_its_flags():
    flags = cpu_flags()
    want = native_bf16_from(platform.machine(), flags) if flags else cpu_has_native_bf16()
    assert cpu_has_native_bf16() is want
