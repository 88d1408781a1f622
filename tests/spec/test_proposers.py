"""Proposers on their own: prompt lookup's matching rule, early exit sharing the target's weights, and the
draft proposer's K/V rollback (its proposals equal a cache-less recompute after drafts are rejected)."""

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig, SamplingParams
from minillm.kernels.cpu import decode
from minillm.models.loader import build_model
from minillm.spec.draft import LONG_FEED, DraftModelProposer
from minillm.spec.early_exit import EarlyExitModel
from minillm.spec.ngram import NgramProposer, ngram_lookup

NEEDS_FUSED = pytest.mark.skipif(not decode.available(), reason="the fused drafter runs on the native decode library, "
                                 "which did not build here (no C compiler): drafts take the per-sequence path")


def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    tokens = [1, 2, 3, 9, 9, 2, 3, 4, 5, 7, 2, 3]
    assert ngram_lookup(tokens, 2, 1, 2) == [4, 5]  # "2 3" last seen before "4 5" (the most recent copy)
    assert ngram_lookup(tokens, 5, 1, 2) == [4, 5, 7, 2, 3]
    assert ngram_lookup([1, 2, 3, 4], 3, 1, 3) == []  # the last token never occurred before
    assert ngram_lookup([5, 1, 8, 1], 3, 2, 3) == []  # only a 1-gram matches, below prompt_lookup_min
    assert ngram_lookup([5, 1, 8, 1], 3, 1, 3) == [8, 1]


def test_ngram_proposer_caps_each_sequence_at_its_k():
    seqs = [SimpleNamespace(token_ids=[1, 2, 3, 1, 2]), SimpleNamespace(token_ids=[4, 4, 4])]
    p = NgramProposer(1, 3).propose(seqs, [1, 0])
    assert p.tokens == [[3], []] and p.probs == [None, None]


def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


def test_early_exit_runs_the_targets_first_layers_without_copying_weights():
    model = tiny()
    ee = EarlyExitModel(model, 2)
    ids, pos = torch.tensor([[3, 4, 5]]), torch.arange(3)[None]
    truncated = copy.deepcopy(model)  # the reference: a whole model whose stack is the first 2 layers
    truncated.model.layers = truncated.model.layers[:2]
    torch.testing.assert_close(ee(ids, pos), truncated(ids, pos))
    assert ee.config.num_layers == 2 and ee.compute_logits.__self__.target is model  # shares, does not copy


class FakeSeq(SimpleNamespace):
    """What a proposer reads of a ``Sequence``; hashed by identity like it (the drafter keys caches by weakref)."""

    __hash__ = object.__hash__


def fake_seq(tokens):
    request = SimpleNamespace(params=SamplingParams(max_tokens=40, temperature=0), generators=[None])
    return FakeSeq(token_ids=list(tokens), num_prompt_tokens=len(tokens), request=request, generator=None,
                   num_tokens=len(tokens))


def greedy_continuation(model, tokens, k):
    out = list(tokens)
    for _ in range(k):
        out.append(int(model(torch.tensor([out]), torch.arange(len(out))[None])[0, -1].argmax()))
    return out[len(tokens):]


def test_draft_proposals_after_a_rollback_equal_a_fresh_recompute():
    model = tiny()
    proposer = DraftModelProposer(model, 128)
    seq = fake_seq([7, 8, 9, 10])
    first = proposer.propose([seq], [4]).tokens[0]
    assert first == greedy_continuation(model, seq.token_ids, 4)
    seq.token_ids += [first[0], (first[1] + 1) % 96]  # one draft accepted, then the target disagreed
    seq.num_tokens = len(seq.token_ids)
    again = proposer.propose([seq], [3]).tokens[0]
    assert again == greedy_continuation(model, seq.token_ids, 3)  # stale draft K/V was not reused


