"""The native CPU decode kernels against their PyTorch references."""

import subprocess
import warnings

import pytest
import torch
import torch.nn.functional as F

from minillm.kernels.cpu import native
from minillm.kernels.reference import decode_attention as decode_attention_ref
from minillm.kernels.select import ops_for

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the torch path is used instead")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 32])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (7, 33), (1, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_f_linear(dtype, rows, shape, bias):
    g = torch.Generator().manual_seed(rows * 7 + shape[0])
    N, K = shape
    w = torch.randn(N, K, generator=g).to(dtype)
    x = torch.randn(rows, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    got, want = native.linear(x, w, b), F.linear(x, w, b)
    # Both accumulate K products in fp32 in different orders: the difference grows like sqrt(K)·eps·|terms|,
    # beyond assert_close's per-element fp32 default; bf16 adds one output rounding (its default rtol covers it).
    atol = 4e-6 * K**0.5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=atol, rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-5)


# Rows 1..9 and 17 cover every row-block size (1..8), a second block and a third; N = 7, 13 leave ragged weight
# tiles; K = 33, 100, 577 leave a tail shorter than one vector; (517, 577) is large enough to be split across threads.
_ROW_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17]
_ODD_SHAPES = [(7, 33), (13, 100), (517, 577), (64, 1536)]


