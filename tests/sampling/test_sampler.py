"""Sampling: exact top-k / top-p sets, seeded reproducibility, and parameter validation."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig, SamplingParams
from minillm.engine.simple import generate
from minillm.models.loader import build_model
from minillm.sampling import sampler
from minillm.sampling.sampler import (
    TOP_P_CANDIDATES,
    filter_top_k_top_p,
    probabilities,
    sample,
    sample_from,
    top_k_mask,
    top_k_top_p_mask,
    top_p_mask,
)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 2.5, 0.0]])
    kept = top_k_mask(logits, 3).isfinite()[0].tolist()
    assert kept == [False, True, False, True, True, False]


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05])
    logits = probs.log()[None]
    # sorted: 0.5, 0.3 (sum 0.8), 0.1 (0.9), ...; p=0.75 keeps {0.5, 0.3}; p=0.85 also needs 0.1
    # (exactly p=0.8 is a float-rounding coin toss, so the test stays clear of it)
    assert top_p_mask(logits, 0.75).isfinite()[0].tolist() == [False, True, False, True, False]
    assert top_p_mask(logits, 0.85).isfinite()[0].tolist() == [False, True, True, True, False]
    assert top_p_mask(logits, 0.5).isfinite()[0].tolist() == [False, True, False, False, False]
    assert top_p_mask(logits, 0.01).isfinite()[0].tolist() == [False, True, False, False, False]


def test_top_k_then_top_p_renormalise():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0]).log()
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
    # top-3 of (1,2,3,4)/10 -> (2,3,4)/9; nucleus 0.6: 4/9 = .44 < .6, + 3/9 -> keep {3, 4} -> (3/7, 4/7)
    torch.testing.assert_close(p, torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]))


def _vocab_rows(V=49152, seed=0):
    """Rows shaped like an LLM's logits at several temperatures: peaked (a small nucleus) to flat (a nucleus past
    the candidates), one with many ties (logits on a 0.25 grid), one with -inf entries (a grammar's mask)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(V, generator=g) * 2 + torch.linspace(8, 0, V)[torch.randperm(V, generator=g)]
    rows = {f"T={t}": base / t for t in (0.3, 1.0, 3.0, 30.0)}
    rows["ties"] = (base * 4).round() / 4
    masked = base.clone()
    masked[torch.randperm(V, generator=g)[: V - 700]] = float("-inf")
    rows["masked"] = masked
    return rows


def _assert_same_kept_set(got, expected, row, k, p):
    """The kept sets equal, except tokens at the nucleus boundary: where the exact (float64) mass before a token is
    within rounding of p, an fp32 cumulative sum over thousands of probabilities may fall either side of p (the
    candidates' sum and the whole row's sum round differently).  Kept logits are unchanged in both."""
    kept_got, kept_exp = got.isfinite(), expected.isfinite()
    assert torch.equal(got[kept_got], row[kept_got])
    differ = (kept_got ^ kept_exp).nonzero().flatten()
    if differ.numel() == 0:
        return
    assert k == 0, f"top-k on: kept {kept_got.sum()} tokens, the whole-row sort {kept_exp.sum()}"
    x = row.double()
    order = x.sort(descending=True, stable=True).indices
    probs = x.softmax(0)[order]
    mass_before = torch.empty_like(probs).scatter_(0, order, probs.cumsum(0) - probs)
    assert (mass_before[differ] - p).abs().max() < 1e-4, (
        f"kept {kept_got.sum()} vs {kept_exp.sum()}: tokens {differ.tolist()[:5]} differ away from the boundary")


@pytest.mark.parametrize("k,p", [(0, 0.5), (0, 0.9), (0, 0.95), (0, 0.999), (40, 1.0), (40, 0.9), (1, 0.9),
                                 (5000, 0.95), (20000, 0.8)])
def test_candidate_filter_keeps_what_the_whole_row_sort_keeps(k, p):
    rows = _vocab_rows()
    for row in rows.values():
        _assert_same_kept_set(filter_top_k_top_p(row, k, p), top_k_top_p_mask(row, k, p), row, k, p)
    batch = torch.stack(list(rows.values()))
    for got, expected, row in zip(filter_top_k_top_p(batch, k, p), top_k_top_p_mask(batch, k, p), batch, strict=True):
        _assert_same_kept_set(got, expected, row, k, p)
    peaked = rows["T=0.3"]  # a small nucleus: no boundary ambiguity, the same set exactly
    assert torch.equal(filter_top_k_top_p(peaked, k, p), top_k_top_p_mask(peaked, k, p))


def test_candidate_filter_sorts_only_the_candidates_unless_the_nucleus_reaches_past_them(monkeypatch):
    sizes = []

    def recording(logits, k, p):
        sizes.append(logits.shape[-1])
        return top_k_top_p_mask(logits, k, p)

    monkeypatch.setattr(sampler, "top_k_top_p_mask", recording)
    rows = _vocab_rows()
    filter_top_k_top_p(rows["T=0.3"], 0, 0.9)  # peaked: the nucleus is among the first candidates
    filter_top_k_top_p(rows["T=0.3"], 40, 0.9)  # top-k on: its k are the candidates
    assert sizes[0] <= 2 * TOP_P_CANDIDATES[0] and sizes[1] == 40
    sizes.clear()
    filter_top_k_top_p(rows["T=1.0"], 0, 0.95)  # broader: past the first size, within the second
    assert TOP_P_CANDIDATES[0] < sizes[0] <= 2 * TOP_P_CANDIDATES[1]
    sizes.clear()
    filter_top_k_top_p(rows["T=3.0"], 0, 0.9)  # flat: no candidate size holds p, the row is sorted whole
    assert sizes == [49152]
    sizes.clear()
    filter_top_k_top_p(torch.randn(1000), 0, 0.9)  # a small vocabulary: sorted whole
    assert sizes == [1000]


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(1, 4)
    params = SamplingParams(temperature=0.7, top_k=3)
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample(logits, [params], [g])[0] for _ in range(3000)])
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    torch.testing.assert_close(freq, probabilities(logits[0], params), atol=0.03, rtol=0)
    assert freq[0] == 0  # removed by top-k


