"""A bandwidth-bound GEMV for CPU decode, compiled on first use and called through ctypes.

``linear(x, weight, bias)`` has ``torch.nn.functional.linear``'s meaning (the reference) for
x [..., K] with at most ``MAX_ROWS`` rows, weight [N, K], fp32 or bf16 on CPU. ``available()`` says
whether the native library could be built here (it needs a C compiler; without one, callers use
``F.linear``). The C source is ``csrc/native.c``; the built library is cached under
``~/.cache/minillm/kernels`` keyed by the source, the CPU and the compiler, so the compile (~1 s) happens once.
The build uses this CPU's vector width (``-march=native``) and OpenMP where the compiler has them.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache, lru_cache
from pathlib import Path

import torch

MAX_ROWS = 32  # decode batches up to this may use the native kernel (register tiles of up to 8 rows, in blocks)
# Rows up to which the native kernel beats torch's GEMM over a model's layer stack + LM head (weights streamed from
# memory).  fp32: every decode batch.  bf16 where the kernel multiplies bf16 pairs (AVX512-BF16, ``bf16_pairs()``):
# every decode batch too, reading half fp32's bytes with half its arithmetic.  bf16 elsewhere widens each weight
# to fp32 once per 8-row block and then does fp32's FMAs: only the smallest batches, where the bytes decide, beat
# oneDNN's bf16 GEMM.
_ROWS_BY_DTYPE = {torch.float32: MAX_ROWS, torch.bfloat16: 4}
_ROWS_BF16_PAIRS = MAX_ROWS
_SRC = Path(__file__).parent / "csrc" / "native.c"


def cache_dir() -> Path:
    """Where built libraries are kept: ``$MINILLM_CACHE/kernels`` (default ``~/.cache/minillm/kernels``)."""
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm")) / "kernels"


def compiler() -> str | None:
    """The C compiler the build uses: ``$CC``, else cc, gcc or clang on the PATH; None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def source_digest(*sources: Path) -> str:
    """A build's cache key part for its C sources: ``sources`` and every header beside the first (``csrc/split.h``),
    which they include: a change to any of them is a new library."""
    h = hashlib.sha256()
    for path in [*sources, *sorted(sources[0].parent.glob("*.h"))]:
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _cpu_key() -> str:
    """Keys a build to this CPU (``-march=native`` code may not run on another) and compiler."""
    from minillm.kernels.cpu.features import cpu_flags

    flags = " ".join(sorted(cpu_flags())) or platform.processor()
    return hashlib.sha256(f"{flags}|{platform.machine()}|{compiler()}".encode()).hexdigest()[:12]