def _rows_alone_and_together(gemv, dtype, shape, bias, seed):
    """(each row of x [17, K] through its own 1-row call, x[:M] in one call for each M, F.linear on x[:M])."""
    g = torch.Generator().manual_seed(seed)
    N, K = shape
    w = torch.randn(N, K, generator=g).to(dtype)
    x = torch.randn(max(_ROW_COUNTS), K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    alone = torch.cat([gemv(x[m:m + 1], w, b) for m in range(x.shape[0])])
    return alone, [(M, gemv(x[:M], w, b), F.linear(x[:M], w, b)) for M in _ROW_COUNTS]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", _ODD_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_row_results_do_not_depend_on_how_many_rows_share_the_call(dtype, shape, bias):
    # speculative verification runs γ + 1 rows where plain decode runs one: greedy output is the same only if a
    # row's logits are bit for bit those of a 1-row call, whatever row block or weight tile it lands in
    alone, together = _rows_alone_and_together(native.linear, dtype, shape, bias, seed=shape[0] * 31 + shape[1])
    atol = 4e-6 * shape[1]**0.5 if dtype == torch.float32 else 1e-2  # as in test_gemv_matches_f_linear
    for M, got, want in together:
        assert torch.equal(got, alone[:M]), f"M={M}: rows differ from their 1-row calls"
        torch.testing.assert_close(got, want, atol=atol, rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-5)


def _check_bf16_within_rounding_of_the_fp32_product(gemv, rows, shape, bias, seed):
    """gemv(x, w, b) on bf16 x [rows, K], w [N, K], b [N] against F.linear in fp32 on the same bf16 values (the
    products are then exact): a correct kernel differs by its output's one rounding to bf16 (half a bf16 ulp of the
    value) plus fp32 summation error, at most K·eps32 of the terms' magnitude for each of the two sums (and the
    rounding of that).  A dropped term (a lost K tail, a skipped pair) costs a whole |x·w|, far beyond it."""
    g = torch.Generator().manual_seed(seed)
    N, K = shape
    w, x = torch.randn(N, K, generator=g).bfloat16(), torch.randn(rows, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    fb = None if b is None else b.float()
    want = F.linear(x.float(), w.float(), fb)
    terms = F.linear(x.float().abs(), w.float().abs(), None if fb is None else fb.abs())
    eps16, eps32 = torch.finfo(torch.bfloat16).eps, torch.finfo(torch.float32).eps
    bound = eps16 / 2 * want.abs() + 3 * (K + 1) * eps32 * terms
    got = gemv(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.float() - want).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"rows={rows} {shape}: |got - fp32 product| {err.flatten()[worst]:.4g} > "
                                        f"bound {bound.flatten()[worst]:.4g} at flat index {worst}")


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17, 32])
@pytest.mark.parametrize("shape", [*_ODD_SHAPES, (960, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_gemv_is_within_bf16_rounding_of_the_fp32_product(rows, shape, bias):
    # the kernel this CPU runs: bf16 pairs (vdpbf16ps) on AVX512-BF16 CPUs, weights widened to fp32 elsewhere;
    # K = 33, 100, 577 leave tails shorter than one vector of either
    _check_bf16_within_rounding_of_the_fp32_product(native.linear, rows, shape, bias, seed=rows * 131 + shape[1])


def _native_target_defines(*macros: str) -> bool:
    """Whether the compiler the build uses defines all ``macros`` for this CPU (-march=native)."""
    r = subprocess.run([native.compiler(), "-march=native", "-dM", "-E", "-"], input="", capture_output=True,
                       text=True)
    return r.returncode == 0 and all(f"#define {m} " in r.stdout for m in macros)


def test_bf16_gemv_multiplies_pairs_exactly_where_the_build_targets_avx512_bf16():
    # the bf16 pairs kernel is what lets bf16 decode batches stay native (prefers_native); a build that silently
    # lost it (a renamed macro, a missing header) would hand them back to torch's GEMM
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("AVX512-BF16 is x86")
    want = _native_target_defines("__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__FMA__", "__AVX512BF16__")
    assert native.bf16_pairs() == want
    rows = native.MAX_ROWS if want else 5
    x, w = torch.randn(rows, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    assert native.prefers_native(x, w) == want  # every decode batch only with the pairs kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_result_does_not_depend_on_the_thread_count(dtype):
    # rows are split across threads by weight row n, each (n, m) pair summed whole in one thread
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(517, 577, generator=g).to(dtype), torch.randn(9, 577, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.linear(x, w)
        torch.set_num_threads(3)
        assert torch.equal(native.linear(x, w), one)
    finally:
        torch.set_num_threads(threads)


def _gemv_built_for(march: str | None, tmp_path):
    """csrc/native.c built with ``-march=march`` (None: the compiler's default target), its SIMD level (a bf16
    pairs build adds 1: 513), and a ``linear(x, w, b)`` over its gemv_f32 / gemv_bf16."""
    import ctypes

    out = tmp_path / f"native-{march}.so".replace(" ", "")
    native._compile(out, flags=[(f"-march={march}".split() if march else []) + omp for omp in (["-fopenmp"], [])])
    lib = ctypes.CDLL(str(out))
    for name in ("gemv_f32", "gemv_bf16"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3

    def linear(x, w, b):
        y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
        fn = lib.gemv_f32 if x.dtype == torch.float32 else lib.gemv_bf16
        fn(w.data_ptr(), x.contiguous().data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), *x.shape[:1],
           *w.shape)
        return y

    return lib.gemv_simd_level() + lib.gemv_bf16_pairs(), linear


def _cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


# the library is built with -march=native; these are the code paths of other machines, built here on purpose:
# AVX-512 with bf16 pairs (Zen 4, Xeons from Cooper Lake), AVX-512 widening bf16 (Skylake-X to Ice Lake), AVX2 only,
# and the portable one (ARM, older x86).  Level: the SIMD width, + 1 for the bf16 pairs kernel.
_X86_BUILDS = {"x86-64-v4 -mavx512bf16": (513, {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}),
               "x86-64-v4": (512, {"avx512f", "avx512bw", "avx512vl"}), "x86-64-v3": (256, {"avx2", "fma"}),
               "x86-64": (0, set())}


@pytest.mark.parametrize("march", list(_X86_BUILDS))
def test_gemv_rows_are_independent_of_the_row_count_in_every_x86_build(march, tmp_path):
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the x86 targets build only on x86")
    level, needs = _X86_BUILDS[march]
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU cannot run a {march} build (it lacks {sorted(needs - _cpu_flags())})")
    built_level, linear = _gemv_built_for(march, tmp_path)
    assert built_level == level  # the build took the path this test is about
    for dtype in (torch.float32, torch.bfloat16):
        alone, together = _rows_alone_and_together(linear, dtype, (13, 100), True, seed=3)
        for M, got, want in together:
            assert torch.equal(got, alone[:M]), f"{march} {dtype} M={M}"
            torch.testing.assert_close(got, want, atol=4e-5 if dtype == torch.float32 else 1e-2,
                                       rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-5)
    for rows, shape in ((1, (7, 33)), (9, (13, 100)), (32, (64, 577))):
        _check_bf16_within_rounding_of_the_fp32_product(linear, rows, shape, True, seed=rows)


def _compiler_has_openmp(tmp_path) -> bool:
    """Whether the compiler the build uses compiles and links an OpenMP shared library (Apple clang does not)."""
    src = tmp_path / "omp.c"
    src.write_text("#include <omp.h>\nint threads(void) { return omp_get_max_threads(); }\n")
    cmd = [native.compiler(), "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(tmp_path / "omp.so")]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def test_kernels_are_built_with_openmp_where_the_compiler_has_it(tmp_path):
    # the build falls back to a one-thread library when the OpenMP build fails: a source error that only OpenMP
    # sees (it happened: an invalid reduction clause) silently made every native kernel single-threaded
    if not _compiler_has_openmp(tmp_path):
        pytest.skip(f"{native.compiler()} has no OpenMP: the one-thread build is the expected one")
    assert native.openmp()


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache and a forgotten library, restored afterwards (the next call reloads the usual one)."""
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    native._lib.cache_clear()
    yield monkeypatch
    native._lib.cache_clear()


def test_without_openmp_the_library_still_builds_works_and_warns_once(fresh_build, tmp_path):
    # a compiler that rejects -fopenmp, as Apple's clang does
    wrapper = tmp_path / "cc-without-openmp"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "no OpenMP here" >&2; exit 1; }}; '
                       f'done\nexec {native.compiler()} "$@"\n')
    wrapper.chmod(0o755)
    fresh_build.setenv("CC", str(wrapper))
    with pytest.warns(UserWarning, match="(?s)built without OpenMP.*no OpenMP here"):
        assert native.available()
    assert not native.openmp()
    w, x = torch.randn(33, 70), torch.randn(3, 70)
    torch.testing.assert_close(native.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    native._lib.cache_clear()  # as a new process would: the cached build loads without a second warning
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert native.available() and not native.openmp()
    assert not again


def test_without_a_compiler_the_torch_path_is_used_with_one_warning(fresh_build):
    fresh_build.setenv("CC", "/bin/false")
    with pytest.warns(UserWarning, match="(?s)native CPU kernels unavailable.*could not compile"):
        assert not native.available()
    assert not native.openmp() and not native.supports(torch.randn(1, 4), torch.randn(3, 4))


def test_gemv_keeps_leading_dims_and_rejects_too_many_rows():
    w = torch.randn(10, 4)
    assert native.linear(torch.randn(2, 1, 4), w).shape == (2, 1, 10)
    with pytest.raises(ValueError, match="F.linear"):
        native.linear(torch.randn(native.MAX_ROWS + 1, 4), w)
    with pytest.raises(ValueError, match="features"):
        native.linear(torch.randn(1, 5), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 512])  # decode rows and a prefill chunk's (split over threads)
def test_rms_norm_matches_reference(dtype, rows):
    from minillm.layers.norm import RMSNorm

    norm = RMSNorm(576, 1e-5).requires_grad_(False)
    norm.weight.copy_(torch.randn(576))
    norm = norm.to(dtype)
    x = torch.randn(rows, 1, 576).to(dtype)
    fast = norm(x, ops_for("auto", "cpu", dtype))
    assert torch.equal(fast, native.rms_norm(x, norm.weight, 1e-5))  # "auto" took the native kernel
    torch.testing.assert_close(fast, norm(x, ops_for("torch", "cpu", dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h_kv", [1, 3, 9])
def test_decode_attention_matches_reference(dtype, h_kv):
    g = torch.Generator().manual_seed(h_kv)
    cache_k = torch.randn(3, h_kv, 40, 64, generator=g).to(dtype)  # (B, H_kv, S_max, D)
    cache_v = torch.randn(3, h_kv, 40, 64, generator=g).to(dtype)
    q = torch.randn(3, 9, 64, generator=g).to(dtype)
    lens = torch.tensor([1, 23, 40])
    got = native.decode_attention(q, cache_k, cache_v, lens, 64**-0.5)
    want = decode_attention_ref(q, cache_k, cache_v, lens)
    if dtype == torch.bfloat16:  # the reference rounds the softmax weights to bf16 before P·V; native keeps fp32
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1.6e-2)
    else:
        torch.testing.assert_close(got, want)


def test_decode_attention_reads_strided_cache_views():
    cache = torch.randn(2, 5, 3, 50, 16)  # (layers, B, H_kv, S_max, D): a layer's view has batch/head strides
    q = torch.randn(5, 6, 16)
    lens = torch.tensor([4, 50, 1, 17, 30])
    got = native.decode_attention(q, cache[1], cache[0], lens, 0.25)
    torch.testing.assert_close(got, decode_attention_ref(q, cache[1], cache[0], lens, scale=0.25))


def test_decode_attention_rejects_lengths_beyond_the_cache():
    with pytest.raises(ValueError, match="seq_lens"):
        native.decode_attention(torch.randn(1, 2, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8),
                                  torch.tensor([5]), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_matches_reference(dtype):
    from minillm.kernels.reference import paged_decode_attention_ref

    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(12, 5, 3, 32, generator=g).to(dtype)  # (num_blocks, block_size, H_kv, D)
    v_cache = torch.randn(12, 5, 3, 32, generator=g).to(dtype)
    tables = torch.tensor([[7, 2, 11, 0], [3, 9, 0, 0], [5, 0, 0, 0]], dtype=torch.int32)  # shuffled blocks
    lens = torch.tensor([17, 6, 1], dtype=torch.int32)
    q = torch.randn(3, 6, 32, generator=g).to(dtype)
    got = native.paged_decode_attention(q, k_cache, v_cache, tables, lens, 32**-0.5)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens)
    tol = dict(atol=2e-2, rtol=1.6e-2) if dtype == torch.bfloat16 else {}  # bf16: reference rounds P before P·V
    torch.testing.assert_close(got, want, **tol)


def _paged_case(seed: int, lens: list[int], Hq: int, Hkv: int, D: int, bs: int, dtype: torch.dtype):
    """Random q [B, Hq, D], caches [num_blocks, bs, Hkv, D] and shuffled block tables [B, W] for sequences of
    ``lens`` positions (each sequence its own blocks; tables padded with an id past the pool, never read)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    nblocks, W = sum(need), max(need)
    perm = torch.randperm(nblocks, generator=g).to(torch.int32)
    tables = torch.full((len(lens), W), nblocks + 7, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at:at + n]
        at += n
    kc, vc = (torch.randn(nblocks, bs, Hkv, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(lens), Hq, D, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32)


# (lens, Hq, Hkv, D, block size): lengths off a block boundary, S = 1, G = 1 and G = 3 (SmolLM2's 9 / 3 heads),
# a length on a boundary, a long one (hundreds of blocks: the online softmax rescales many times), and Llama-3's
# 32 / 8 heads of 128 (eight groups of four)
_PAGED_SHAPES = [([1], 9, 3, 64, 16), ([17, 1, 32, 5], 9, 3, 64, 16), ([33, 7], 4, 4, 32, 16),
                 ([20, 3, 48], 6, 2, 16, 5), ([4100, 9], 2, 1, 8, 16), ([40, 3, 17], 32, 8, 128, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", _PAGED_SHAPES)
def test_paged_decode_attention_matches_reference_on_odd_lengths_and_head_groups(dtype, shape):
    from minillm.kernels.reference import paged_decode_attention_ref

    lens, Hq, Hkv, D, bs = shape
    q, kc, vc, tables, lens_t = _paged_case(len(lens) * 7 + D, lens, Hq, Hkv, D, bs, dtype)
    got = native.paged_decode_attention(q, kc, vc, tables, lens_t, D**-0.5)
    # the kernel accumulates in fp32 and rounds once: compare with the fp32 reference rounded to the dtype
    want = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, lens_t).to(dtype)
    torch.testing.assert_close(got, want, **(dict(atol=1e-2, rtol=1.6e-2) if dtype == torch.bfloat16 else {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)])
def test_paged_decode_attention_row_is_bit_identical_alone_in_a_batch_and_on_any_thread_count(dtype, heads):
    # speculative verification compares a row computed among other rows with the same row computed alone: each
    # (row, head) must be summed in an order fixed by that row's own inputs.  A row of 9 / 3 heads alone on 2
    # threads is split into 4 head ranges that cut GQA groups; in the batch (or on 1 thread) a range is a group
    lens = [37, 200, 1, 64, 129]
    q, kc, vc, tables, lens_t = _paged_case(3, lens, *heads, 16, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch_one = native.paged_decode_attention(q, kc, vc, tables, lens_t, 0.125)
        torch.set_num_threads(2)
        batch_two = native.paged_decode_attention(q, kc, vc, tables, lens_t, 0.125)
        alone = [native.paged_decode_attention(q[b:b + 1], kc, vc, tables[b:b + 1], lens_t[b:b + 1], 0.125)
                 for b in range(len(lens))]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch_one, batch_two), "result depends on the thread count"
    for b in range(len(lens)):
        assert torch.equal(alone[b][0], batch_two[b]), f"row {b} differs alone and in the batch"



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_decode_attention_row_is_bit_identical_alone_in_a_batch_and_on_any_thread_count(dtype):
    # batch 1 on 2 threads splits a GQA group's heads over work items, a batch of 5 gives each item the whole
    # group: a head's result must not depend on which
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(5, 3, 300, 64, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(5, 9, 64, generator=g).to(dtype)
    lens = torch.tensor([37, 300, 1, 64, 129])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch_one = native.decode_attention(q, k, v, lens, 0.125)
        torch.set_num_threads(2)
        batch_two = native.decode_attention(q, k, v, lens, 0.125)
        alone = [native.decode_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], lens[b:b + 1], 0.125)
                 for b in range(5)]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch_one, batch_two), "result depends on the thread count"
    for b in range(5):
        assert torch.equal(alone[b][0], batch_two[b]), f"row {b} differs alone and in the batch"


# ------------------------------------------------------------------------------- decode-step fusions vs references
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, L", [(1, 1), (1, 5), (3, 1), (2, 4), (1, 300)])
def test_native_rope_on_a_view_of_the_qkv_projection_matches_apply_rope(dtype, B, L):
    from minillm.config import ModelConfig
    from minillm.layers.rotary import RotaryEmbedding, apply_rope

    config = ModelConfig(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=64,
                         num_layers=1, vocab_size=32)
    H, D = 9 + 3, 64
    g = torch.Generator().manual_seed(B * 10 + L)
    qkv = torch.randn(B, L, (H + 3) * D, generator=g).to(dtype)
    x = qkv[..., : H * D].view(B, L, H, D)  # q and k heads, rows at the projection's stride (not contiguous)
    positions = torch.randint(0, 2000, (B, L), generator=g)
    cos, sin = RotaryEmbedding(config)(positions, dtype)
    assert native.rope_supports(x, cos, sin)
    torch.testing.assert_close(native.rope(x, cos, sin), apply_rope(x, cos, sin))


def test_native_rope_refuses_what_it_cannot_read():
    cos = sin = torch.randn(1, 2, 1, 8)
    assert not native.rope_supports(torch.randn(1, 2, 8, 3).transpose(2, 3), cos, sin)  # elements 3 apart
    with pytest.raises(ValueError, match="native.rope"):
        native.rope(torch.randn(1, 2, 3, 8).half(), cos.half(), sin.half())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_native_add_rms_norm_matches_the_add_then_the_norm(dtype, rows):
    from minillm.kernels.select import torch_add_rms_norm

    g = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, 1, 576, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(576, generator=g).to(dtype)
    y, r = native.add_rms_norm(x, res, w, 1e-5)
    y_ref, r_ref = torch_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(r, r_ref, rtol=0, atol=0)  # one rounded add: exactly the reference's
    torch.testing.assert_close(y, y_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 4, 200])
def test_native_silu_and_mul_matches_silu_of_gate_times_up(dtype, rows):
    from minillm.kernels.select import torch_silu_and_mul

    x = (3 * torch.randn(rows, 1, 2 * 1536, generator=torch.Generator().manual_seed(rows))).to(dtype)
    torch.testing.assert_close(native.silu_and_mul(x), torch_silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_rows_are_bit_identical_alone_in_a_prefill_chunk_and_on_any_thread_count(dtype):
    # a prefill chunk's rows are split over threads, a decode row runs alone in the caller's thread: a token's
    # norm, rope and activation must not depend on which (greedy output through chunked prefill relies on it)
    g = torch.Generator().manual_seed(9)
    M, K, F, H, D = 400, 576, 1536, 12, 64
    x, res = (torch.randn(M, K, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(K, generator=g).to(dtype)
    gu = (3 * torch.randn(M, 2 * F, generator=g)).to(dtype)
    qk = torch.randn(1, M, H + 3, D, generator=g).to(dtype)[:, :, :H]  # a view: rows (H + 3) D apart
    cos, sin = (torch.randn(1, M, 1, D, generator=g).to(dtype) for _ in range(2))

    def run(rows: slice):
        return (native.rms_norm(x[rows], w, 1e-5), *native.add_rms_norm(x[rows], res[rows], w, 1e-5),
                native.silu_and_mul(gu[rows]), native.rope(qk[:, rows], cos[:, rows], sin[:, rows])[0])

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = run(slice(None))
        torch.set_num_threads(3)
        split = run(slice(None))
    finally:
        torch.set_num_threads(threads)
    for whole, alone_thread in zip(split, one_thread, strict=True):
        assert torch.equal(whole, alone_thread)
    for m in (0, 137, M - 1):
        for whole, alone in zip(split, run(slice(m, m + 1)), strict=True):
            assert torch.equal(whole[m : m + 1], alone), f"row {m} differs from its 1-row call"


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_write_kv_stores_strided_rows_in_their_slots_like_index_put(dtype):
    from minillm.kernels.select import torch_write_kv

    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(6, 4, 3, 8, generator=g).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    proj = torch.randn(5, 2 * 3 * 8 + 8, generator=g).to(dtype)  # new rows as views of a wider projection
    k, v = proj[:, : 3 * 8].view(5, 3, 8), proj[:, 3 * 8 : 6 * 8].view(5, 3, 8)
    slots = torch.tensor([0, 7, 8, 23, 13])
    native.write_kv(*caches, k, v, slots)
    torch_write_kv(*want, k, v, slots)
    torch.testing.assert_close(caches, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_paged_attention_reads_a_strided_query_view_without_copying_it(dtype):
    from minillm.kernels.reference import paged_decode_attention_ref

    g = torch.Generator().manual_seed(1)
    kc, vc = (torch.randn(8, 4, 2, 16, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(3, 1, 10 * 16, generator=g).to(dtype)[:, 0, : 6 * 16].view(3, 6, 16)  # rows 160 apart
    tables = torch.tensor([[0, 3, 5], [1, 2, 0], [7, 6, 4]], dtype=torch.int32)
    lens = torch.tensor([9, 5, 12], dtype=torch.int32)
    # the kernel accumulates in fp32 and rounds once: compare with the fp32 reference rounded to the dtype
    want = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, lens, scale=0.25).to(dtype)
    torch.testing.assert_close(native.paged_decode_attention(q, kc, vc, tables, lens, 0.25), want)
