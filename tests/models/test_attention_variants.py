"""GQA conversion by pooling and the KV-size calculators."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig
from minillm.models.attention_variants import (
    kv_bytes_cross_layer,
    kv_bytes_gqa,
    kv_bytes_mla,
    kv_bytes_sequence,
    pool_kv_heads,
)
from minillm.models.loader import build_model

CFG = LlamaConfig(vocab_size=200, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=6, max_position_embeddings=128)


@pytest.fixture(scope="module")
def mha():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_hf(CFG), LlamaForCausalLM(CFG).state_dict(), dtype=torch.float32,
                       device="cpu")


def test_pooling_to_h_q_heads_gives_identical_logits(mha):
    same = pool_kv_heads(mha, 6)
    ids = torch.randint(0, 200, (1, 17))
    with torch.no_grad():
        assert torch.equal(same(ids, torch.arange(17)[None]), mha(ids, torch.arange(17)[None]))


def test_pooling_averages_the_heads_of_each_group(mha):
    gqa = pool_kv_heads(mha, 2)
    assert gqa.config.num_kv_heads == 2
    D = mha.config.head_dim
    old_k = mha.model.layers[0].self_attn.qkv_proj.weight[6 * D : 12 * D]
    new_k = gqa.model.layers[0].self_attn.qkv_proj.weight[6 * D : 8 * D]
    torch.testing.assert_close(new_k[:D], old_k[: 3 * D].view(3, D, -1).mean(0))
    with torch.no_grad():  # and it runs: the smaller cache is used by broadcast
        assert gqa(torch.tensor([[1, 2, 3]]), torch.arange(3)[None]).shape == (1, 3, 200)


def test_pooling_rejects_a_head_count_that_does_not_divide(mha):
    with pytest.raises(ValueError, match="must divide"):
        pool_kv_heads(mha, 4)


def test_calculators_reproduce_the_published_kv_cache_figures():
    llama7b = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                          num_kv_heads=32, head_dim=128)
    assert kv_bytes_gqa(llama7b, 32) == 512 * 1024
    assert kv_bytes_gqa(llama7b, 8) == 512 * 1024 / 4
    assert kv_bytes_cross_layer(llama7b, 3) == pytest.approx(512 * 1024 * 11 / 32)
    assert kv_bytes_sequence(llama7b, 10_000, window=1000) * 10 == kv_bytes_sequence(llama7b, 10_000)
    mha_deepseek = 2 * 60 * 128 * 128 * 2  # 60 layers, 128 heads of 128
    assert 50 < mha_deepseek / kv_bytes_mla(60, 512, 64) < 60
