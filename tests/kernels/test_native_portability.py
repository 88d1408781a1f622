"""The native CPU kernels agree with scalar references with every compiler and CPU family we can build for here.

The library compiles ``kernels/cpu/csrc/*.c`` with the machine's own C compiler at first use: gcc or clang, on
x86-64 or aarch64 (a student's ARM laptop).  ``csrc_check/check_kernels.c`` #includes them (``decode.c``: quant.c,
native.c and the fused step, one translation unit), runs the main kernels on fixed inputs and compares each result
with a double-precision reference computed in the same program; it exits 1 on any mismatch.  Each case builds it with
one toolchain and the library's flags (-O3 -ffast-math, OpenMP where the toolchain has it) and runs it, the aarch64
builds under qemu-aarch64.  A case whose tools are missing is skipped with the reason (CI has gcc only).

Optional toolchains (Debian/Ubuntu): ``apt-get install clang libomp-dev gcc-aarch64-linux-gnu qemu-user``.
Built programs are cached under ``native.cache_dir() / "portability"``, keyed by the sources, the compiler's version
and the flags: the first build of a case takes seconds to a minute or two (quant.c at -O3), a rerun none.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from minillm.kernels.cpu import native

CSRC = Path(native.__file__).parent / "csrc"
CHECK = Path(__file__).parent / "csrc_check" / "check_kernels.c"
AARCH64_SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian's cross libc (libc6-dev-arm64-cross), qemu's -L
ON_AARCH64 = platform.machine().lower() in ("aarch64", "arm64")


@dataclass(frozen=True)
class Toolchain:
    """One way to build and run the check.  cc: the compiler command; arch: target flags, each tried with OpenMP
    and then without (None: the library's own ``native.build_flags()``, this machine's CPU); cross: builds for
    aarch64 from another machine, run under qemu; x86_only: its flags name an x86 target."""

    name: str
    cc: tuple[str, ...]
    arch: tuple[str, ...] | None = None
    cross: bool = False
    x86_only: bool = False

    def flag_sets(self) -> list[list[str]]:
        """Extra flags to try, best first, as the library's build does."""
        if self.arch is None:
            return native.build_flags()
        return [[*self.arch, "-fopenmp"], [*self.arch]]

    def runner(self) -> list[str]:
        """The command prefix that runs a built program here: none natively, qemu for an aarch64 cross build."""
        if not self.cross or ON_AARCH64:
            return []
        qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
        return [qemu, "-L", str(AARCH64_SYSROOT)]

    def missing(self) -> str | None:
        """Why this toolchain cannot run here, or None when it can."""
        if self.x86_only and platform.machine().lower() not in ("x86_64", "amd64"):
            return f"builds x86-64 code; this machine is {platform.machine()}"
        if shutil.which(self.cc[0]) is None:
            return f"{self.cc[0]} is not on the PATH"
        if self.cross and not ON_AARCH64:
            if not (shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")):
                return "qemu-aarch64 is not on the PATH (apt-get install qemu-user)"
            if not AARCH64_SYSROOT.is_dir():
                return f"no aarch64 C library at {AARCH64_SYSROOT} (apt-get install gcc-aarch64-linux-gnu)"
        return None


TOOLCHAINS = [
    Toolchain("gcc", ("gcc",)),
    # x86-64 without AVX2: the portable C of both files (GCC vector extensions, plain-C int8 dots), the same source
    # an ARM build compiles; the one such case CI's gcc can run
    Toolchain("gcc-x86-64-portable", ("gcc",), ("-march=x86-64",), x86_only=True),
    Toolchain("clang", ("clang",)),
    Toolchain("clang-x86-64-portable", ("clang",), ("-march=x86-64",), x86_only=True),  # clang reassociates more
    # aarch64 without the dot-product extension (Cortex-A53/A72: Raspberry Pi) and with it (every Apple M-series and
    # recent ARM core); quant.c has no NEON intrinsics, so both take its portable C, vectorised by the compiler.
    Toolchain("gcc-aarch64-armv8-a", ("aarch64-linux-gnu-gcc",), ("-march=armv8-a",), cross=True),
    Toolchain("gcc-aarch64-armv8.2-a+dotprod", ("aarch64-linux-gnu-gcc",), ("-march=armv8.2-a+dotprod",), cross=True),
    # clang's aarch64 code generation for an Apple M1 (what a Mac's clang emits), linked against the Linux sysroot
    Toolchain("clang-aarch64-apple-m1", ("clang", "--target=aarch64-linux-gnu"), ("-mcpu=apple-m1",), cross=True),
]


def _build(tc: Toolchain, cache: Path) -> tuple[Path, list[str]]:
    """check_kernels.c built with the first of ``tc.flag_sets()`` that compiles (cached) -> (program, its flags)."""
    version = subprocess.run([*tc.cc, "--version"], capture_output=True, text=True).stdout
    sources = b"".join(p.read_bytes() for p in [CHECK, *sorted(CSRC.glob("*.c")), *sorted(CSRC.glob("*.h"))])
    errors = []
    for flags in tc.flag_sets():
        cmd = [*tc.cc, "-O3", "-ffast-math", *flags, "-I", str(CSRC), str(CHECK), "-lm"]
        key = hashlib.sha256(sources + version.encode() + repr(cmd).encode()).hexdigest()[:16]
        exe = cache / f"check-{tc.name}-{key}"
        if exe.exists():
            return exe, flags
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache)
        os.close(fd)
        r = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, timeout=600)
        if r.returncode == 0:
            os.replace(tmp, exe)  # atomic: a concurrent worker sees no half-written program
            return exe, flags
        Path(tmp).unlink(missing_ok=True)  # clang deletes its output after a failed link (-fopenmp, no libomp)
        errors.append(f"{' '.join(flags) or '(no extra flags)'}: {r.stderr.strip()[-800:]}")
    pytest.fail(f"{tc.name} could not build check_kernels.c:\n" + "\n".join(errors))


