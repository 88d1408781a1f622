"""The sampling extras (penalties, logit_bias, min_p, min_tokens, stop_token_ids) against plain per-token loops,
their validation, and the raw logprobs helper against ``log_softmax``."""

import math
from types import SimpleNamespace

import pytest
import torch

from minillm.sampling.logprobs import token_logprobs
from minillm.sampling.params import SamplingParams, check_vocab, finish_reason
from minillm.sampling.processors import min_p_mask, process, process_row
from minillm.sampling.sampler import probabilities

V = 12
PROMPT = [1, 2, 2, 5]
OUTPUT = [3, 3, 3, 5, 7]


@pytest.fixture
def logits():
    torch.manual_seed(0)
    return torch.randn(V) * 3


def loop_reference(logits, params, prompt, output, eos=()):
    """vLLM's rules, one token at a time in plain Python."""
    x = [float(v) for v in logits]
    if len(output) < params.min_tokens:
        for t in [*(() if params.ignore_eos else eos), *params.stop_token_ids]:
            x[t] = -math.inf
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    for t in range(V):
        if t in prompt or t in output:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        n = output.count(t)
        x[t] -= params.frequency_penalty * n + params.presence_penalty * (1 if n else 0)
    return torch.tensor(x)


@pytest.mark.parametrize("kw", [dict(presence_penalty=1.5), dict(presence_penalty=-0.7), dict(frequency_penalty=0.9),
                                dict(frequency_penalty=-2.0), dict(repetition_penalty=1.7),
                                dict(repetition_penalty=0.5), dict(logit_bias={0: 5.0, 11: -250.0}),
                                dict(min_tokens=6, stop_token_ids=[4]),
                                dict(presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.2,
                                     logit_bias={3: 2.0})],
                         ids=["presence", "presence-neg", "frequency", "frequency-neg", "repetition",
                              "repetition-below-1", "logit_bias-clamped", "min_tokens", "all"])
def test_each_processor_equals_the_plain_loop(logits, kw):
    params = SamplingParams(**kw)
    assert params.processes_logits
    got = process_row(logits, params, PROMPT, OUTPUT, eos_token_ids=(0,))
    want = loop_reference(logits, params, PROMPT, OUTPUT, eos=(0,))
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, logits)  # it did something


def test_logit_bias_is_clamped_and_min_tokens_masks_eos_and_stop_ids(logits):
    assert SamplingParams(logit_bias={"3": 250}).logit_bias == {3: 100.0}  # JSON keys, clamped to [-100, 100]
    params = SamplingParams(min_tokens=2, stop_token_ids=[4])
    masked = process_row(logits, params, PROMPT, [9], eos_token_ids=(0,))
    assert masked[0] == -math.inf and masked[4] == -math.inf
    free = process_row(logits, params, PROMPT, [9, 9], eos_token_ids=(0,))  # min_tokens reached: nothing masked
    torch.testing.assert_close(free, logits)


def test_batch_processing_touches_only_the_rows_that_ask(logits):
    rows = torch.stack([logits, logits + 1])
    seqs = [SimpleNamespace(token_ids=PROMPT + OUTPUT, num_prompt_tokens=len(PROMPT))] * 2
    plain = [SamplingParams(), SamplingParams()]
    assert process(rows, plain, seqs) is rows  # nobody asked: no copy
    got = process(rows, [SamplingParams(), SamplingParams(frequency_penalty=1.0)], seqs)
    torch.testing.assert_close(got[0], rows[0])
    torch.testing.assert_close(got[1], loop_reference(rows[1], SamplingParams(frequency_penalty=1.0), PROMPT, OUTPUT))


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability(logits):
    probs = logits.softmax(-1)
    kept = min_p_mask(logits, 0.2) > -math.inf
    assert kept.tolist() == [bool(p >= 0.2 * probs.max()) for p in probs]
    # in the sampler it applies after temperature: the distribution is the tempered one, renormalised
    params = SamplingParams(temperature=0.7, min_p=0.1)
    tempered = (logits / 0.7).softmax(-1)
    want = torch.where(tempered >= 0.1 * tempered.max(), tempered, 0)
    torch.testing.assert_close(probabilities(logits, params), want / want.sum())


def test_stop_token_ids_finish_with_stop_but_not_before_min_tokens():
    p = SamplingParams(max_tokens=10, stop_token_ids=[7], min_tokens=3)
    assert finish_reason(p, 7, 2, 10, (), 100) is None  # a stop token before min_tokens (masked in sampling)
    assert finish_reason(p, 7, 3, 10, (), 100) == "stop"
    assert finish_reason(p, 0, 3, 10, (0,), 100) == "stop"
    assert finish_reason(SamplingParams(ignore_eos=True, stop_token_ids=[7]), 7, 1, 5, (7,), 100) == "stop"


@pytest.mark.parametrize("kw, name", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1: math.nan}), "logit_bias"), (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(stop_token_ids="7"), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=1.5), "prompt_logprobs"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output")])
def test_bad_values_raise_naming_the_field(kw, name):
    with pytest.raises(ValueError, match=f"^{name} must"):
        SamplingParams(**kw)


def test_vocab_checks_name_the_field():
    check_vocab(SamplingParams(logit_bias={11: 1.0}, stop_token_ids=[11], logprobs=12), V)
    for kw, name in ((dict(logit_bias={12: 1.0}), "logit_bias"), (dict(stop_token_ids=[12]), "stop_token_ids"),
                     (dict(logprobs=13), "logprobs"), (dict(prompt_logprobs=13), "prompt_logprobs")):
        with pytest.raises(ValueError, match=f"^{name} must"):
            check_vocab(SamplingParams(**kw), V)


def test_token_logprobs_equal_log_softmax_with_rank_and_top_k():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    got = token_logprobs(logits, [4, 0, 9], [0, 3, V])
    lp = torch.log_softmax(logits, -1)
    for i, (entry, token, k) in enumerate(zip(got, [4, 0, 9], [0, 3, V], strict=True)):
        assert entry.token == token
        assert entry.logprob == pytest.approx(lp[i, token].item(), abs=1e-6)
        assert entry.rank == 1 + sorted(lp[i].tolist(), reverse=True).index(lp[i, token].item())
        want = lp[i].topk(k) if k else None
        assert [t for t, _ in entry.top] == ([] if k == 0 else want.indices.tolist())
        assert [v for _, v in entry.top] == pytest.approx([] if k == 0 else want.values.tolist(), abs=1e-6)
    assert token_logprobs(logits[:0], [], []) == []
    with pytest.raises(ValueError, match="logits"):
        token_logprobs(logits, [1], [1])
