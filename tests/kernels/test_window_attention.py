"""Paged decode attention under KV eviction (sliding window, attention sinks, H2O's scattered evicted blocks): the
reference against dense attention over only the kept keys; the native and Triton kernels against the reference,
with the table entries of evicted blocks pointing anywhere or ``EVICTED`` (-1, what the engine leaves there)."""

import importlib.util
import os

import pytest
import torch

from minillm.kernels.cpu import native
from minillm.kernels.reference import (
    decode_attention,
    kept_keys,
    paged_attention_with_mass,
    paged_window_attention_ref,
)
from minillm.kv.eviction import ALL_KEYS, EVICTED

CAN_RUN_TRITON = importlib.util.find_spec("triton") is not None and (
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
BS, NUM_BLOCKS, HKV, HQ, D = 4, 48, 2, 6, 16
LENS = [37, 3, 12, 26]  # longer and shorter than the window; a partial last block


def paged_case(window, sinks, seed=0):
    """q [B, H_q, D]; K/V caches whose blocks outside each sequence's kept keys hold garbage (they may be reused by
    another sequence); tables with those entries redirected to block 0 (the engine's placeholder)."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g)
    vc = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=g)
    q = torch.randn(len(LENS), HQ, D, generator=g)
    width = -(-max(LENS) // BS)
    perm = torch.randperm(NUM_BLOCKS - 1, generator=g)[: len(LENS) * width].view(len(LENS), width) + 1
    tables = perm.to(torch.int32).clone()
    for b, n in enumerate(LENS):
        kept = kept_keys(torch.tensor(n - 1), torch.arange(width * BS), window, sinks)
        for i in range(width):
            if not kept[i * BS : (i + 1) * BS].any():
                tables[b, i] = 0  # evicted: its contents belong to nobody here
    return q, kc, vc, tables, torch.tensor(LENS, dtype=torch.int32)


def dense_kept(q, kc, vc, tables, lens, window, sinks):
    """Each sequence's kept keys gathered by position and attended densely: what eviction must compute."""
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = [p for p in range(n) if kept_keys(torch.tensor(n - 1), torch.tensor(p), window, sinks)]
        k = torch.stack([kc[tables[b, p // BS], p % BS] for p in pos]).transpose(0, 1)[None]  # (1, H_kv, S, D)
        v = torch.stack([vc[tables[b, p // BS], p % BS] for p in pos]).transpose(0, 1)[None]
        out.append(decode_attention(q[b : b + 1], k, v, torch.tensor([len(pos)])))
    return torch.cat(out)


CASES = [(8, 0), (8, 3), (5, 4), (100, 0)]  # window, sinks: sliding window, StreamingLLM, sinks mid-block, all


@pytest.mark.parametrize("window,sinks", CASES)
def test_window_reference_equals_dense_attention_over_the_kept_keys(window, sinks):
    q, kc, vc, tables, lens = paged_case(window, sinks)
    got = paged_window_attention_ref(q, kc, vc, tables, lens, None, window, sinks)
    torch.testing.assert_close(got, dense_kept(q, kc, vc, tables, lens, window, sinks))


def test_kept_keys_is_causal_window_plus_sinks():
    kept = kept_keys(torch.arange(10)[:, None], torch.arange(10), window=3, sinks=2)
    assert kept[9].nonzero().flatten().tolist() == [0, 1, 7, 8, 9]
    assert kept[1].nonzero().flatten().tolist() == [0, 1]
    assert kept_keys(torch.arange(10)[:, None], torch.arange(10)).equal(torch.ones(10, 10, dtype=torch.bool).tril())


@pytest.mark.skipif(not native.available(), reason="native kernels did not build")
@pytest.mark.parametrize("window,sinks", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_window_matches_reference(window, sinks, dtype):
    q, kc, vc, tables, lens = paged_case(window, sinks, seed=1)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    got = native.paged_decode_attention(q, kc, vc, tables, lens, D**-0.5, window, sinks)
    want = paged_window_attention_ref(q.float(), kc.float(), vc.float(), tables, lens, None, window, sinks)
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.skipif(not native.available(), reason="native kernels did not build")
def test_native_window_zero_is_the_unwindowed_kernel_bit_for_bit():
    q, kc, vc, tables, lens = paged_case(100, 0, seed=2)
    assert native.paged_decode_attention(q, kc, vc, tables, lens, 0.25).equal(
        native.paged_decode_attention(q, kc, vc, tables, lens, 0.25, 1000, 0))


@pytest.mark.skipif(not CAN_RUN_TRITON, reason="needs triton and CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("window,sinks", [(8, 3), (5, 0)])
def test_triton_window_matches_reference(window, sinks):
    from minillm.kernels.triton.paged_decode import paged_decode_attention_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, kc, vc, tables, lens = (t.to(dev) for t in paged_case(window, sinks, seed=3))
    # 16-key splits: whole tiles of evicted keys inside a split must not turn into NaN
    got = paged_decode_attention_triton(q, kc, vc, tables, lens, split_size=16, window=window, sinks=sinks)
    torch.testing.assert_close(got, paged_window_attention_ref(q, kc, vc, tables, lens, None, window, sinks),
                               atol=1e-4, rtol=1e-4)


def h2o_case(seed=4):
    """``paged_case`` with every key causal (H2O's window) and scattered blocks evicted (entry -1): never the
    last block of a sequence (it holds the query's own key)."""
    q, kc, vc, tables, lens = paged_case(ALL_KEYS, 0, seed)
    g = torch.Generator().manual_seed(seed)
    for b, n in enumerate(LENS):
        last = (n - 1) // BS
        for i in range(last):
            if torch.rand((), generator=g) < 0.4:
                tables[b, i] = EVICTED
    assert (tables == EVICTED).any()
    return q, kc, vc, tables, lens


def dense_held(q, kc, vc, tables, lens):
    """Each sequence's keys in held blocks, attended densely."""
    out = []
    for b, n in enumerate(lens.tolist()):
        pos = [p for p in range(n) if tables[b, p // BS] >= 0]
        k = torch.stack([kc[tables[b, p // BS], p % BS] for p in pos]).transpose(0, 1)[None]  # (1, H_kv, S, D)
        v = torch.stack([vc[tables[b, p // BS], p % BS] for p in pos]).transpose(0, 1)[None]
        out.append(decode_attention(q[b : b + 1], k, v, torch.tensor([len(pos)])))
    return torch.cat(out)


def test_reference_skips_evicted_table_entries_and_reports_the_mass_it_puts_on_each_key():
    q, kc, vc, tables, lens = h2o_case()
    want = dense_held(q, kc, vc, tables, lens)
    torch.testing.assert_close(paged_window_attention_ref(q, kc, vc, tables, lens, None, ALL_KEYS), want)
    out, mass = paged_attention_with_mass(q, kc, vc, tables, lens, None, ALL_KEYS)
    torch.testing.assert_close(out, want)
    held = (tables >= 0).repeat_interleave(BS, 1) & (torch.arange(mass.shape[1]) < lens[:, None])
    assert (mass[~held] == 0).all() and (mass[held] > 0).all()
    torch.testing.assert_close(mass.sum(1), torch.full((len(LENS),), float(HQ)))  # each head's softmax sums to 1


@pytest.mark.skipif(not native.available(), reason="native kernels did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_skips_evicted_table_entries(dtype):
    q, kc, vc, tables, lens = h2o_case(seed=5)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    got = native.paged_decode_attention(q, kc, vc, tables, lens, D**-0.5, ALL_KEYS, 0)
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), dense_held(q.float(), kc.float(), vc.float(), tables, lens), **tol)


@pytest.mark.parametrize("window,sinks", CASES)
def test_window_results_do_not_depend_on_what_evicted_entries_hold(window, sinks):
    """A -1 entry (H2O's placeholder) where a window-evicted block was gives bit-for-bit what block 0 there gives
    (the engine's placeholder under the window: the Triton kernel's input checks refuse negative ids)."""
    q, kc, vc, tables, lens = paged_case(window, sinks, seed=6)
    minus = tables.clone()
    for b, n in enumerate(LENS):
        kept = kept_keys(torch.tensor(n - 1), torch.arange(tables.shape[1] * BS), window, sinks)
        for i in range(tables.shape[1]):
            if not kept[i * BS : (i + 1) * BS].any():
                minus[b, i] = EVICTED
    ref = paged_window_attention_ref
    assert ref(q, kc, vc, minus, lens, None, window, sinks).equal(ref(q, kc, vc, tables, lens, None, window, sinks))
    if native.available():
        assert native.paged_decode_attention(q, kc, vc, minus, lens, 0.25, window, sinks).equal(
            native.paged_decode_attention(q, kc, vc, tables, lens, 0.25, window, sinks))
