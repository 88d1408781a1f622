"""Logprobs through the engine (``SamplingParams(logprobs=k, prompt_logprobs=k)``) against transformers'
``log_softmax`` on the same weights and tokens: prompt and generated, batched and alone, on every runner path
(the default fast runner, eager, speculative decoding), and the stop-token extras end to end."""

import pytest
import torch

from minillm import EngineConfig, LLMEngine, SamplingParams
from minillm.config import SpeculativeConfig

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5, 6,", "Roses are red,"]
ATOL = 1e-3  # the native kernels' fp32 sums run in another order than transformers' (logits agree to ~2e-4)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(default_llm):
    return default_llm.tokenizer


def engine(default_model, tokenizer, **config) -> LLMEngine:
    return LLMEngine(default_model, tokenizer, EngineConfig(num_kv_blocks=256, **config))


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' logprobs [len(ids), V]: row i is the distribution of token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_entry(entry, token: int, ref_row: torch.Tensor, k: int) -> None:
    """One position's ``{token_id: Logprob}`` against transformers' logprobs row."""
    want = ref_row[token].item()
    assert entry[token].logprob == pytest.approx(want, abs=ATOL)
    strictly_above = int((ref_row > want + ATOL).sum()) + 1  # the rank, up to near-ties within the tolerance
    at_or_above = int((ref_row > want - ATOL).sum())
    assert strictly_above <= entry[token].rank <= max(at_or_above, strictly_above)
    top = list(entry)[1:] if len(entry) > k else list(entry)  # the sampled token leads when outside the top k
    top.sort(key=lambda t: entry[t].rank)
    assert len(top) == k
    want = ref_row.topk(k)
    for t, wt, wlp in zip(top, want.indices.tolist(), want.values.tolist(), strict=True):
        assert entry[t].logprob == pytest.approx(wlp, abs=ATOL)
        assert t == wt or abs(ref_row[t].item() - wlp) < ATOL  # a different id only on a near-tie
    assert [entry[t].rank for t in top] == list(range(1, k + 1))


def check_output(out, hf, tokenizer, k_prompt: int | None, k: int | None) -> None:
    ids = out.prompt_token_ids + out.token_ids
    ref = reference(hf, ids)
    p = len(out.prompt_token_ids)
    if k_prompt is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) == p and out.prompt_logprobs[0] is None
        for i in range(1, p):
            check_entry(out.prompt_logprobs[i], ids[i], ref[i - 1], k_prompt)
            assert out.prompt_logprobs[i][ids[i]].decoded_token == tokenizer.decode([ids[i]])
    for sample in out.outputs:
        if k is None:
            assert sample.logprobs is None
            continue
        sids = out.prompt_token_ids + sample.token_ids
        sref = ref if sample.index == 0 else reference(hf, sids)
        assert len(sample.logprobs) == len(sample.token_ids) > 0
        for j, token in enumerate(sample.token_ids):
            check_entry(sample.logprobs[j], token, sref[p - 1 + j], k)


def test_logprobs_equal_transformers_batched_and_alone(default_model, tokenizer, hf):
    e = engine(default_model, tokenizer)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    batched = e.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched, strict=True):
        check_output(out, hf, tokenizer, 2, 3)
        alone = e.generate([prompt], params)[0]
        check_output(alone, hf, tokenizer, 2, 3)
        assert alone.token_ids == out.token_ids


def test_logprobs_are_raw_whatever_the_sampling(default_model, tokenizer, hf):
    """Temperature, top-k, penalties do not change the logprobs (vLLM V1's raw logprobs); n > 1 samples each get
    their own, from their own history; logprobs=0 gives the sampled token alone."""
    e = engine(default_model, tokenizer)
    params = SamplingParams(max_tokens=5, temperature=1.3, top_k=20, seed=3, n=3, logprobs=0, repetition_penalty=1.3,
                            presence_penalty=0.5, ignore_eos=True)
    out = e.generate(["Once upon a time"], params)[0]
    check_output(out, hf, tokenizer, None, 0)
    assert all(len(d) == 1 for s in out.outputs for d in s.logprobs)


def test_prompt_logprobs_skip_prefix_cache_hits_and_chunked_prefill(default_model, tokenizer, hf):
    """A prompt already in the prefix cache is computed again for its logprobs; a prompt split over steps (small
    token budget) gets every position once; a request without prompt_logprobs still hits the cache."""
    e = engine(default_model, tokenizer, max_num_batched_tokens=16, max_num_seqs=4, block_size=4)
    long = "The quick brown fox jumps over the lazy dog. " * 4
    first = e.generate([long], SamplingParams(max_tokens=2, temperature=0))[0]
    assert first.prompt_logprobs is None
    again = e.generate([long], SamplingParams(max_tokens=2, temperature=0))[0]
    assert again.metrics.prefix_hit_tokens > 0
    out = e.generate([long], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))[0]
    assert out.metrics.prefix_hit_tokens == 0
    check_output(out, hf, tokenizer, 1, None)


@pytest.mark.parametrize("config, runner", [
    (dict(enforce_eager=True), "ModelRunner"), (dict(enforce_eager=False), "CudaGraphRunner"),
    (dict(), None), (dict(speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3)), None)],
    ids=["eager", "static-decode", "default (native on CPU)", "ngram-speculation"])