def test_sample_from_follows_the_weights_and_never_draws_a_zero_weight():
    from minillm.course.checks.speculative import _chi_square_failure

    weights = torch.tensor([0.5, 0.0, 2.0, 1.0, 0.0, 0.25, 1e-3, 0.0])  # unnormalised, zeros inside and at the end
    g = torch.Generator().manual_seed(3)
    draws = [sample_from(weights, g) for _ in range(20000)]
    counts = [draws.count(i) for i in range(len(weights))]
    assert counts[1] == counts[4] == counts[7] == 0
    assert _chi_square_failure(counts, (weights / weights.sum()).tolist()) is None
    again = torch.Generator().manual_seed(3)
    assert [sample_from(weights, again) for _ in range(50)] == draws[:50]  # the generator alone decides


def test_sample_from_refuses_weights_it_cannot_draw_from():
    for bad in (torch.zeros(4), torch.tensor([0.5, -0.1, 0.6]), torch.ones(2, 3), torch.empty(0)):
        with pytest.raises(ValueError, match="non-negative weights with a positive sum"):
            sample_from(bad)


def test_sample_from_a_uniform_point_rounded_up_to_the_total_takes_the_last_weighted_index(monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert sample_from(torch.tensor([0.2, 0.0, 0.5, 0.0])) == 2


def test_a_seeded_row_draws_the_same_token_alone_or_filtered_with_others():
    logits = torch.randn(5, 4096, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, top_p=0.9, seed=2), SamplingParams(temperature=1.3, top_k=50, seed=3),
              SamplingParams(temperature=0.8, top_p=0.9, seed=4)]

    def gens():
        return [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]

    together = [sample(logits, params, gens()) for _ in range(3)]
    alone = [[sample(logits[i:i + 1], [params[i]], [g])[0] for i, g in enumerate(gens())] for _ in range(3)]
    assert together[0] == alone[0] and together[0][1] == int(logits[1].argmax())
    generators = gens()
    rows = [sample(logits, params, generators) for _ in range(20)]  # the generators advance: new draws
    assert len({tuple(r) for r in rows}) > 1


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(tiny):
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=20, temperature=1.0, seed=99, ignore_eos=True)
    alone = generate(tiny, [[1, 2, 3]], seeded)[0].output
    again = generate(tiny, [[1, 2, 3]], seeded)[0].output
    in_batch = generate(tiny, [[5, 6], [1, 2, 3]], [other, seeded])[1].output
    assert alone == again == in_batch
    assert generate(tiny, [[1, 2, 3]], other)[0].output != alone


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"seed": -1}, "seed"), ({"stop": [""]}, "stop"), ({"n": 0}, "n"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_sampling_values_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="\n").stop == ("\n",)


