"""More wrong answers for exercises 0.2 (the roofline), 0.3 (the read-bandwidth probe), 2.3 (attention over the
cache) and 3.3 (pooling K/V heads) than ``test_checks.WRONG`` holds: each mistake a student plausibly makes fails
its checker with an AssertionError that points at it; the stub, a delegating answer and the solution behave as
grading needs; and the library paths these exercises fence behave as before."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

from minillm.course.checks import EXERCISES
from minillm.course.checks.registry import LibrarySolutionCalled
from minillm.kernels.reference import sdpa_attention
from minillm.kv.contiguous import KVCache

# Copies of the solutions, made outside any check: the library's own are hidden while a checker runs.
attainable_flops = EXERCISES["0.2"].answer()
cached_attention = EXERCISES["2.3"].answer()
pool_kv_weight = EXERCISES["3.3"].answer()


# --- 0.2: the roofline over sequences ---------------------------------------------------------------------------
def _roofline_as_array(spec, intensity, dtype):
    """Right values, but a numpy array back for a sequence instead of the list the contract names."""
    if hasattr(intensity, "__len__"):
        return np.minimum(spec.peak(dtype), np.asarray(intensity, dtype=float) * spec.memory_bandwidth)
    return attainable_flops(spec, intensity, dtype)


def _roofline_sorted(spec, intensity, dtype):
    """Sorts the intensities first (as for a plot's x axis): the values come back in the wrong order."""
    if hasattr(intensity, "__len__"):
        return attainable_flops(spec, sorted(float(i) for i in intensity), dtype)
    return attainable_flops(spec, intensity, dtype)


def _roofline_without_validation(spec, intensity, dtype):
    """Never raises: a negative intensity gives a negative FLOP/s."""
    many = hasattr(intensity, "__len__") and getattr(intensity, "ndim", 1) > 0
    values = [min(spec.peak(dtype), float(i) * spec.memory_bandwidth) for i in (intensity if many else [intensity])]
    return values if many else values[0]


def _roofline_fixed_dtype(spec, intensity, dtype):
    """Always the bf16 peak (or fp16 where there is none): wrong for fp32 and the made-up laptop."""
    half = "bfloat16" if "bfloat16" in spec.peak_flops else next(iter(spec.peak_flops))
    return attainable_flops(spec, intensity, half)


@pytest.mark.parametrize("wrong, message", [
    (_roofline_as_array, r"expected a list of 7 floats"),
    (_roofline_sorted, r"in order"),
    (_roofline_without_validation, r"ValueError naming the intensity"),
    (_roofline_fixed_dtype, r"expected .* FLOP/s"),
])
def test_attainable_flops_checker_catches_each_mistake(wrong, message, capsys):
    with pytest.raises(AssertionError, match=message):
        EXERCISES["0.2"].check(wrong)
    assert "passed" not in capsys.readouterr().out


# --- 0.3: the read-bandwidth probe -------------------------------------------------------------------------------
def _probe(buffer, *, repeats=5, reduce=torch.sum, warmup=True, per_pass=min, nbytes=None, scale=1.0,
           validate=True):
    """A configurable probe: each keyword turns one mistake on."""
    if validate and (repeats < 1 or buffer.numel() == 0):
        raise ValueError("bad argument")
    if warmup:
        reduce(buffer)
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        reduce(buffer)
        times.append(time.perf_counter() - t0)
    size = buffer.nbytes if nbytes is None else nbytes(buffer)
    return scale * size / per_pass(times)


@pytest.mark.parametrize("mistake, message", [
    ({"warmup": False}, r"called reduce 5 times, expected 6: one untimed warm-up"),
    ({"per_pass": lambda ts: sorted(ts)[len(ts) // 2]}, r"the fastest timed pass"),
    ({"per_pass": max}, r"the fastest timed pass"),
    ({"nbytes": lambda b: b.numel() * 4}, r"nbytes, not elements"),
    ({"scale": 1e-9}, r"expected about"),  # GB/s where bytes/s are asked for
    ({"validate": False}, r"repeats=0\) returned without a ValueError"),
])
def test_read_bandwidth_checker_catches_each_mistake(mistake, message, capsys):
    with pytest.raises(AssertionError, match=message):
        EXERCISES["0.3"].check(lambda buffer, **kw: _probe(buffer, **kw, **mistake))
    assert "passed" not in capsys.readouterr().out


def test_read_bandwidth_checker_catches_a_probe_that_reads_half_the_buffer():
    def half(buffer, *, repeats=5, reduce=torch.sum):
        return _probe(buffer.flatten()[: buffer.numel() // 2], repeats=repeats, reduce=reduce)

    with pytest.raises(AssertionError, match="other than the whole buffer"):
        EXERCISES["0.3"].check(half)


def test_read_bandwidth_checker_passes_a_correct_probe_written_differently(capsys):
    EXERCISES["0.3"].check(_probe)  # the same contract, a different body: no fixed speed is asserted
    assert "✓ Exercise 0.3 passed" in capsys.readouterr().out


def test_read_bandwidth_is_the_roof_measure_device_reads():
    """``measure_device``'s read probe goes through the fenced function (one source of truth)."""
    with EXERCISES["0.3"].hidden(), pytest.raises(LibrarySolutionCalled):
        from minillm.perf.hardware import _plan, _probe_read

        _probe_read("cpu", {**_plan("cpu", quick=True), "read_bytes": 1 << 20})


# --- 2.3: attention over the cache ------------------------------------------------------------------------------
def _last_l_slots(q, k, v, positions, *, scale):
    """Every row's queries taken as the last L slots of the cache: right for one row, wrong for a mixed batch."""
    B, L = positions.shape
    S = k.shape[2]
    return cached_attention(q, k, v, torch.arange(S - L, S).expand(B, L), scale=scale)


def _no_mask(q, k, v, positions, *, scale):
    """Attends to every slot: the future of a chunk and the stale slots of short rows leak in."""
    B, L = positions.shape
    return cached_attention(q, k, v, torch.full((B, L), k.shape[2] - 1), scale=scale)


def _tiled_heads(q, k, v, positions, *, scale):
    """Query head h reads K/V head h % H_kv (tiled) instead of h // G (grouped)."""
    G = q.shape[1] // k.shape[1]
    return cached_attention(q, k.repeat(1, G, 1, 1), v.repeat(1, G, 1, 1), positions, scale=scale)


def _default_scale(q, k, v, positions, *, scale):
    """Ignores the scale given and uses 1/√D."""
    return cached_attention(q, k, v, positions, scale=q.shape[-1] ** -0.5)


def _fp32_out(q, k, v, positions, *, scale):
    """Right values, returned in fp32 whatever q's dtype."""
    return cached_attention(q.float(), k.float(), v.float(), positions, scale=scale)


@pytest.mark.parametrize("wrong, message", [
    (_last_l_slots, r"three rows of different lengths"),
    (_no_mask, r"decode, three rows of different lengths"),
    (_tiled_heads, r"differs from the expected one"),
    (_default_scale, r"chunk of 4 tokens after 5 cached ones"),
    (_fp32_out, r"expected a torch.bfloat16 tensor"),
])
def test_cached_attention_checker_catches_each_mistake(wrong, message, capsys):
    with pytest.raises(AssertionError, match=message):
        EXERCISES["2.3"].check(wrong)
    assert "passed" not in capsys.readouterr().out


def _cache_with_rows_at(positions: list[list[int]], config_kv=(4, 2, 8)):
    from minillm.config import ModelConfig

    Hq, Hkv, D = config_kv
    config = ModelConfig(vocab_size=10, hidden_size=Hq * D, intermediate_size=8, num_layers=1, num_heads=Hq,
                         num_kv_heads=Hkv, head_dim=D, max_position_embeddings=32)
    return KVCache(config, len(positions), 16, dtype=torch.float32, device="cpu", kernels="torch"), config


def test_kv_cache_attends_rows_at_different_positions_through_cached_attention():
    """KVCache's path for chunks at different offsets (the fenced function) equals SDPA under the position mask:
    the behaviour the library had before the fence."""
    g = torch.Generator().manual_seed(0)
    cache, config = _cache_with_rows_at([[0], [0]])
    for positions in (torch.tensor([[0, 1, 2], [0, 1, 2]]), torch.tensor([[3, 4, 5], [3, 4, 5]]),
                      torch.tensor([[6, 7, 8], [9, 10, 11]])):
        B, L = positions.shape
        cache.begin(positions)
        q = torch.randn(B, config.num_heads, L, config.head_dim, generator=g)
        k, v = (torch.randn(B, config.num_kv_heads, L, config.head_dim, generator=g) for _ in range(2))
        got = cache.attention(0, q, k, v, scale=0.25)
        k_all, v_all, mask = cache.k[0][:, :, : cache._used], cache.v[0][:, :, : cache._used], cache._mask
        torch.testing.assert_close(got, sdpa_attention(q, k_all, v_all, mask, scale=0.25))


def test_cached_attention_rejects_mismatched_shapes():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=re.escape("positions [B, L]")):
        cached_attention(q, k, k, torch.tensor([[3]]), scale=1.0)


# --- 3.3: pooling K/V heads --------------------------------------------------------------------------------------
def _pool_only_k(weight, num_heads, num_kv_heads, new_kv_heads, head_dim):
    """Pools K and then takes the first new·D rows of V instead of pooling them."""
    out = pool_kv_weight(weight, num_heads, num_kv_heads, new_kv_heads, head_dim)
    q_rows, kv_rows, new_rows = num_heads * head_dim, num_kv_heads * head_dim, new_kv_heads * head_dim
    v = weight[q_rows + kv_rows : q_rows + kv_rows + new_rows]
    return torch.cat([out[: q_rows + new_rows], v])


def _pool_in_fp32_out(weight, num_heads, num_kv_heads, new_kv_heads, head_dim):
    """Right values, returned in fp32 whatever the weight's dtype."""
    return pool_kv_weight(weight.float(), num_heads, num_kv_heads, new_kv_heads, head_dim)


def _pool_sum(weight, num_heads, num_kv_heads, new_kv_heads, head_dim):
    """Sums the heads of a group instead of averaging them."""
    r = num_kv_heads // new_kv_heads
    out = pool_kv_weight(weight, num_heads, num_kv_heads, new_kv_heads, head_dim)
    q_rows = num_heads * head_dim
    return torch.cat([out[:q_rows], out[q_rows:] * r])


def _pool_no_checks(weight, num_heads, num_kv_heads, new_kv_heads, head_dim):
    """Never raises: 3 of 4 heads silently becomes 1 (integer division)."""
    new = max(1, new_kv_heads)
    while num_kv_heads % new:
        new -= 1
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    try:
        return pool_kv_weight(weight, num_heads, num_kv_heads, new, head_dim)
    except ValueError:
        return weight[: q_rows + 2 * kv_rows]


@pytest.mark.parametrize("wrong, message", [
    (_pool_only_k, r"pooled K/V rows differ"),
    (_pool_in_fp32_out, r"expected a torch.bfloat16 tensor"),
    (_pool_sum, r"pooled K/V rows differ"),
    (_pool_no_checks, r"without a ValueError"),
])
def test_pool_kv_weight_checker_catches_each_mistake(wrong, message, capsys):
    with pytest.raises(AssertionError, match=message):
        EXERCISES["3.3"].check(wrong)
    assert "passed" not in capsys.readouterr().out


def test_pooling_a_model_goes_through_the_pool_it_is_given():
    """``pool_kv_heads(model, h, pool=…)`` calls the function passed in (notebook 03 passes the student's) for
    every layer's fused projection, and pooling copies of heads back recovers the original weights exactly."""
    from minillm.config import ModelConfig
    from minillm.models.attention_variants import pool_kv_heads
    from minillm.models.llama import Transformer

    config = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Transformer(config).eval().requires_grad_(False)
    for param in model.parameters():  # the constructor leaves memory uninitialised (a loader fills it)
        param.normal_(0, 0.02)
    calls = []

    def spy(weight, *args):
        calls.append(args)
        return pool_kv_weight(weight, *args)

    mqa = pool_kv_heads(model, 1, pool=spy)
    assert calls == [(4, 2, 1, 8)] * 2 and mqa.config.num_kv_heads == 1
    w = model.model.layers[0].self_attn.qkv_proj.weight
    q, k, v = w.split([32, 16, 16])
    doubled = torch.cat([q, k.view(2, 8, -1).repeat_interleave(2, 0).flatten(0, 1),
                         v.view(2, 8, -1).repeat_interleave(2, 0).flatten(0, 1)])  # each head twice: MHA
    assert torch.equal(pool_kv_weight(doubled, 4, 4, 2, 8), w)