def build_flags() -> list[list[str]]:
    """Extra compiler flags to try, best first: this CPU's instruction set (``-march=native`` on x86; on aarch64
    ``-mcpu=native``, then ``-march=native``) with OpenMP, then without OpenMP (Apple clang has none: one thread),
    then portable code."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        arch = [["-march=native"]]
    elif machine in ("aarch64", "arm64"):
        # On ARM -mcpu is x86's -march (the core's features and its tuning): clang up to 14 (Ubuntu 22.04's, older
        # Apple clang) rejects -march=native on aarch64, and newer clang takes it as a generic-tuned core.
        arch = [["-mcpu=native"], ["-march=native"]]
    else:
        arch = []
    return [a + omp for omp in (["-fopenmp"], []) for a in arch + [[]]]


def _compile(out: Path, src: Path = _SRC, flags: list[list[str]] | None = None) -> None:
    """Build ``src`` (default ``csrc/native.c``) into the shared library ``out`` with the first of ``flags``
    (default ``build_flags()``) that compiles; warn once when that build has no OpenMP; RuntimeError with the
    compiler's messages when none compiles.  ``kernels/cpu/quant.py`` builds ``csrc/quant.c`` through it too."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc)")
    base = [cc, "-O3", "-ffast-math", "-shared", "-fPIC", str(src)]
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    errors = []
    for extra in build_flags() if flags is None else flags:
        try:
            r = subprocess.run(base + extra + ["-o", tmp, "-lm"], capture_output=True, text=True)
        except OSError as e:  # CC names something that cannot run
            errors.append(f"{cc}: {e}")
            break
        if r.returncode == 0:
            os.replace(tmp, out)  # atomic: a concurrent process sees the old file or the new one
            # Say so: a source error that only OpenMP sees would otherwise leave every kernel one-threaded without
            # a word (it happened: an invalid reduction clause).
            if "-fopenmp" not in extra:
                warnings.warn(f"minillm: native CPU kernels built without OpenMP (one thread); {cc} said:\n"
                              + errors[0], stacklevel=3)
            return
        said = r.stderr.strip()[-500:] or f"exit status {r.returncode}"
        errors.append(f"{' '.join(extra) or '(no extra flags)'}: {said}")
    Path(tmp).unlink(missing_ok=True)  # clang deletes its output after a failed link
    raise RuntimeError(f"could not compile {src.name}:\n" + "\n".join(errors))


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    if os.environ.get("MINILLM_DISABLE_NATIVE"):
        return None
    path = cache_dir() / f"native-{source_digest(_SRC)}-{_cpu_key()}.so"
    try:
        if not path.exists():
            _compile(path)
        # torch is imported first, so the library's libgomp resolves to the OpenMP runtime torch already
        # loaded: one thread pool, not two fighting over the cores.
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as e:  # no compiler, or a broken cache entry: the torch path still works
        warnings.warn(f"minillm: native CPU kernels unavailable ({e}); using the torch path", stacklevel=2)
        return None
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    for name in ("gemv_f32", "gemv_bf16"):
        getattr(lib, name).argtypes = [vp, vp, vp, vp, i64, i64, i64]
        getattr(lib, name).restype = None
    for name in ("decode_attention_f32", "decode_attention_bf16"):
        getattr(lib, name).argtypes = [vp, vp, vp, vp, vp] + [i64] * 6 + [ctypes.c_float]
        getattr(lib, name).restype = None
    for name in ("paged_decode_attention_f32", "paged_decode_attention_bf16"):
        getattr(lib, name).argtypes = [vp] * 6 + [i64] * 6 + [ctypes.c_float, i64, i64]
        getattr(lib, name).restype = None
        getattr(lib, name + "_window").argtypes = [vp] * 6 + [i64] * 6 + [ctypes.c_float] + [i64] * 4
        getattr(lib, name + "_window").restype = None
    for name in ("rope_f32", "rope_bf16"):
        getattr(lib, name).argtypes = [vp] * 4 + [i64] * 4
        getattr(lib, name).restype = None
    for name in ("add_rms_norm_f32", "add_rms_norm_bf16"):
        getattr(lib, name).argtypes = [vp] * 5 + [i64, i64, ctypes.c_float]
        getattr(lib, name).restype = None
    for name in ("silu_mul_f32", "silu_mul_bf16"):
        getattr(lib, name).argtypes = [vp, vp, i64, i64]
        getattr(lib, name).restype = None
    lib.write_kv.argtypes = [vp] * 5 + [i64] * 5
    lib.write_kv.restype = None
    for name in ("rms_norm_f32", "rms_norm_bf16"):
        getattr(lib, name).argtypes = [vp, vp, vp, i64, i64, ctypes.c_float]
        getattr(lib, name).restype = None
    lib.sample_temperature.argtypes = [vp, vp, vp, vp, i64, i64, vp]
    lib.sample_temperature.restype = None
    lib.read_sum_f32.argtypes = [vp, i64]
    lib.read_sum_f32.restype = ctypes.c_double
    lib.built_with_openmp.argtypes = []
    lib.gemv_bf16_pairs.argtypes = []
    lib.gemv_bf16_pairs.restype = ctypes.c_int
    lib.built_with_openmp.restype = ctypes.c_int
    return lib


def available() -> bool:
    """True when the native library is built and loadable on this machine."""
    return _lib() is not None


def openmp() -> bool:
    """True when the native library was compiled with OpenMP, so its loops use torch's threads (else one)."""
    return available() and bool(_lib().built_with_openmp())


def bf16_pairs() -> bool:
    """True when the bf16 GEMV multiplies bf16 weight and input pairs into fp32 sums (AVX512-BF16's vdpbf16ps:
    the build's CPU has it), False when it widens the weights to fp32 (every other CPU, or no library)."""
    return available() and bool(_lib().gemv_bf16_pairs())


