"""Triton attention kernels against their PyTorch references (``minillm.kernels.reference``).

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1 before they are imported) at tiny
shapes in fp32/fp16; ``gpu`` tests compare bf16 kernels with SDPA at realistic shapes on CUDA.

Tolerances: fp32 uses ``assert_close``'s defaults.  16-bit outputs are compared the way FlashAttention's own tests
do (``assert_as_accurate``): the kernel's max error against the fp32 answer must be at most twice that of the
16-bit reference (grouped_attention or SDPA) — the defaults (atol 1e-5) would demand more than the final
rounding to 16 bits of a value near 1 allows, for any implementation.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import minillm.kernels as K
from minillm.kernels.reference import (
    attention_partial,
    decode_attention,
    grouped_attention,
    merge_attention_partials,
    paged_decode_attention_ref,
)

CAN_RUN_TRITON = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
triton_only = pytest.mark.skipif(not CAN_RUN_TRITON, reason="needs triton and CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def assert_as_accurate(out, ref_lowp, ref_fp32):
    """16-bit ``out`` is no further from the fp32 answer than twice the 16-bit reference is (+ fp16's atol)."""
    err = (out.float() - ref_fp32).abs().max().item()
    ref_err = (ref_lowp.float() - ref_fp32).abs().max().item()
    assert err <= 2 * ref_err + 1e-5, f"max error {err:.3g} vs the reference's {ref_err:.3g}"


def check(out, ref_fn, *args):
    """Compare ``out`` with ``ref_fn(*args)``: exactly-ish in fp32, by ``assert_as_accurate`` in 16-bit."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref_fn(*args))
    else:
        f32 = [a.float() if a.is_floating_point() else a for a in args]
        assert_as_accurate(out, ref_fn(*args), ref_fn(*f32))


def rand(*shape, dtype=torch.float32, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype=dtype, device=DEV)


def paged_copy(k, v, seq_lens, block_size, seed=0):
    """Scatter contiguous k/v [B, H_kv, S_max, D] into a shuffled paged cache; unused table entries are -1."""
    B, Hkv, S_max, D = k.shape
    max_blocks = -(-S_max // block_size)
    num_blocks = B * max_blocks + 3  # spare blocks full of garbage that must never be read
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: B * max_blocks]
    tables = perm.view(B, max_blocks).to(torch.int32)
    kc = rand(num_blocks, block_size, Hkv, D, dtype=k.dtype, seed=seed + 1) * 100
    vc = rand(num_blocks, block_size, Hkv, D, dtype=k.dtype, seed=seed + 2) * 100
    for b in range(B):
        n = int(seq_lens[b])
        for j in range(-(-n // block_size)):
            t = slice(j * block_size, min((j + 1) * block_size, n))
            blk = int(tables[b, j])
            kc[blk, : t.stop - t.start] = k[b, :, t].transpose(0, 1)  # (n, H_kv, D)
            vc[blk, : t.stop - t.start] = v[b, :, t].transpose(0, 1)
        tables[b, -(-n // block_size):] = -1
    return kc, vc, tables.to(DEV)


# ------------------------------------------------------------------------------------------------ prefill
PREFILL_SHAPES = [  # (L, S): ragged against 16-wide tiles; L < S is chunked prefill against a cached prefix
    (1, 1), (7, 7), (33, 33), (65, 65), (1, 65), (7, 33), (33, 65), (65, 7)]
HEADS = [(2, 2), (6, 2), (3, 1)]  # GQA ratio 1, 3 and MQA (H_kv = 1)


@triton_only
@pytest.mark.parametrize("L,S", PREFILL_SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Hq,Hkv", HEADS)
def test_flash_attention_matches_grouped_attention_fp32(L, S, causal, Hq, Hkv):
    if causal and L > S:
        pytest.skip("causal needs L ≤ S")
    D = 16 if (L + S) % 2 else 32
    q, k, v = rand(1, Hq, L, D, seed=L), rand(1, Hkv, S, D, seed=S), rand(1, Hkv, S, D, seed=S + 1)
    out = K.flash_attention(q, k, v, causal=causal, impl="triton")
    torch.testing.assert_close(out, grouped_attention(q, k, v, causal=causal))


@triton_only
@pytest.mark.parametrize("L,S,causal", [(33, 65, True), (65, 65, True), (7, 33, False)])
@pytest.mark.parametrize("Hq,Hkv", [(6, 2), (3, 1)])
def test_flash_attention_fp16_is_as_accurate_as_the_reference(L, S, causal, Hq, Hkv):
    q, k, v = (rand(1, Hq, L, 32, dtype=torch.float16, seed=1), rand(1, Hkv, S, 32, dtype=torch.float16, seed=2),
               rand(1, Hkv, S, 32, dtype=torch.float16, seed=3))
    out = K.flash_attention(q, k, v, causal=causal, sm_scale=0.3, impl="triton")
    assert out.dtype == torch.float16
    check(out, lambda *a: grouped_attention(*a, causal=causal, scale=0.3), q, k, v)


@triton_only
@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16), (64, 64)])
def test_flash_attention_tile_sizes_do_not_change_the_answer(block_m, block_n):
    from minillm.kernels.triton.flash import flash_attention_triton

    q, k, v = rand(1, 4, 40, 24, seed=0), rand(1, 2, 50, 24, seed=1), rand(1, 2, 50, 24, seed=2)  # D = 24: padded
    out = flash_attention_triton(q, k, v, causal=True, block_m=block_m, block_n=block_n)
    torch.testing.assert_close(out, grouped_attention(q, k, v, causal=True))


@triton_only
def test_flash_attention_reads_strided_inputs_in_place():
    qkv = rand(2, 19, 3, 4, 16, seed=0)  # (B, L, 3, H, D), as a fused QKV projection leaves it
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, L, D) views, not contiguous
    out = K.flash_attention(q, k, v, causal=True, impl="triton")
    torch.testing.assert_close(out, grouped_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True))


# ------------------------------------------------------------------------------------------------ decode
@triton_only
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split_size", [None, 13])  # 13: split edges off the tile grid; all sizes: below
def test_decode_attention_matches_reference_with_mixed_lengths(Hq, Hkv, dtype, split_size):
    from minillm.kernels.triton.decode import decode_attention_triton

    S_max, D = 65, 32
    q, k, v = rand(4, Hq, D, dtype=dtype, seed=0), rand(4, Hkv, S_max, D, dtype=dtype, seed=1), \
        rand(4, Hkv, S_max, D, dtype=dtype, seed=2)
    seq_lens = torch.tensor([1, 65, 17, 40], dtype=torch.int32, device=DEV)  # includes 1 and S_max
    out = decode_attention_triton(q, k, v, seq_lens, split_size=split_size)
    check(out, lambda q, k, v: decode_attention(q, k, v, seq_lens), q, k, v)


@triton_only
def test_decode_attention_ignores_keys_past_seq_len():
    q, k, v = rand(2, 4, 16, seed=0), rand(2, 2, 33, 16, seed=1), rand(2, 2, 33, 16, seed=2)
    seq_lens = torch.tensor([5, 20], device=DEV)
    out = K.decode_attention(q, k, v, seq_lens, impl="triton")
    k[:, :, 20:], v[:, :, 20:] = float("nan"), float("nan")
    k[0, :, 5:], v[0, :, 5:] = 1e4, 1e4
    torch.testing.assert_close(K.decode_attention(q, k, v, seq_lens, impl="triton"), out)


def test_merging_two_partial_softmaxes_split_anywhere_equals_no_split():
    q, k, v = rand(3, 16, seed=0), rand(20, 16, seed=1) * 3, rand(20, 16, seed=2)  # * 3: peaked softmax
    m, den, o = attention_partial(q, k, v)  # (3,), (3,), (3, 16)
    whole = merge_attention_partials(m[:, None], den[:, None], o[:, None])  # one split
    torch.testing.assert_close(whole, torch.softmax(q @ k.T / 4, -1) @ v)
    for p in range(0, 21):  # p = 0 and p = 20 leave one split empty (m = -inf, l = 0)
        (m1, l1, o1), (m2, l2, o2) = attention_partial(q, k[:p], v[:p]), attention_partial(q, k[p:], v[p:])
        merged = merge_attention_partials(torch.stack([m1, m2], -1), torch.stack([l1, l2], -1),
                                          torch.stack([o1, o2], -2))
        torch.testing.assert_close(merged, whole, msg=f"split at {p}")


@triton_only
def test_flash_decoding_gives_the_same_answer_for_every_split_size():
    from minillm.kernels.triton.decode import decode_attention_triton

    q, k, v = rand(2, 3, 16, seed=0), rand(2, 1, 25, 16, seed=1), rand(2, 1, 25, 16, seed=2)
    seq_lens = torch.tensor([25, 19], device=DEV)  # the shorter sequence leaves trailing splits empty
    ref = decode_attention(q, k, v, seq_lens)
    for split_size in range(1, 26):  # 25 splits of one key ... one split of all: split edges land everywhere
        out = decode_attention_triton(q, k, v, seq_lens, split_size=split_size, block_n=16)
        torch.testing.assert_close(out, ref, msg=f"split_size {split_size}")


# ------------------------------------------------------------------------------------------------ paged decode
def test_paged_reference_matches_contiguous_decode():
    k, v, q = rand(3, 2, 37, 16, seed=1), rand(3, 2, 37, 16, seed=2), rand(3, 4, 16, seed=0)
    seq_lens = torch.tensor([37, 1, 20], dtype=torch.int32, device=DEV)
    kc, vc, tables = paged_copy(k, v, seq_lens, block_size=8)
    torch.testing.assert_close(paged_decode_attention_ref(q, kc, vc, tables, seq_lens),
                               decode_attention(q, k, v, seq_lens))


@triton_only
@pytest.mark.parametrize("block_size", [4, 5, 16])  # 5: blocks straddle tiles at odd places
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_decode_matches_reference_with_a_shuffled_block_table(block_size, Hq, Hkv, dtype):
    from minillm.kernels.triton.paged_decode import paged_decode_attention_triton

    S_max, D = 50, 16
    k, v, q = rand(3, Hkv, S_max, D, dtype=dtype, seed=1), rand(3, Hkv, S_max, D, dtype=dtype, seed=2), \
        rand(3, Hq, D, dtype=dtype, seed=0)
    seq_lens = torch.tensor([50, 1, 23], dtype=torch.int32, device=DEV)  # last blocks partially filled
    kc, vc, tables = paged_copy(k, v, seq_lens, block_size, seed=block_size)
    out = paged_decode_attention_triton(q, kc, vc, tables, seq_lens, split_size=16 if block_size == 4 else None)
    check(out, lambda q, k, v: decode_attention(q, k, v, seq_lens), q, k, v)


# ------------------------------------------------------------------------------------------------ dispatch, bad input
@triton_only
def test_public_functions_agree_across_impls():
    q, k, v = rand(1, 4, 9, 16, seed=0), rand(1, 2, 9, 16, seed=1), rand(1, 2, 9, 16, seed=2)
    torch.testing.assert_close(K.flash_attention(q, k, v, impl="triton"), K.flash_attention(q, k, v, impl="torch"))
    seq_lens = torch.tensor([6], dtype=torch.int32, device=DEV)
    qd = q[:, :, 0]
    torch.testing.assert_close(K.decode_attention(qd, k, v, seq_lens, impl="triton"),
                               K.decode_attention(qd, k, v, seq_lens, impl="torch"))
    kc, vc, tables = paged_copy(k, v, seq_lens, block_size=4)
    torch.testing.assert_close(K.paged_decode_attention(qd, kc, vc, tables, seq_lens, impl="triton"),
                               K.paged_decode_attention(qd, kc, vc, tables, seq_lens, impl="torch"))


def test_auto_runs_triton_only_on_cuda():
    assert not K.use_triton("auto", torch.device("cpu"))
    assert not K.use_triton("torch", torch.device("cuda"))
    assert K.use_triton("auto", torch.device("cuda")) == K.triton_available()
    with pytest.raises(ValueError, match="impl must be one of"):
        K.flash_attention(rand(1, 1, 2, 16), rand(1, 1, 2, 16), rand(1, 1, 2, 16), impl="cuda")


def test_forcing_triton_on_cpu_without_the_interpreter_is_a_runtime_error(monkeypatch):
    if not K.triton_available():
        pytest.skip("needs triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(1, 1, 2, 16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.flash_attention(x, x, x, impl="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.decode_attention(x[:, :, 0], x, x, torch.tensor([2]), impl="triton")


def test_kernels_defined_without_the_interpreter_refuse_cpu_tensors_and_import_is_lazy():
    if not K.triton_available():
        pytest.skip("needs triton")
    code = (
        "import sys, torch, minillm, minillm.kernels as K\n"
        "assert 'triton' not in sys.modules, 'importing minillm must not import triton'\n"
        "from minillm.kernels.triton.flash import flash_attention_triton\n"
        "assert callable(K.flash_attention), 'the kernel module must not shadow the public function'\n"
        "x = torch.randn(1, 1, 2, 16)\n"
        "try:\n    flash_attention_triton(x, x, x)\nexcept RuntimeError as e:\n    print('RuntimeError', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "RuntimeError" in res.stdout and "TRITON_INTERPRET=1" in res.stdout


def test_bad_prefill_shapes_are_rejected():
    q, k = rand(1, 4, 3, 16), rand(1, 2, 5, 16)
    with pytest.raises(ValueError, match="disagree on B or D"):
        K.flash_attention(q, rand(1, 2, 5, 32), rand(1, 2, 5, 32))
    with pytest.raises(ValueError, match="multiple of H_kv"):
        K.flash_attention(q, rand(1, 3, 5, 16), rand(1, 3, 5, 16))
    with pytest.raises(ValueError, match="need L ≤ S"):
        K.flash_attention(rand(1, 4, 6, 16), k[:, :, :5], k[:, :, :5], causal=True)
    with pytest.raises(ValueError, match="dtype mismatch"):
        K.flash_attention(q, k.half(), k.half())
    with pytest.raises(ValueError, match=r"need q \[B, H_q, L, D\]"):
        K.flash_attention(q[0], k, k)


def test_bad_decode_inputs_are_rejected():
    q, k = rand(2, 4, 16), rand(2, 2, 8, 16)
    with pytest.raises(ValueError, match="disagree on B or D"):
        K.decode_attention(rand(2, 4, 32), k, k, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="multiple of H_kv"):
        K.decode_attention(rand(2, 3, 16), k, k, torch.tensor([1, 2]))
    for bad in ([0, 3], [9, 3]):
        with pytest.raises(ValueError, match=r"seq_lens must lie in \[1, 8\]"):
            K.decode_attention(q, k, k, torch.tensor(bad))
    with pytest.raises(ValueError, match="seq_lens must be an int32/int64 tensor"):
        K.decode_attention(q, k, k, torch.tensor([1.0, 2.0]))


def test_bad_paged_inputs_are_rejected():
    q, kc = rand(2, 4, 16), rand(6, 4, 2, 16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([5, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        K.paged_decode_attention(q, kc, kc, tables.long(), lens)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        K.paged_decode_attention(q, kc, kc, tables[:1], lens)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        K.paged_decode_attention(q, kc, kc, tables.flatten(), lens)
    with pytest.raises(ValueError, match="head dim mismatch"):
        K.paged_decode_attention(rand(2, 4, 32), kc, kc, tables, lens)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        K.paged_decode_attention(rand(2, 3, 16), kc, kc, tables, lens)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[1, 8\]"):
        K.paged_decode_attention(q, kc, kc, tables, torch.tensor([5, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="outside the cache"):
        K.paged_decode_attention(q, kc, kc, torch.tensor([[0, 1], [2, 6]], dtype=torch.int32), lens)
    # an out-of-range id in a block the sequence does not reach is padding, not an error
    K.paged_decode_attention(q, kc, kc, torch.tensor([[0, -1], [2, 3]], dtype=torch.int32),
                             torch.tensor([4, 8], dtype=torch.int32))


# ------------------------------------------------------------------------------------------------ GPU, realistic
def sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("L,S", [(1000, 1000), (300, 1000)])  # full prefill; a chunk after a 700-token prefix
def test_flash_attention_bf16_matches_sdpa_on_gpu(L, S):
    torch.manual_seed(0)
    q = torch.randn(2, 32, L, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 8, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(L, S, dtype=torch.bool, device="cuda").tril(S - L)
    out = K.flash_attention(q, k, v, causal=True)
    assert_as_accurate(out, sdpa(q, k, v, attn_mask=mask), sdpa(q.float(), k.float(), v.float(), attn_mask=mask))


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_decode_bf16_matches_sdpa_on_gpu(paged):
    torch.manual_seed(0)
    B, S = 4, 8192
    q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, 8, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seq_lens = torch.tensor([8192, 1, 3000, 7777], dtype=torch.int32, device="cuda")
    mask = (torch.arange(S, device="cuda") < seq_lens[:, None])[:, None, None]  # (B, 1, 1, S)
    ref = sdpa(q[:, :, None], k, v, attn_mask=mask)[:, :, 0]
    ref32 = sdpa(q[:, :, None].float(), k.float(), v.float(), attn_mask=mask)[:, :, 0]
    if paged:
        kc, vc, tables = paged_copy(k, v, seq_lens, block_size=16)
        out = K.paged_decode_attention(q, kc, vc, tables, seq_lens)
    else:
        out = K.decode_attention(q, k, v, seq_lens)
    assert_as_accurate(out, ref, ref32)


def test_bench_attention_reports_bandwidth_and_flops_rows():
    from minillm.perf.bench.attention import bench_attention

    rows = bench_attention("cpu", batch_sizes=(1,), seq_lens=(64,), H_q=4, H_kv=2, D=16, verbose=False)
    assert {r["op"] for r in rows} == {"decode", "paged_decode", "prefill"}
    assert all(r["ms"] > 0 and r["GB/s"] > 0 and r["TFLOP/s"] > 0 for r in rows)
    decode = next(r for r in rows if r["op"] == "decode" and r["impl"] == "torch-ref")
    assert decode["speedup_vs_sdpa"] > 0 and decode["S"] == 64 and decode["L"] == 1
