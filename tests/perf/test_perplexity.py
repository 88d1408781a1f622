import math

import pytest
import torch

from minillm.perf.perplexity import heldout_documents, heldout_topic_names, perplexity


class Uniform(torch.nn.Module):
    """Equal logits for every token: perplexity is exactly the vocabulary size."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, ids, positions):
        return torch.zeros(*ids.shape, self.vocab)


class Oracle(torch.nn.Module):
    """Knows the next token of a fixed sequence (by position) with near certainty."""

    def __init__(self, seq: torch.Tensor, vocab: int):
        super().__init__()
        self.seq, self.vocab = seq, vocab

    def forward(self, ids, positions):
        logits = torch.full((*ids.shape, self.vocab), -30.0)
        for j in range(ids.shape[1] - 1):
            logits[0, j, ids[0, j + 1]] = 30.0
        return logits


class CountingModel(torch.nn.Module):
    """A tiny random model that records the windows it sees."""

    def __init__(self, vocab: int):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, vocab)
        self.calls: list[tuple[int, int]] = []

    def forward(self, ids, positions):
        self.calls.append((ids.shape[1], int(positions[0, 0])))
        return self.emb(ids)


def test_uniform_logits_give_perplexity_equal_to_vocab_size():
    ids = torch.randint(0, 37, (100,))
    r = perplexity(Uniform(37), ids, window=16, stride=8)
    assert r.ppl == pytest.approx(37, rel=1e-6)
    assert r.num_tokens == 99


def test_every_token_after_the_first_is_scored_once_whatever_the_windows():
    ids = torch.randint(0, 11, (53,))
    for window, stride in [(8, 8), (8, 3), (16, 5), (100, 50), (2, 1)]:
        assert perplexity(Uniform(11), ids, window=window, stride=stride).num_tokens == 52


def test_a_model_that_predicts_the_text_has_perplexity_near_one():
    ids = torch.randint(0, 23, (40,))
    assert perplexity(Oracle(ids, 23), ids, window=10, stride=4).ppl < 1.001


def test_windows_start_at_position_zero_and_keep_the_promised_context():
    model = CountingModel(13)
    perplexity(model, torch.randint(0, 13, (40,)), window=8, stride=3)
    assert all(L <= 8 and p0 == 0 for L, p0 in model.calls)
    assert [L for L, _ in model.calls][1:-1] == [8] * (len(model.calls) - 2)  # full windows: 5 tokens of context


def test_overlapping_windows_give_the_context_and_the_direct_nll():
    vocab, ids = 13, torch.randint(0, 13, (20,))
    model = CountingModel(vocab)
    r = perplexity(model, ids, window=20, stride=5)  # one window covers everything
    direct = torch.nn.functional.cross_entropy(model.emb(ids[None])[0, :-1], ids[1:])
    assert r.nll == pytest.approx(float(direct), rel=1e-5)
    assert math.exp(r.nll) == pytest.approx(r.ppl)


def test_calibration_and_evaluation_documents_are_disjoint_and_cover_the_topics():
    from pydoc_data.topics import topics

    cal, ev = heldout_topic_names("calibration"), heldout_topic_names("evaluation")
    assert cal and ev and not set(cal) & set(ev) and set(cal) | set(ev) == set(topics)
    assert heldout_topic_names("evaluation") == ev  # deterministic
    assert heldout_documents("evaluation") == [topics[n] for n in ev]


def test_rejects_bad_windows_and_splits():
    with pytest.raises(ValueError, match="stride"):
        perplexity(Uniform(5), torch.arange(5), window=4, stride=5)
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(Uniform(5), torch.tensor([1]))
    with pytest.raises(ValueError, match="split"):
        heldout_documents("train")