def test_every_runner_path_gives_the_same_logprobs(default_model, tokenizer, hf, config, runner):
    e = engine(default_model, tokenizer, **config)
    assert runner is None or type(e.runner).__name__ == runner
    prompt = "1 2 3 1 2 3 1 2 3 1 2 3"  # repetitive: the n-gram proposer's drafts get accepted
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    out = e.generate([prompt, PROMPTS[0]], params)
    for o in out:
        check_output(o, hf, tokenizer, None, 2)
    if "speculative_config" in config:
        assert e.spec_stats.accepted_tokens > 0  # drafts were verified: their logprobs came from draft rows


def test_streamed_updates_carry_their_tokens_logprobs(default_model, tokenizer):
    e = engine(default_model, tokenizer)
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=1)
    updates = [u for u in e.stream([PROMPTS[0]], params) if u.token_ids]
    final = e.generate([PROMPTS[0]], params)[0]
    assert [d for u in updates for d in u.logprobs] == final.outputs[0].logprobs


def test_stop_token_ids_min_tokens_and_include_stop_str(default_model, tokenizer):
    e = engine(default_model, tokenizer)
    base = e.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop_id = base.token_ids[2]
    out = e.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id]))[0]
    first = base.token_ids.index(stop_id)
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop_id
    assert out.text == tokenizer.decode(base.token_ids[:first])  # the stop token's text is left out ...
    kept = e.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id],
                                                   include_stop_str_in_output=True))[0]
    assert kept.text == tokenizer.decode(base.token_ids[: first + 1])  # ... unless asked for
    # min_tokens: the stop token is masked until min_tokens tokens are out, then stops as before
    late = e.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id],
                                                   min_tokens=first + 2))[0]
    assert len(late.token_ids) >= first + 2 and stop_id not in late.token_ids[: first + 1]
    # a stop string kept in the text
    text = tokenizer.decode(base.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = e.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True))[0]
    assert cut.text == text[: text.index(stop) + len(stop)]


def test_logprobs_beyond_the_vocabulary_and_bad_ids_are_refused(default_model, tokenizer):
    e = engine(default_model, tokenizer)
    for bad, name in ((dict(logprobs=49153), "logprobs"), (dict(logit_bias={49152: 1.0}), "logit_bias"),
                      (dict(stop_token_ids=[10**6]), "stop_token_ids")):
        with pytest.raises(ValueError, match=name):
            e.add_request("hi", SamplingParams(**bad))


def test_requests_with_penalties_run_without_drafts_under_speculation(default_model, tokenizer):
    """The rejection rule samples from ``probabilities`` (temperature, min-p, top-k, top-p); penalties, logit_bias
    and min_tokens depend on the history at each draft position, so such requests decode plainly instead."""
    e = engine(default_model, tokenizer, speculative_config=SpeculativeConfig(method="ngram",
                                                                            num_speculative_tokens=3))
    prompt = "1 2 3 1 2 3 1 2 3 1 2 3"
    plain, penalised = e.generate([prompt, prompt], [
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.5)])
    assert plain.metrics.spec_draft_tokens > 0
    assert penalised.metrics.spec_draft_tokens == 0
    plain_engine = engine(default_model, tokenizer)
    alone = plain_engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                           repetition_penalty=1.5))[0]
    assert penalised.token_ids == alone.token_ids != plain.token_ids


def test_llm_generate_returns_vllm_shaped_logprobs(default_llm):
    from minillm.outputs import Logprob

    out = default_llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, logprobs=5,
                                                          prompt_logprobs=0))[0]
    sample = out.outputs[0]
    assert out.logprobs is sample.logprobs and len(sample.logprobs) == len(sample.token_ids) == 3
    for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
        assert next(iter(entry)) == token and len(entry) == 5  # greedy: the sampled token is the top one
        assert all(isinstance(v, Logprob) for v in entry.values())
        assert entry[token].rank == 1 and entry[token].decoded_token == default_llm.tokenizer.decode([token])
        assert sorted(v.rank for v in entry.values()) == [1, 2, 3, 4, 5]
    assert out.prompt_logprobs[0] is None
    assert [list(d) for d in out.prompt_logprobs[1:]] == [[t] for t in out.prompt_token_ids[1:]]


def test_preempted_requests_score_each_prompt_position_once(default_model, tokenizer):
    """Recompute preemption re-prefills a sequence from position 0: positions already scored get no rows again,
    and the logprobs equal those of a pool large enough that nothing is preempted."""
    prompts = ["The history of the Roman empire is long", "In a distant galaxy far away, there",
               "Once upon a time in the west of"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1, logprobs=1)
    tight = LLMEngine(default_model, tokenizer, EngineConfig(num_kv_blocks=11, block_size=4, max_num_seqs=4,
                                                             max_num_batched_tokens=6))
    small = tight.generate(prompts, params)
    assert tight.stats.preemptions > 0
    for a, b in zip(small, engine(default_model, tokenizer).generate(prompts, params), strict=True):
        assert a.token_ids == b.token_ids and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:] + a.logprobs, b.prompt_logprobs[1:] + b.logprobs, strict=True):
            assert list(x) == list(y)
            assert [v.logprob for v in x.values()] == pytest.approx([v.logprob for v in y.values()], abs=ATOL)