@cache
def native_rows(dtype: torch.dtype) -> int:
    """Decode rows up to which ``prefers_native`` takes the native GEMV for ``dtype`` (rule: ``_ROWS_BY_DTYPE``)."""
    return _ROWS_BF16_PAIRS if dtype == torch.bfloat16 and bf16_pairs() else _ROWS_BY_DTYPE[dtype]


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` can take the native path (else use ``F.linear``)."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.numel() // x.shape[-1] <= MAX_ROWS
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))  # no autograd here
        and available()
    )


def prefers_native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the native GEMV is the faster choice for ``x @ weight.T`` here (the model's dispatch rule)."""
    return supports(x, weight) and x.numel() // x.shape[-1] <= native_rows(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias.  x [..., K] (≤ MAX_ROWS rows), weight [N, K] -> y [..., N]. Same dtype throughout."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features but weight expects K={K}")
    if not supports(x, weight):
        raise ValueError("native.linear needs CPU fp32/bf16 tensors of one dtype with at most "
                         f"{MAX_ROWS} rows and a compiled native library; use F.linear instead")
    if bias is not None and (bias.shape != (N,) or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [{N}] of dtype {weight.dtype}")
    x = x.contiguous()  # a no-op (no ATen call) for the usual contiguous activations
    w = weight.contiguous()  # no-op for parameters; a copy would cost as much as the GEMV itself
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype)  # the one ATen op of this call: every one costs µs
    fn = _lib().gemv_f32 if x.dtype == torch.float32 else _lib().gemv_bf16
    fn(w.data_ptr(), x.data_ptr(), bias.contiguous().data_ptr() if bias is not None else None, y.data_ptr(),
       x.numel() // K, N, K)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., K] (any rows: split over threads past a few decode rows) -> x / rms(x) * weight, fp32 statistics;
    reference ``kernels.select.torch_rms_norm``."""
    K = x.shape[-1]
    if not elementwise_supports(x, weight) or weight.shape != (K,):
        raise ValueError("native.rms_norm needs CPU fp32/bf16 tensors of one dtype and weight [K]")
    x = x.contiguous()
    y = torch.empty_like(x)
    fn = _lib().rms_norm_f32 if x.dtype == torch.float32 else _lib().rms_norm_bf16
    fn(x.data_ptr(), weight.contiguous().data_ptr(), y.data_ptr(), x.numel() // K, K, eps)
    return y


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, *, check_lens: bool = True) -> torch.Tensor:
    """One query per sequence over its first ``seq_lens[b]`` cached keys, on CPU.

    q [B, H_q, D]; k, v [B, H_kv, S_max, D] (views into a cache: the last two dims contiguous, any batch/head
    strides); seq_lens [B] -> [B, H_q, D].  Reference: ``minillm.kernels.reference.decode_attention``.
    ``check_lens=False`` skips the range check of ``seq_lens`` (two reductions and two syncs): for a KV cache
    whose lengths are right by construction, calling it in every layer of every step.
    """
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    if k.shape != v.shape or k.stride() != v.stride() or k.shape[0] != B or k.shape[3] != D or Hq % Hkv:
        raise ValueError(f"need q [B, H_q, D] and k, v [B, H_kv, S, D] with equal strides; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.stride(3) != 1 or k.stride(2) != D:
        raise ValueError("k and v rows must be contiguous ([..., S, D] with stride (D, 1))")
    if q.dtype != k.dtype or q.dtype not in (torch.float32, torch.bfloat16) or not available():
        raise ValueError("native.decode_attention needs fp32/bf16 CPU tensors and the native library")
    lens = (seq_lens if seq_lens.dtype == torch.int64 else seq_lens.to(torch.int64)).contiguous()
    if lens.shape != (B,) or check_lens and (int(lens.min()) < 1 or int(lens.max()) > k.shape[2]):
        raise ValueError(f"seq_lens must be [B={B}] with values in [1, {k.shape[2]}]")
    q = q.contiguous()
    out = torch.empty_like(q)
    fn = _lib().decode_attention_f32 if q.dtype == torch.float32 else _lib().decode_attention_bf16
    fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), lens.data_ptr(), out.data_ptr(), B, Hq, Hkv, D,
       k.stride(0), k.stride(1), scale)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int = 0, sinks: int = 0) -> torch.Tensor:
    """Decode attention through block tables, on CPU.  q [B, H_q, D] (any row/head strides, e.g. a view into the qkv
    projection: no copy); k/v cache [num_blocks, block_size, H_kv, D] (contiguous); block_tables [B, W] int32;
    seq_lens [B] int32 -> [B, H_q, D].  The caller guarantees the table entries below each length are valid
    blocks (the engine's block manager does); no checks cost a sync.  ``window`` > 0: only the last ``window``
    keys and the first ``sinks`` are read (blocks holding none of them may have any entry).
    Reference: ``minillm.kernels.reference.paged_decode_attention_ref`` (``paged_window_attention_ref``)."""
    B, Hq, D = q.shape
    nb, bs, Hkv, Dk = k_cache.shape
    if q.stride(2) != 1:
        q = q.contiguous()  # rows and heads may have any strides (a view into the qkv projection), elements not
    if Dk != D or Hq % Hkv or k_cache.shape != v_cache.shape or block_tables.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, tables "
                         f"{tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or block_tables.dtype != torch.int32 \
            or seq_lens.dtype != torch.int32:
        raise ValueError("need contiguous caches and int32 block_tables / seq_lens")
    if q.dtype != k_cache.dtype or q.dtype not in (torch.float32, torch.bfloat16) or not available():
        raise ValueError("native.paged_decode_attention needs fp32/bf16 CPU tensors and the native library")
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty(B, Hq, D, dtype=q.dtype)
    name = "paged_decode_attention_" + ("f32" if q.dtype == torch.float32 else "bf16")
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
            B, Hq, Hkv, D, bs, tables.shape[1], scale, q.stride(0), q.stride(1))
    if window:
        getattr(_lib(), name + "_window")(*args, window, sinks)
    else:
        getattr(_lib(), name)(*args)
    return out


def read_sum(a: torch.Tensor) -> float:
    """Sum a contiguous fp32 CPU tensor with a streaming multi-threaded loop (a read-bandwidth probe)."""
    if a.dtype != torch.float32 or a.device.type != "cpu" or not a.is_contiguous():
        raise ValueError("read_sum needs a contiguous fp32 CPU tensor")
    if not available():
        return float(a.sum())
    return _lib().read_sum_f32(a.data_ptr(), a.numel())


def sample_temperature(logits: torch.Tensor, rows: list[int], temperature: list[float], u: torch.Tensor) -> list[int]:
    """One token for each of ``rows`` of ``logits`` drawn from softmax(row / its temperature): where its ``u`` times
    the row's total falls in its cumulative weights (``csrc/native.c``'s ``sample_temperature``; ``sampling.sampler``
    keeps the reference).  logits [B, V] contiguous fp32 CPU, rows and temperature (finite, > 0) of one length R, u
    [R] float64 in [0, 1) -> R token ids, -1 for a row with a non-finite logit (the caller samples it the reference
    way).  Cost: about two passes over each row (one exponential a logit), no copies of it; rows split across the
    threads."""
    R = len(rows)
    if not (logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and logits.is_contiguous() and len(temperature) == R and u.dtype == torch.float64 and u.shape == (R,)
            and all(0 <= r < logits.shape[0] for r in rows)
            and all(math.isfinite(t) and t > 0 for t in temperature)):
        raise ValueError(f"sample_temperature needs contiguous CPU logits [B, V] fp32, R row indices < B, R finite "
                         f"temperatures > 0 and u [R] float64; got {logits.dtype} {tuple(logits.shape)}, rows {rows}, "
                         f"temperatures {temperature}, u {u.dtype} {tuple(u.shape)} (greedy rows take the argmax)")
    index, temps = torch.tensor(rows, dtype=torch.int64), torch.tensor(temperature, dtype=torch.float32)
    u, out = u.contiguous(), torch.empty(R, dtype=torch.int64)
    _lib().sample_temperature(logits.data_ptr(), index.data_ptr(), temps.data_ptr(), u.data_ptr(), R,
                              logits.shape[1], out.data_ptr())
    return out.tolist()


# ---------------------------------------------------------------- decode-step fusions (csrc/native.c, second half)
def elementwise_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the elementwise kernels (rms_norm, add_rms_norm, rope, silu_and_mul) can take x (and its weight, of
    x's dtype): CPU fp32/bf16, no autograd, library built.  Any row count: unlike a GEMV, which only beats torch's
    GEMM for decode rows, one fused pass beats the reference's several ATen passes at prefill rows too (the C
    splits rows over threads past decode sizes)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == x.dtype
            and weight.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad) and available())


def rope_supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rope(x, cos, sin)`` can run natively: x [B, L, H, D] with heads of D contiguous
    elements and its B·L rows at one stride (a head-split view of a projection is), cos/sin [B, L, 1, D]
    contiguous, one dtype."""
    if x.dim() != 4 or not elementwise_supports(x, cos) or sin.dtype != x.dtype:
        return False
    B, L, H, D = x.shape
    return (x.stride(3) == 1 and x.stride(2) == D and _row_stride(x) is not None
            and cos.shape == sin.shape == (B, L, 1, D) and cos.is_contiguous() and sin.is_contiguous())


def _row_stride(x: torch.Tensor) -> int | None:
    """The stride between consecutive rows (b, l) of x [B, L, ...] flattened to B·L rows, None if not uniform."""
    B, L = x.shape[:2]
    if L == 1:
        return x.stride(0)
    return x.stride(1) if B == 1 or x.stride(0) == L * x.stride(1) else None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in one pass: x [B, L, H, D] (see ``rope_supports``), cos/sin [B, L, 1, D] -> [B, L, H, D] contiguous.
    Reference: ``layers.rotary.apply_rope`` (x * cos + rotate_half(x) * sin, the same roundings)."""
    if not rope_supports(x, cos, sin):
        raise ValueError("native.rope needs x [B, L, H, D] (heads contiguous, rows at one stride) "
                         "and contiguous cos/sin [B, L, 1, D] of its dtype on CPU")
    B, L, H, D = x.shape
    y = torch.empty(B, L, H, D, dtype=x.dtype)
    fn = _lib().rope_f32 if x.dtype == torch.float32 else _lib().rope_bf16
    fn(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), B * L, H, D, _row_stride(x))
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + residual; -> (rms_norm(r) * weight, r), x and residual [..., K] (any rows).  One call for a
    residual add and the norm after it.  Reference: ``kernels.select.torch_add_rms_norm``."""
    K = x.shape[-1]
    if not (elementwise_supports(x, weight) and x.shape == residual.shape and weight.shape == (K,)
            and x.dtype == residual.dtype == weight.dtype):
        raise ValueError("native.add_rms_norm needs CPU fp32/bf16 x and residual [..., K] of one shape and dtype "
                         "and weight [K]")
    x, residual = x.contiguous(), residual.contiguous()
    y, r = torch.empty_like(x), torch.empty_like(x)
    fn = _lib().add_rms_norm_f32 if x.dtype == torch.float32 else _lib().add_rms_norm_bf16
    fn(x.data_ptr(), residual.data_ptr(), weight.contiguous().data_ptr(), y.data_ptr(), r.data_ptr(),
       x.numel() // K, K, eps)
    return y, r


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: x [..., 2F] = [gate | up] (any rows) -> silu(gate) * up [..., F].
    Reference: ``kernels.select.torch_silu_and_mul``."""
    if not elementwise_supports(x, x) or x.shape[-1] % 2:
        raise ValueError("native.silu_and_mul needs a CPU fp32/bf16 x [..., 2F]")
    F2 = x.shape[-1]
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], F2 // 2, dtype=x.dtype)
    fn = _lib().silu_mul_f32 if x.dtype == torch.float32 else _lib().silu_mul_bf16
    fn(x.data_ptr(), y.data_ptr(), x.numel() // F2, F2 // 2)
    return y


def write_kv_supports(k_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``write_kv`` can run natively: CPU, contiguous cache [..., H_kv, D], new rows [T, H_kv, D] of its
    dtype with heads of D contiguous elements (any row stride: views into the qkv projection are)."""
    Hkv, D = k_cache.shape[-2:]
    return (k_cache.device.type == "cpu" and available() and k_cache.is_contiguous()
            and all(t.dim() == 3 and t.shape[1:] == (Hkv, D) and t.dtype == k_cache.dtype and t.stride(2) == 1
                    and t.stride(1) == D for t in (k, v)))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, H_kv, D] at slots ``slot_mapping`` [T] (int64) of the caches [num_blocks, block_size, H_kv, D]
    (flattened, slot = block * block_size + offset), in place: the caches are the KV store's own tensors.  The
    caller guarantees valid slots (the engine's block manager does; no check costs a per-layer op).
    Reference: ``kernels.select.torch_write_kv``."""
    if not (write_kv_supports(k_cache, k, v) and v_cache.shape == k_cache.shape and v_cache.is_contiguous()
            and v_cache.dtype == k_cache.dtype and slot_mapping.dtype == torch.int64
            and slot_mapping.shape == (k.shape[0],) and v.shape[0] == k.shape[0]):
        raise ValueError("native.write_kv needs contiguous CPU caches [..., H_kv, D], k and v [T, H_kv, D] of their "
                         "dtype (heads contiguous) and int64 slot_mapping [T]")
    slots = slot_mapping.contiguous()
    Hkv, D = k.shape[1:]
    _lib().write_kv(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                    k.shape[0], Hkv * D, k.stride(0), v.stride(0), k.element_size())
