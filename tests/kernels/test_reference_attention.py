"""FlashAttention's online softmax in plain PyTorch: one tile step (``flash_tile_step``) folded over all key tiles,
and flash-decoding's split merge (``merge_attention_partials``), both against softmax attention over all keys."""

from __future__ import annotations

import pytest
import torch

from minillm.kernels.reference import attention_partial, flash_tile_step, grouped_attention, merge_attention_partials


def test_attention_rejects_mismatched_shapes_naming_them():
    q, k = torch.randn(1, 9, 4, 8), torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="H_q % H_kv"):  # 9 query heads cannot share 4 K/V heads
        grouped_attention(q, k, k)
    with pytest.raises(ValueError, match=r"need q \[B, H_q, L, D\]"):
        grouped_attention(q[0], k, k)


def _fold(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int, scale: float) -> torch.Tensor:
    """Softmax attention of q [..., M, D] over k, v [..., N, D], one tile of ``block_n`` keys at a time."""
    m = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    den = torch.zeros_like(m)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32)
    for start in range(0, k.shape[-2], block_n):
        m, den, acc = flash_tile_step(m, den, acc, q, k[..., start : start + block_n, :],
                                      v[..., start : start + block_n, :], scale)
    return acc / den[..., None]


@pytest.mark.parametrize("block_n", [1, 7, 16, 64, 100])
def test_tiles_folded_in_order_equal_softmax_attention_over_all_keys(block_n):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 16, generator=g), torch.randn(2, 3, 64, 16, generator=g), \
        torch.randn(2, 3, 64, 16, generator=g)
    torch.testing.assert_close(_fold(q, k, v, block_n, 0.25), grouped_attention(q, k, v, scale=0.25))


def test_first_step_from_the_empty_state_is_the_partial_of_that_tile():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g))
    state = flash_tile_step(torch.full((4,), float("-inf")), torch.zeros(4), torch.zeros(4, 8), q, k, v, 0.3)
    for got, expected in zip(state, attention_partial(q, k, v, scale=0.3), strict=True):
        torch.testing.assert_close(got, expected)


def test_growing_scores_are_rescaled_without_overflow():
    """Later tiles hold much larger scores (exp of them overflows fp32): the running max must rescale the sums."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 16, generator=g)
    k = torch.randn(48, 16, generator=g) * torch.linspace(0.1, 30, 48)[:, None]  # scores grow tile by tile
    v = torch.randn(48, 16, generator=g)
    out = _fold(q, k, v, 16, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.softmax(q @ k.T, -1) @ v)


def test_gqa_by_viewing_query_groups_as_rows():
    """q [B, H_q, L, D] viewed as [B, H_kv, G·L, D] shares each K/V head with its group, as grouped_attention."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 6, 4, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g), \
        torch.randn(1, 2, 40, 8, generator=g)
    out = _fold(q.reshape(1, 2, 12, 8), k, v, 16, 8**-0.5).view(1, 6, 4, 8)
    torch.testing.assert_close(out, grouped_attention(q, k, v))


def test_merging_split_partials_equals_attention_over_the_union_with_empty_splits():
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 4, 16, generator=g), torch.randn(2, 50, 16, generator=g) * 5, \
        torch.randn(2, 50, 16, generator=g)
    edges = [0, 13, 13, 40, 50]  # the second split is empty (m = -inf, l = 0, o = 0)
    parts = [attention_partial(q, k[:, a:b], v[:, a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)]
    m, den, o = (torch.stack([p[i] for p in parts], dim=-1 if i < 2 else -2) for i in range(3))
    expected = torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v
    torch.testing.assert_close(merge_attention_partials(m, den, o), expected)
