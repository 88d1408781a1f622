"""More wrong answers for the attention exercises (3.2, 4.1, 4.2) than ``test_checks.WRONG`` holds: each mistake a
student plausibly makes must fail its checker with a message that points at it."""

from __future__ import annotations

import re

import pytest
import torch

from minillm.course import checks
from minillm.course.checks import EXERCISES
from minillm.course.checks.attention_variants import _largest_new_tensor

# A copy of the solution, made outside any check: the library's own is hidden while a checker runs.
grouped_attention = EXERCISES["3.2"].answer()


def _tiled_heads(q, k, v, mask=None, *, causal=False, scale=None):
    """K/V heads tiled (head h reads h % H_kv) instead of grouped (h // G): wrong pairing of query and K/V heads."""
    G = q.shape[1] // k.shape[1]
    return grouped_attention(q, k.repeat(1, G, 1, 1), v.repeat(1, G, 1, 1), mask, causal=causal, scale=scale)


def _broadcast_matmul(q, k, v, mask=None, *, causal=False, scale=None):
    """Right values by broadcasting over a group axis — but torch.matmul materialises the broadcast K and V."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    s = (q.view(B, Hkv, Hq // Hkv, L, D) @ k[:, :, None].transpose(-1, -2)).float() * scale  # (B, H_kv, G, L, S)
    if causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(S - L), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask[:, :, None], float("-inf"))
    return (s.softmax(-1).to(v.dtype) @ v[:, :, None]).reshape(B, Hq, L, D)


def _causal_without_offset(q, k, v, mask=None, *, causal=False, scale=None):
    """Causal mask anchored at key 0 (tril(0)): right when L = S, wrong for a chunk after a cached prefix."""
    if causal:
        L, S = q.shape[2], k.shape[2]
        tri = torch.ones(L, S, dtype=torch.bool).tril()[None, None]
        mask = tri if mask is None else mask & tri
    return grouped_attention(q, k, v, mask, scale=scale)


@pytest.mark.parametrize("wrong, says", [(_tiled_heads, "h // G"), (_broadcast_matmul, "torch.matmul"),
                                         (_causal_without_offset, re.escape("S − L + i"))])
def test_grouped_attention_mistakes_are_named(wrong, says):
    with pytest.raises(AssertionError, match=says):
        checks.check_grouped_attention(wrong)


def _merge_without_max(m, den, o):
    w = torch.exp(m)  # rescales to a common reference (0), but exp(m) overflows for large scores
    return (w[..., None] * o).sum(-2) / (w * den).sum(-1)[..., None]


def test_merge_that_overflows_is_caught():
    with pytest.raises(AssertionError, match="inf/NaN"):
        checks.check_merge_attention_partials(_merge_without_max)


def _step_without_max(m, den, acc, q, k_tile, v_tile, scale):
    p = torch.exp((q.float() @ k_tile.float().transpose(-1, -2)) * scale)  # no running max: overflows
    return torch.zeros_like(den), den + p.sum(-1), acc + p @ v_tile.float()


def _step_returning_the_output(m, den, acc, q, k_tile, v_tile, scale):
    s = (q.float() @ k_tile.float().transpose(-1, -2)) * scale
    return torch.softmax(s, -1) @ v_tile.float()  # normalised output of this tile only, not the state


@pytest.mark.parametrize("wrong", [_step_without_max, _step_returning_the_output])
def test_flash_tile_step_mistakes_fail(wrong):
    with pytest.raises(AssertionError, match="expected|differs"):
        checks.check_flash_tile_step(wrong)


def test_sdpa_with_enable_gqa_makes_no_copy_on_cpu():
    """The copy detector does not flag a fused kernel that shares K/V heads itself."""
    q, k, v = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 64, 16), torch.randn(2, 2, 64, 16)
    _, nbytes, _ = _largest_new_tensor(torch.nn.functional.scaled_dot_product_attention, q, k, v,
                                              enable_gqa=True)
    assert nbytes < 2 * 8 * 64 * 16 * 4