# ---- the fused drafter (one native call per draft position for every sequence) against the per-sequence path ----
def default_like(layers=3, vocab=512, seed=0):
    """SmolLM2's head shape (9 query heads, 3 KV heads, head_dim 64, hidden 576, tied) at a few layers."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256, rms_norm_eps=1e-5,
                      tie_word_embeddings=True)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=torch.float32,
                       device="cpu")


def int4_twin(model):
    from minillm.quant.apply import quantize_model

    return quantize_model(copy.deepcopy(model), "int4")


def prompts_of(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in lengths]


def sampled_seq(tokens, seed):
    request = SimpleNamespace(params=SamplingParams(max_tokens=40, temperature=0.8, top_k=50, top_p=0.9))
    return FakeSeq(token_ids=list(tokens), num_prompt_tokens=len(tokens), request=request,
                   generator=torch.Generator().manual_seed(seed), num_tokens=len(tokens))


@NEEDS_FUSED
def test_fused_drafter_runs_the_quantized_twin_and_declines_what_it_cannot_run():
    model = default_like()
    assert DraftModelProposer(int4_twin(model), 128).fused is not None
    reference = copy.deepcopy(model).set_kernels("torch")  # no native code: the per-sequence path
    assert DraftModelProposer(reference, 128).fused is None
    with pytest.raises(ValueError, match="kernels are 'torch'"):
        DraftModelProposer(reference, 128, fused=True)


@NEEDS_FUSED
def test_early_exit_drafts_on_the_fused_step_over_the_targets_first_layers():
    model = default_like(layers=3, vocab=256)
    proposer = DraftModelProposer(EarlyExitModel(model, 2), 128)
    assert proposer.fused is not None
    view = proposer.fused.model
    assert len(view.model.layers) == 2 and view.model.layers[1] is model.model.layers[1]  # shared, not copied
    assert not any(p is q for p in view.parameters() for q in model.model.layers[2].parameters())
    truncated = copy.deepcopy(model)
    truncated.model.layers = truncated.model.layers[:2]
    seqs = [fake_seq(p) for p in prompts_of([6, 18], 256, seed=2)]
    tokens = proposer.propose(seqs, [3, 2]).tokens
    assert tokens == [greedy_continuation(truncated, s.token_ids, k) for s, k in zip(seqs, [3, 2], strict=True)]
    model.set_kernels("torch")  # the view follows the target's kernel choice
    assert view.kernels == "torch"


@NEEDS_FUSED
@pytest.mark.parametrize("weights,lengths", [("fp32", [5, 70, 11]), ("int4", [3, 70, 4])])
def test_fused_drafts_equal_per_sequence_drafts_through_rejections_at_batch_three(weights, lengths):
    """Each round accepts a different prefix of each sequence's drafts and appends a correction, so the pool rolls
    back and catches up one or two rows per sequence; the 70-token prompts take the prefill catch-up.  int4 prompt
    lengths keep every call on the int8-activation side in both paths: the fused step quantizes activations to int8
    at any row count, the per-layer path only up to quant.MAX_ROWS = 8 rows (an 11-row catch-up runs exact), and
    that rounding alone flips a random model's near-tied argmax."""
    assert max(lengths) > LONG_FEED >= sorted(lengths)[1]
    draft = default_like() if weights == "fp32" else int4_twin(default_like())
    fused, plain = DraftModelProposer(draft, 128), DraftModelProposer(draft, 128, fused=False)
    assert fused.fused is not None and plain.fused is None
    a = [fake_seq(p) for p in prompts_of(lengths, 512)]
    b = [fake_seq(p) for p in prompts_of(lengths, 512)]
    for rnd in range(5):
        ks = [4, 3, 4] if rnd % 2 else [2, 4, 1]
        got, want = fused.propose(a, ks).tokens, plain.propose(b, ks).tokens
        assert got == want and [len(t) for t in got] == ks
        for i, (sa, sb, d) in enumerate(zip(a, b, got, strict=True)):
            accepted = (rnd + i) % (len(d) + 1)  # 0 .. all drafts kept
            extra = d[:accepted] + [(d[accepted] + 1) % 512 if accepted < len(d) else 7]
            for s in (sa, sb):
                s.token_ids += extra
                s.num_tokens = len(s.token_ids)
    assert fused.fused.runner.calls > 0
    for s in a:  # the pool holds exactly the committed tokens plus all drafts but the last
        sid = fused.fused._ids[s]
        assert fused.fused.held[sid] == fused.fused.blocks.sequence(sid).token_ids


