"""Every Triton kernel on a real GPU (``gpu`` marker: skipped without CUDA) at the shapes the models run, in bf16
and fp16, against its PyTorch reference.

Shapes: SmolLM2-135M (H_q 9, H_kv 3, D 64 — a group of 3, not a power of two) and Llama-3.2-1B (H_q 32, H_kv 8,
D 64); the GEMVs at the default model's projections ([576 -> 960] qkv, [576 -> 3072] gate/up, [1536 -> 576] down)
and Llama-3.2-1B's [2048 -> 8192].  Tolerance as in test_triton_kernels.py: the kernel's max error against the
fp32 answer is at most twice the 16-bit reference's (FlashAttention's own test rule).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

HEADS = {"smollm2-135m": (9, 3, 64), "llama-3.2-1b": (32, 8, 64)}
DTYPES = [torch.bfloat16, torch.float16]


def assert_as_accurate(out, ref_lowp, ref_fp32):
    """16-bit ``out`` is no further from the fp32 answer than twice the 16-bit reference is (+ a tiny atol)."""
    err = (out.float() - ref_fp32).abs().max().item()
    ref_err = (ref_lowp.float() - ref_fp32).abs().max().item()
    assert err <= 2 * ref_err + 1e-5, f"max error {err:.3g} vs the reference's {ref_err:.3g}"


def randn(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


def sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", HEADS)
@pytest.mark.parametrize("L,S", [(512, 512), (100, 700), (1, 333)])  # prefill; a chunk after a prefix; one row
def test_flash_attention_matches_sdpa_at_model_shapes(model, dtype, L, S):
    from minillm.kernels.triton.flash import flash_attention_triton

    torch.manual_seed(0)
    Hq, Hkv, D = HEADS[model]
    q = randn(2, Hq, L, D, dtype=dtype)
    k, v = randn(2, Hkv, S, D, dtype=dtype), randn(2, Hkv, S, D, dtype=dtype)
    mask = torch.ones(L, S, dtype=torch.bool, device="cuda").tril(S - L)  # queries at the last L positions
    out = flash_attention_triton(q, k, v, causal=True)
    assert_as_accurate(out, sdpa(q, k, v, attn_mask=mask), sdpa(q.float(), k.float(), v.float(), attn_mask=mask))


def _decode_case(model, dtype, seq_lens):
    torch.manual_seed(0)
    Hq, Hkv, D = HEADS[model]
    B, S = len(seq_lens), max(seq_lens)
    q = randn(B, Hq, D, dtype=dtype)
    k, v = randn(B, Hkv, S, D, dtype=dtype), randn(B, Hkv, S, D, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    mask = (torch.arange(S, device="cuda") < lens[:, None])[:, None, None]  # (B, 1, 1, S)
    ref = sdpa(q[:, :, None], k, v, attn_mask=mask)[:, :, 0]
    ref32 = sdpa(q[:, :, None].float(), k.float(), v.float(), attn_mask=mask)[:, :, 0]
    return q, k, v, lens, ref, ref32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", HEADS)
def test_decode_attention_matches_sdpa_at_model_shapes(model, dtype):
    from minillm.kernels.triton.decode import decode_attention_triton

    q, k, v, lens, ref, ref32 = _decode_case(model, dtype, [1, 17, 300, 2048, 4096])
    assert_as_accurate(decode_attention_triton(q, k, v, lens), ref, ref32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_attention_matches_sdpa_at_model_shapes(model, dtype, block_size):
    from minillm.kernels.triton.paged_decode import paged_decode_attention_triton

    q, k, v, lens, ref, ref32 = _decode_case(model, dtype, [1, 17, 300, 2048, 4096])
    B, Hkv, S, D = k.shape
    width = -(-S // block_size)
    num_blocks = B * width + 5
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[: B * width]
    tables = perm.view(B, width).to(torch.int32).cuda()
    kc = randn(num_blocks, block_size, Hkv, D, dtype=dtype) * 100  # garbage where no sequence's keys are
    vc = randn(num_blocks, block_size, Hkv, D, dtype=dtype) * 100
    for b in range(B):
        n = int(lens[b])
        for j in range(-(-n // block_size)):
            t = slice(j * block_size, min((j + 1) * block_size, n))
            kc[tables[b, j], : t.stop - t.start] = k[b, :, t].transpose(0, 1)
            vc[tables[b, j], : t.stop - t.start] = v[b, :, t].transpose(0, 1)
    assert_as_accurate(paged_decode_attention_triton(q, kc, vc, tables, lens), ref, ref32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("K,N", [(576, 960), (576, 3072), (1536, 576), (2048, 8192)])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_dequant_gemv_matches_the_dequantize_then_matmul_reference(K, N, bits, dtype, rows):
    from minillm.kernels.triton.dequant_gemv import int4_gemv_triton, int8_gemv_triton
    from minillm.quant.weight import int4_linear_ref, int8_linear_ref, quantize_int4, quantize_int8

    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.02
    packed = (quantize_int4(w) if bits == 4 else quantize_int8(w, group_size=64)).to("cuda")
    x = randn(rows, K, dtype=dtype)
    kernel, ref = (int4_gemv_triton, int4_linear_ref) if bits == 4 else (int8_gemv_triton, int8_linear_ref)
    out = kernel(x, packed)
    assert out.shape == (rows, N) and out.dtype == dtype
    assert_as_accurate(out, ref(x, packed), ref(x.float(), packed))
