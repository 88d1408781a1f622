"""Causal prefill attention over query tiles (``kernels/cpu/prefill.py``) against ``grouped_attention``: alone at
chunk shapes (no prefix, a prefix, GQA/MQA/MHA, one query, tiles that do not divide the chunk) and inside a packed
engine step with several sequences' chunks."""

from __future__ import annotations

import pytest
import torch

from minillm import ModelConfig
from minillm.kernels import select
from minillm.kernels.cpu import prefill
from minillm.kernels.cpu.prefill import tiled_prefill_attention
from minillm.kernels.reference import grouped_attention
from minillm.kv.paged_cache import AttentionMetadata, PagedAttention, PagedKVCache, PrefillChunk


@pytest.mark.parametrize("L, prefix", [(37, 0), (37, 20), (1, 30), (64, 5), (8, 0), (200, 333)])
@pytest.mark.parametrize("hq, hkv", [(9, 3), (4, 1), (2, 2)])
@pytest.mark.parametrize("tile", [8, 64])
def test_tiles_give_causal_attention_with_the_queries_at_the_end_of_the_keys(L, prefix, hq, hkv, tile):
    g = torch.Generator().manual_seed(L * 1000 + prefix)
    q = torch.randn(1, hq, L, 16, generator=g)
    k, v = (torch.randn(1, hkv, prefix + L, 16, generator=g) for _ in range(2))
    got = tiled_prefill_attention(q, k, v, causal=True, sm_scale=0.3, tile=tile)
    torch.testing.assert_close(got, grouped_attention(q, k, v, causal=True, scale=0.3), atol=2e-6, rtol=1e-5)


def test_bf16_tiles_equal_one_sdpa_call_within_bf16_rounding():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 9, 150, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 3, 182, 64, generator=g).bfloat16() for _ in range(2))
    want = grouped_attention(q.float(), k.float(), v.float(), causal=True)
    got = tiled_prefill_attention(q, k, v, causal=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_non_causal_attention_sees_every_key():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 6, 20, 8, generator=g), *(torch.randn(1, 2, 30, 8, generator=g) for _ in range(2))
    got = tiled_prefill_attention(q, k, v, causal=False, tile=4)
    torch.testing.assert_close(got, grouped_attention(q, k, v), atol=2e-6, rtol=1e-5)


def test_auto_and_native_run_the_tiles_on_cpu_and_torch_keeps_sdpa():
    for dtype in select.NATIVE_DTYPES:
        if select.native.available():
            assert select.ops_for("auto", "cpu", dtype).prefill_attention is tiled_prefill_attention
        assert select.ops_for("torch", "cpu", dtype).prefill_attention is not tiled_prefill_attention
    assert select.resolve("auto", "prefill_attention", "cpu", torch.float16).impl == "torch"


def test_a_packed_step_with_several_chunks_equals_the_reference(monkeypatch):
    """One step of 3 sequences: a fresh chunk, a chunk after 10 cached positions, and a 1-token chunk after 5;
    tiles of 4 rows so every chunk but the last spans several."""
    monkeypatch.setattr(prefill, "PREFILL_TILE", 4)
    cfg = ModelConfig(vocab_size=97, hidden_size=96, intermediate_size=64, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5)
    block = 4
    chunks = [(0, 11, 0), (11, 18, 10), (18, 19, 5)]  # (start, end, cached positions before the chunk)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(chunks))]
    slots, prefills = [], []
    for (start, end, before), table in zip(chunks, tables, strict=True):
        n = before + end - start
        slots += [table[p // block] * block + p % block for p in range(before, n)]
        prefills.append(PrefillChunk(start, end, n, torch.tensor(table[: -(-n // block)])))
    meta = AttentionMetadata(torch.tensor(slots), torch.zeros(0, dtype=torch.long),
                             torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), prefills)
    g = torch.Generator().manual_seed(0)
    T = chunks[-1][1]
    q = torch.randn(1, 6, T, 16, generator=g)
    k, v = (torch.randn(1, 2, T, 16, generator=g) for _ in range(2))
    context = [torch.randn(2, 24 * block, 2, 16, generator=g) for _ in range(2)]  # earlier positions' K/V
    outs = []
    for choice in ("native", "torch"):
        if choice == "native" and not select.native.available():
            pytest.skip("the native kernels did not build here")
        kv = PagedKVCache(cfg, 24, block, dtype=torch.float32, device="cpu")
        kv.k.view(2, -1, 2, 16).copy_(context[0])
        kv.v.view(2, -1, 2, 16).copy_(context[1])
        ops = select.ops_for(choice, "cpu", torch.float32)
        with torch.inference_mode():
            outs.append(PagedAttention(kv, meta, ops).attention(1, q, k, v, 0.25))
    # the reference by hand: each chunk's queries over its sequence's cached keys then its own, causally
    for (start, end, before), table in zip(chunks, tables, strict=True):
        slot_ids = [table[p // block] * block + p % block for p in range(before)]
        kk = torch.cat([context[0][1, slot_ids].transpose(0, 1)[None], k[:, :, start:end]], dim=2)
        vv = torch.cat([context[1][1, slot_ids].transpose(0, 1)[None], v[:, :, start:end]], dim=2)
        want = grouped_attention(q[:, :, start:end], kk, vv, causal=True, scale=0.25)
        for out in outs:
            torch.testing.assert_close(out[:, :, start:end], want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("tile", [0, -3, 2.5, True])
def test_a_tile_that_is_not_a_positive_int_is_refused(tile):
    q, k = torch.randn(1, 9, 100, 64), torch.randn(1, 3, 120, 64)
    with pytest.raises(ValueError, match="tile must be an int >= 1"):
        tiled_prefill_attention(q, k, k, tile=tile)


def test_causal_tiles_refuse_more_queries_than_keys():
    q, k = torch.randn(1, 9, 130, 64), torch.randn(1, 3, 120, 64)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        tiled_prefill_attention(q, k, k)