@NEEDS_FUSED
def test_fused_greedy_drafts_equal_the_models_own_greedy_continuation_after_the_pool_grows():
    model = default_like(layers=2, vocab=256)
    proposer = DraftModelProposer(model, 128)
    proposer.fused = type(proposer.fused)(model, 128, block_size=4, num_blocks=2)  # 8 slots: must grow at once
    seqs = [fake_seq(p) for p in prompts_of([9, 3, 70], 256, seed=4)]
    tokens = proposer.propose(seqs, [3, 5, 2]).tokens
    assert tokens == [greedy_continuation(model, s.token_ids, k) for s, k in zip(seqs, [3, 5, 2], strict=True)]
    assert proposer.fused.blocks.device.num_blocks > 2


@NEEDS_FUSED
def test_release_and_garbage_collection_free_the_fused_drafters_blocks():
    import gc

    proposer = DraftModelProposer(default_like(layers=2, vocab=256), 128)
    seqs = [fake_seq(p) for p in prompts_of([6, 70], 256)]
    proposer.propose(seqs, [3, 3])
    pool = proposer.fused
    assert pool.blocks.device.num_used > 0
    proposer.release(seqs[0])
    used = pool.blocks.device.num_used
    assert used == len(pool.blocks.block_table(pool._ids[seqs[1]]))
    del seqs[1]
    gc.collect()
    pool.sweep()  # what the next propose runs first: sequences that died without a release
    assert pool.blocks.device.num_used == 0 and not pool.held


def test_fused_sampled_drafts_and_their_distributions_equal_the_per_sequence_ones():
    """fp32 weights: the two paths prefill the prompts through different attention kernels (paged decode rows vs the
    prefill kernel), which agree to the last bits only; int8 activations (the int4 drafter's) would round such a
    last-bit difference to a whole step where a value sits on a rounding boundary, moving a probability by ~1e-2 —
    a kernel difference, not a fused-pool one (the fused step's own bit-for-bit agreement with the per-layer int4 path
    is tests/kernels/test_fused_decode.py's)."""
    draft = default_like()
    fused, plain = DraftModelProposer(draft, 128), DraftModelProposer(draft, 128, fused=False)
    prompts = prompts_of([3, 4], 512, seed=9)
    a = [sampled_seq(p, 100 + i) for i, p in enumerate(prompts)]
    b = [sampled_seq(p, 100 + i) for i, p in enumerate(prompts)]
    got, want = fused.propose(a, [4, 2]), plain.propose(b, [4, 2])
    assert got.tokens == want.tokens
    for q, r in zip(got.probs, want.probs, strict=True):
        assert q.shape == r.shape
        torch.testing.assert_close(q, r, atol=1e-5, rtol=1e-4)  # attention kernels: fp32 summation order


@NEEDS_FUSED
@pytest.mark.parametrize("lengths", [[9], [4, 70, 13]], ids=["batch-1", "batch-3"])
def test_quantized_self_speculation_on_the_fused_drafter_gives_plain_greedy_output(lengths):
    from minillm import EngineConfig, LLMEngine

    model = default_like(layers=3, vocab=512)
    prompts = prompts_of(lengths, 512, seed=3)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = LLMEngine(model, config=EngineConfig(block_size=16)).generate(prompts, params)
    spec = {"method": "quantized", "num_speculative_tokens": 3}
    eng = LLMEngine(model, config=EngineConfig(block_size=16, speculative_config=spec))
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    drafter = eng.speculator.proposer.fused
    assert drafter is not None and drafter.runner.calls > 0 and eng.spec_stats.draft_tokens > 0
    drafter.sweep()  # requests that finished in a plain step (no draft committed) are freed here
    assert drafter.blocks.device.num_used == 0 and not drafter.held