native_sampler = pytest.mark.skipif(not __import__("minillm.kernels.cpu.native", fromlist=["available"]).available(),
                                    reason="native CPU kernels unavailable (no compiler)")


def _reference_draw(row, params, u):
    """The reference's token for ``row`` with uniform ``u``, and the target's distance to the nearest boundary of
    its cumulative sum (where an fp32-normalised and an unnormalised sum may round to different sides)."""
    from minillm.sampling.sampler import _cumulative, _draw

    q = probabilities(row, params)
    c = _cumulative(q)
    i = _draw(q, c, u)
    target = float(u * c[-1])
    edges = [float(c[i]) - target] + ([target - float(c[i - 1])] if i else [])
    return i, min(abs(e) for e in edges)


@native_sampler
@pytest.mark.parametrize("V", [7, 256, 257, 5000, 49152, 128256])
def test_native_temperature_rows_draw_the_reference_s_token_from_the_same_uniform(V):
    """``kernels.cpu.native.sample_temperature`` against the reference (softmax, float64 cumulative sum, search): the
    same token for the same uniform, unless the target lies within rounding of a boundary between two tokens."""
    from minillm.kernels.cpu import native

    g = torch.Generator().manual_seed(V)
    logits = torch.randn(12, V, generator=g) * 4
    logits[3] = 0.0  # a flat row
    logits[4, V // 2] = 60.0  # one token takes all the mass
    temps = [0.05, 0.3, 0.7, 1.0, 1.0, 1.5, 2.0, 1.0, 0.9, 1.2, 0.5, 1.0]
    u = torch.rand(12, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2 ** -53  # the ends of [0, 1)
    rows = list(range(12))[::-1]  # any order of rows, each with its own temperature and uniform
    got = native.sample_temperature(logits, rows, [temps[r] for r in rows], u[rows])
    for r, token in zip(rows, got, strict=True):
        expected, margin = _reference_draw(logits[r], SamplingParams(temperature=temps[r]), u[r])
        assert token == expected or margin < 1e-6, (r, token, expected, margin)
    assert got[rows.index(4)] == V // 2
    for bad in (([0], [0.0]), ([12], [1.0]), ([0, 1], [1.0])):  # a zero temperature, a row past B, lengths differ
        with pytest.raises(ValueError, match="finite temperatures > 0"):
            native.sample_temperature(logits, bad[0], bad[1], u[: len(bad[0])])


@native_sampler
def test_sample_takes_plain_temperature_rows_natively_and_leaves_the_rest_to_the_reference(monkeypatch):
    """Plain-temperature rows go to the native sampler, filtered ones and rows with a -inf logit (a grammar mask) to
    the reference, each with the uniform its own generator gives in row order; with the native sampler off every
    row takes the reference, drawing the same tokens (no row of this batch lies near a boundary)."""
    from minillm.kernels.cpu import native

    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(5)) * 3
    logits[2, 100:] = float("-inf")
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, top_p=0.9, seed=2),
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0), SamplingParams(temperature=1.3),
              SamplingParams(temperature=0.8, min_p=0.1, seed=4)]

    def gens():
        return [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]

    calls = []
    real = native.sample_temperature
    monkeypatch.setattr(native, "sample_temperature", lambda x, rows, *a: calls.append(rows) or real(x, rows, *a))
    torch.manual_seed(7)  # row 4 is unseeded: the global generator
    fast = sample(logits, params, gens())
    assert calls == [[0, 2, 4]]  # plain temperature; row 2's -inf sends it back (the kernel answers -1)
    monkeypatch.setattr(native, "available", lambda: False)
    torch.manual_seed(7)
    assert sample(logits, params, gens()) == fast
    assert fast[3] == int(logits[3].argmax()) and fast[2] < 100


@native_sampler
def test_native_temperature_sampling_follows_the_softmax():
    from minillm.course.checks.speculative import _chi_square_failure

    logits = torch.tensor([[1.2, 0.3, 2.0, -0.5, 1.9, 0.0, 2.0, -2.0, 0.8, 1.0]])
    params = SamplingParams(temperature=0.7, seed=11)
    g = torch.Generator().manual_seed(11)
    draws = sample(logits.expand(4000, -1).contiguous(), [params] * 4000, [g] * 4000)
    counts = [draws.count(t) for t in range(10)]
    assert _chi_square_failure(counts, probabilities(logits[0], params).tolist()) is None
