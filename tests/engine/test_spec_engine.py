"""Speculative decoding in LLMEngine: the same greedy tokens as plain decoding with every proposer, drafts rolled
back out of the paged cache, stop rules applied per committed token, metrics, and bad configs refused."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
from minillm.config import SpeculativeConfig
from minillm.kernels.cpu import decode
from minillm.models.loader import build_model
from minillm.spec.proposer import Proposal, Proposer

V = 320


def tiny(layers: int, heads: int, kv_heads: int, vocab: int = V, seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16 * heads, intermediate_size=160, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      rms_norm_eps=1e-5)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


@pytest.fixture(scope="module", params=[(3, 6, 2), (2, 4, 1)], ids=["gqa-3-layers", "mqa-2-layers"])
def model(request):
    return tiny(*request.param)


@pytest.fixture(scope="module")
def workload():
    """Mixed prompts; half repeat a short pattern so prompt lookup finds matches."""
    rng = random.Random(0)
    prompts = []
    for i in range(8):
        if i % 2:
            pattern = [rng.randrange(V) for _ in range(rng.randint(2, 5))]
            prompts.append((pattern * 10)[: rng.randint(8, 30)])
        else:
            prompts.append([rng.randrange(V) for _ in range(rng.randint(3, 30))])
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True) for _ in prompts]
    return prompts, params


def engine(model, spec=None, **kw) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(**{"block_size": 4, "speculative_config": spec, **kw}))


def assert_all_free(eng: LLMEngine) -> None:
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.device.num_used == 0 and eng.block_manager.stats().logical_tokens == 0


SPECS = {
    "ngram": dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3),
    "early_exit": dict(method="early_exit", num_layers=1, num_speculative_tokens=4),
    "quantized": dict(method="quantized", num_speculative_tokens=3),  # the target's int4 twin drafts
    "draft-other": "other",  # a different random model with the same vocabulary
    "draft-self": "self",  # the target drafting for itself: every draft is accepted
}


def spec_for(name, model):
    s = SPECS[name]
    if s == "other":
        return dict(model=tiny(2, 4, 2, seed=5), num_speculative_tokens=2)
    if s == "self":
        return dict(method="draft", model=model, num_speculative_tokens=5)
    return s


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_output_is_identical_with_and_without_speculation(model, workload, name):
    prompts, params = workload
    plain = engine(model).generate(prompts, params)
    eng = engine(model, spec_for(name, model), max_num_seqs=4)  # continuous batching: requests join and leave
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in plain]
    assert_all_free(eng)
    stats = eng.spec_stats
    assert stats.verify_steps > 0 and stats.draft_tokens > 0
    if name == "draft-self":
        assert stats.acceptance_rate == 1.0
        assert all(o.metrics.acceptance_rate in (None, 1.0) for o in outs)


def test_every_step_leaves_slots_only_for_committed_tokens(model, workload):
    """After each step a running sequence's slots cover exactly its fed tokens: rejected drafts are gone."""
    prompts, params = workload
    eng = engine(model, SPECS["early_exit"])
    for p, sp in zip(prompts, params, strict=True):
        eng.add_request(p, sp)
    bm = eng.block_manager
    while eng.has_unfinished_requests():
        eng.step()
        for seq in eng.scheduler.running:
            if len(seq.output):  # decoding: every token but the last sampled one has its K/V written
                assert bm.num_tokens(seq.seq_id) == seq.num_computed == seq.num_tokens - 1
                assert len(bm.block_table(seq.seq_id)) == -(-(seq.num_tokens - 1) // 4)
    assert eng.spec_stats.draft_tokens > eng.spec_stats.accepted_tokens  # some drafts were rolled back
    assert_all_free(eng)


class WrongProposer(Proposer):
    """Proposes tokens the target never picks greedily (its argmax + 1): every draft is rejected."""

    def __init__(self, model):
        self.model = model

    def propose(self, seqs, k, target_kv=None):
        out = []
        for s, ki in zip(seqs, k, strict=True):
            ids = torch.tensor([s.token_ids])
            nxt = int(self.model(ids, torch.arange(ids.shape[1])[None])[0, -1].argmax())
            out.append([(nxt + 1) % V] * ki)
        return Proposal(out, [None] * len(out))


def test_rejected_drafts_free_their_blocks_and_output_is_unchanged(model, workload):
    prompts, params = workload
    plain = engine(model).generate(prompts, params)
    eng = engine(model, SPECS["ngram"])
    eng.speculator.proposer = WrongProposer(model)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert eng.spec_stats.accepted_tokens == 0 and eng.spec_stats.draft_tokens > 0
    assert_all_free(eng)


def test_max_tokens_and_eos_cut_a_fully_accepted_run(model):
    prompt = [5, 6, 7, 8, 9]
    plain = engine(model).generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    eos = plain.token_ids[6]  # a token the model emits mid-run: generation must end right there
    spec = dict(method="draft", model=model, num_speculative_tokens=5)
    for max_tokens in (1, 2, 7, 13):
        out = engine(model, spec).generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                    ignore_eos=True))[0]
        assert out.token_ids == plain.token_ids[:max_tokens] and out.finish_reason == "length"
    eng = LLMEngine(model, config=EngineConfig(block_size=4, speculative_config=spec), eos_token_ids=[eos])
    out = eng.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0]
    first = plain.token_ids.index(eos)
    assert out.token_ids == plain.token_ids[: first + 1] and out.finish_reason == "stop"
    assert_all_free(eng)


