"""Proposers on their own: prompt lookup's matching rule, early exit sharing the target's weights, and the
draft proposer's K/V rollback (its proposals equal a cache-less recompute after drafts are rejected)."""

import copy
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig, SamplingParams
from minillm.models.loader import build_model
from minillm.spec.draft import DraftModelProposer
from minillm.spec.early_exit import EarlyExitModel
from minillm.spec.ngram import NgramProposer, ngram_lookup


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