@NEEDS_FUSED
def test_a_batch_one_verify_pass_runs_on_the_fused_step_not_the_packed_forward():
    """max_num_seqs=1 and γ=3: the target's fused runner takes the 4 verify rows, so after the prompt's prefill no
    step packs a forward for the per-layer path."""
    from minillm import EngineConfig, LLMEngine

    model = default_like(layers=2, vocab=256)
    spec = {"method": "quantized", "num_speculative_tokens": 3}
    eng = LLMEngine(model, config=EngineConfig(block_size=16, max_num_seqs=1, speculative_config=spec))
    prepare, packed = eng.runner.prepare, []

    def recording(out):
        packed.append(out.num_tokens)
        return prepare(out)

    eng.runner.prepare = recording
    eng.generate([prompts_of([12], 256)[0]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert eng.spec_stats.verify_steps > 0 and packed == [12]


# ---- self-drafters read the committed context's K/V from the target's cache ----------------------------------------
def target_pool(model, seq_id, tokens, block_size=4):
    """A target-side paged cache with random K/V for ``tokens`` of ``seq_id`` (what its prefill would have written)."""
    from minillm.kv.block_manager import BlockManager
    from minillm.kv.paged_cache import PagedKVCache
    from minillm.spec.proposer import TargetKV

    kv = PagedKVCache(model.config, 32, block_size, dtype=torch.float32, device="cpu")
    kv.k.normal_(generator=torch.Generator().manual_seed(1))
    kv.v.normal_(generator=torch.Generator().manual_seed(2))
    bm = BlockManager(32, block_size, enable_prefix_caching=False)
    bm.allocate(seq_id, tokens)
    return TargetKV(kv, bm)


@NEEDS_FUSED
def test_a_self_drafter_copies_the_committed_context_from_the_target_and_feeds_only_the_last_token():
    model = default_like(layers=2, vocab=256)
    proposer = DraftModelProposer(int4_twin(model), 128, reads_target_kv=True)
    seq = fake_seq(prompts_of([21], 256, seed=6)[0])
    seq.seq_id = "7"
    target = target_pool(model, "7", seq.token_ids)
    pool, fed = proposer.fused, []
    logits = pool.runner.logits

    def recording(batch):
        fed.append(len(batch))
        return logits(batch)

    pool.runner.logits = recording
    drafts = proposer.propose([seq], [3], target).tokens[0]
    assert len(drafts) == 3 and fed == [1, 1, 1]  # the last token, then one row per further draft: no prefill
    sid = pool._ids[seq]
    mine = pool.blocks.slot_mapping(sid, 0, 20)
    theirs = target.block_manager.slot_mapping("7", 0, 20)
    for a, b in ((pool.kv.k, target.kv.k), (pool.kv.v, target.kv.v)):
        assert torch.equal(a.flatten(1, 2)[:, mine], b[: a.shape[0]].flatten(1, 2)[:, theirs])
    # the next round: two committed tokens more (an accepted draft + the correction); the first is copied again
    seq.token_ids += [drafts[0], (drafts[1] + 1) % 256]
    target.block_manager.append_slots("7", seq.token_ids[21:])
    fed.clear()
    proposer.propose([seq], [2], target)
    assert fed == [1, 1]


def test_a_drafter_without_reads_target_kv_ignores_the_targets_cache():
    model = default_like(layers=2, vocab=256)
    proposer = DraftModelProposer(model, 128)
    seq = fake_seq(prompts_of([9], 256, seed=8)[0])
    seq.seq_id = "3"
    drafts = proposer.propose([seq], [3], target_pool(model, "3", seq.token_ids)).tokens[0]
    assert not proposer.reads_target_kv
    assert drafts == greedy_continuation(model, seq.token_ids, 3)  # its own K/V: the random target pool unused