def test_streamed_tokens_equal_the_generated_ones(model, workload):
    prompts, params = workload
    eng = engine(model, SPECS["ngram"])
    got: dict[str, list[int]] = {}
    rids = []
    for p, sp in zip(prompts, params, strict=True):
        rids.append(eng.add_request(p, sp))
    while eng.has_unfinished_requests():
        for u in eng.step():
            got.setdefault(u.request_id, []).extend(u.token_ids)
    outs = [eng.pop_output(r) for r in rids]
    assert [got[r] for r in rids] == [o.token_ids for o in outs]


def test_seeded_sampling_with_speculation_is_reproducible_and_n_samples_all_run(model):
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=3, n=3, ignore_eos=True)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    spec = dict(model=tiny(2, 4, 2, seed=5), num_speculative_tokens=3)
    runs = [engine(model, spec).generate([prompt], params)[0] for _ in range(2)]
    assert [o.token_ids for o in runs[0].outputs] == [o.token_ids for o in runs[1].outputs]
    assert all(len(o.token_ids) == 12 for o in runs[0].outputs)


def test_bad_speculative_configs_raise_value_errors_naming_the_fix(model):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="needs num_layers"):
        SpeculativeConfig(method="early_exit")
    with pytest.raises(ValueError, match="out of range"):
        engine(model, dict(method="early_exit", num_layers=model.config.num_layers))
    with pytest.raises(ValueError, match="vocabulary"):
        engine(model, dict(model=tiny(2, 4, 2, vocab=V + 8)))


def test_speculation_respects_the_steps_token_budget(model):
    """Drafts only use what the step's token budget leaves after the decodes and prefills."""
    eng = engine(model, dict(method="draft", model=model, num_speculative_tokens=3), max_num_seqs=4,
                 max_num_batched_tokens=6)
    prepare, widths = eng.runner.prepare, []

    def recording(out):
        packed = prepare(out)
        widths.append(packed.input_ids.shape[1])
        return packed

    eng.runner.prepare = recording
    eng.generate([[1, 2, 1, 2, 1, 2]] * 4, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert max(widths) <= 6 and eng.spec_stats.draft_tokens > 0
    assert_all_free(eng)


def test_ngram_on_the_default_model_gives_the_same_greedy_text(default_model):
    tok_prompt = [1, 504, 2272, 314, 260, 2272, 30, 504, 2272, 314, 260, 2272, 30, 504]  # a repeating passage
    params = SamplingParams(max_tokens=12, temperature=0)
    plain = LLMEngine(default_model).generate([tok_prompt], params)[0]
    eng = LLMEngine(default_model, config=EngineConfig(speculative_config={"method": "ngram",
                                                                           "num_speculative_tokens": 4}))
    out = eng.generate([tok_prompt], params)[0]
    assert out.token_ids == plain.token_ids
    assert eng.spec_stats.accepted_tokens > 0


NEEDS_FUSED_DRAFTER = pytest.mark.skipif(
    not decode.available(), reason="reading the target's K/V is the fused drafter's path (native library not built "
                                   "here: no C compiler); the per-sequence drafter recomputes its context instead")


@NEEDS_FUSED_DRAFTER
def test_self_drafters_read_the_targets_kv_and_a_separate_draft_model_does_not(model):
    for name, shares in (("quantized", True), ("early_exit", True), ("draft-other", False), ("ngram", False)):
        proposer = engine(model, spec_for(name, model)).speculator.proposer
        assert getattr(proposer, "reads_target_kv", False) is shares, name


@NEEDS_FUSED_DRAFTER
def test_the_target_drafting_for_itself_from_the_targets_kv_has_every_draft_accepted(model, workload):
    """A drafter that IS the target and reads the target's committed K/V proposes exactly the target's greedy tokens."""
    from minillm.spec.draft import DraftModelProposer

    prompts, params = workload
    plain = engine(model).generate(prompts, params)
    eng = engine(model, dict(method="draft", model=model, num_speculative_tokens=4), max_num_seqs=4)
    eng.speculator.proposer = DraftModelProposer(model, 256, reads_target_kv=True)
    assert eng.speculator.proposer.reads_target_kv  # the fused drafter runs it: the copy path is the one tested
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert eng.spec_stats.draft_tokens > 0 and eng.spec_stats.acceptance_rate == 1.0
    assert_all_free(eng)


def test_steps_without_a_proposal_count_as_one_token_per_target_call(model):
    """No earlier n-gram in a prompt of distinct tokens: the first steps decode plainly and are counted as skipped;
    tokens per call covers them, and the timed parts of the speculative steps add up within the step."""
    prompt = list(range(10, 40))
    eng = engine(model, dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2))
    out = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    st = eng.spec_stats
    assert st.skipped_steps > 0
    assert st.tokens_per_call == pytest.approx((st.emitted_tokens + st.skipped_steps)
                                               / (st.verify_steps + st.skipped_steps))
    assert st.emitted_tokens + st.skipped_steps <= len(out.token_ids) - 1  # the first token came from the prefill
    assert st.spec_steps == st.verify_steps > 0  # batch 1: one sequence-step per speculative engine step
    assert 0 < st.draft_s and 0 < st.verify_s and st.draft_s + st.verify_s <= st.step_s
    assert st.per_step_ms()["overhead_ms"] >= 0
