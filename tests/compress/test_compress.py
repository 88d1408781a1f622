"""Pruning, early exit and distillation at tiny sizes: the masks have the promised patterns, pruning and exiting
early cost perplexity while k = all layers and sparsity 0 cost nothing, and distillation lowers the KL it trains on."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig
from minillm.compress.distill import distill, drop_layers, kl_loss
from minillm.compress.early_exit import exit_model, exit_perplexities
from minillm.compress.prune import magnitude_mask, prune_model, sparsity_of, two_four_mask
from minillm.models.loader import build_model
from minillm.perf.perplexity import perplexity

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)


def tiny():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_hf(CFG), LlamaForCausalLM(CFG).state_dict(), dtype=torch.float32,
                       device="cpu")


def text(n=400, seed=1):
    """A learnable sequence: a repeating pattern with noise, so that the model's layers matter."""
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(n) * 7 % 64
    return torch.where(torch.rand(n, generator=g) < 0.1, torch.randint(0, 64, (n,), generator=g), base)


def test_two_four_keeps_the_two_largest_of_every_four():
    w = torch.tensor([[1.0, -5.0, 3.0, 0.5, 2.0, 2.5, -0.1, 9.0]])
    assert two_four_mask(w).tolist() == [[False, True, True, False, False, True, False, True]]


def test_magnitude_mask_drops_the_smallest_share_of_each_row():
    w = torch.randn(5, 40)
    mask = magnitude_mask(w, 0.25)
    assert (mask.sum(1) == 30).all()
    assert (w.abs()[~mask].reshape(5, 10).max(1).values <= w.abs()[mask].reshape(5, 30).min(1).values).all()


def test_pruned_copy_has_the_requested_sparsity_and_leaves_the_model_whole():
    model = tiny()
    assert sparsity_of(prune_model(model, "magnitude", 0.5)) == pytest.approx(0.5, abs=0.01)
    assert sparsity_of(prune_model(model, "2:4")) == pytest.approx(0.5)
    assert sparsity_of(model) == 0.0
    with pytest.raises(ValueError, match="method"):
        prune_model(model, "random")


def test_zero_sparsity_changes_nothing_and_heavy_pruning_changes_the_logits():
    model, ids = tiny(), torch.randint(0, 64, (1, 12))
    pos = torch.arange(12)[None]
    with torch.inference_mode():
        torch.testing.assert_close(prune_model(model, "magnitude", 0.0)(ids, pos), model(ids, pos))
        assert not torch.allclose(prune_model(model, "magnitude", 0.9)(ids, pos), model(ids, pos))


def test_exit_after_every_layer_is_the_full_model_and_earlier_exits_differ():
    model, ids = tiny(), text()
    full = perplexity(model, ids, window=64, stride=32)
    ppl = exit_perplexities(model, ids, [1, 4], window=64, stride=32)
    assert ppl[4].ppl == pytest.approx(full.ppl)
    assert ppl[1].ppl != pytest.approx(full.ppl)
    with pytest.raises(ValueError, match="exit layer"):
        exit_model(model, 0)


def test_dropping_layers_leaves_the_teacher_and_shrinks_the_copy():
    model = tiny()
    student = drop_layers(model, [1, 2])
    assert len(student.model.layers) == 2 and student.config.num_layers == 2 and len(model.model.layers) == 4
    with pytest.raises(ValueError, match="drop"):
        drop_layers(model, [0, 1, 2, 3])


def test_kl_is_zero_for_equal_logits_and_positive_otherwise():
    a = torch.randn(3, 5, 64)
    assert float(kl_loss(a, a)) == pytest.approx(0.0, abs=1e-6)
    assert float(kl_loss(a, torch.randn(3, 5, 64))) > 0


def test_distillation_lowers_the_students_kl_to_the_teacher_and_freezes_nothing_it_should_not():
    teacher = tiny()
    student = drop_layers(teacher, [1, 2])
    ids = text(600)
    emb = student.model.embed_tokens.weight.clone()
    window, pos = ids[:64][None], torch.arange(64)[None]
    with torch.inference_mode():
        before = float(kl_loss(student(window, pos), teacher(window, pos)))
    losses = distill(student, teacher, ids, steps=40, batch=2, seq_len=32, lr=3e-3)
    with torch.inference_mode():
        after = float(kl_loss(student(window, pos), teacher(window, pos)))
    assert after < 0.8 * before and len(losses) == 40
    assert torch.equal(student.model.embed_tokens.weight, emb)  # embeddings (tied to the LM head) stay frozen
    assert not any(p.requires_grad for p in student.parameters())