@pytest.mark.parametrize("tc", TOOLCHAINS, ids=lambda tc: tc.name)
def test_kernels_match_scalar_references_with_this_toolchain(tc):
    if (why := tc.missing()) is not None:
        pytest.skip(why)
    exe, flags = _build(tc, native.cache_dir() / "portability")
    # two threads: the larger cases split their weight rows over an OpenMP team (one thread would skip that code)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    r = subprocess.run([*tc.runner(), str(exe)], capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0 or "all kernels agree" not in r.stdout:  # the second: it ran to its end
        lines = [line for line in (r.stdout + r.stderr).splitlines() if not line.startswith("ok")]
        pytest.fail(f"{tc.name} ({' '.join(flags)}), exit status {r.returncode}:\n" + "\n".join(lines))


@pytest.mark.parametrize("machine", ["aarch64", "arm64"])  # Linux's name, macOS's name
def test_arm_builds_try_mcpu_native_then_march_native_then_portable_each_with_openmp_first(monkeypatch, machine):
    # -mcpu=native first: clang <= 14 (Ubuntu 22.04's, older Apple clang) rejects -march=native on aarch64
    monkeypatch.setattr(platform, "machine", lambda: machine)
    assert native.build_flags() == [["-mcpu=native", "-fopenmp"], ["-march=native", "-fopenmp"], ["-fopenmp"],
                                    ["-mcpu=native"], ["-march=native"], []]


def test_x86_builds_try_march_native_then_portable_each_with_openmp_first(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert native.build_flags() == [["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], []]


def test_a_failed_build_reports_the_compilers_messages_even_when_the_compiler_removed_its_output(tmp_path, monkeypatch):
    # clang deletes the -o file after a failed link (e.g. -fopenmp without libomp): cleaning up must not raise
    # FileNotFoundError in place of the compiler's messages
    cc = tmp_path / "cc-link-fails"
    cc.write_text('#!/bin/sh\nwhile [ $# -gt 1 ]; do [ "$1" = -o ] && rm -f "$2"; shift; done\n'
                  'echo "ld: cannot find -lomp" >&2; exit 1\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(RuntimeError, match="cannot find -lomp"):
        native._compile(tmp_path / "lib.so", flags=[["-fopenmp"]])
