"""QuantLinear / QuantEmbedding and the module swap (quant/apply.py) on tiny random models."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minillm import ModelConfig
from minillm.kernels import select
from minillm.kernels.cpu import quant as native_quant
from minillm.kernels.select import ops_for
from minillm.layers.linear import Linear, QuantEmbedding, QuantLinear
from minillm.models.loader import build_model
from minillm.quant.apply import cat_rows, packed_nbytes, quantize_model, quantize_weight
from minillm.quant.weight import Int4Weight, Int8Weight, int4_linear_ref, int8_linear_ref, quantize_int4

TINY = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def tiny_model(tied=True, seed=0, dtype=torch.float32, **overrides):
    cfg = LlamaConfig(**{**TINY, **overrides}, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    return build_model(ModelConfig.from_hf(cfg), hf.state_dict(), dtype=dtype, device="cpu")


def ids_and_positions(L=11, seed=1):
    ids = torch.randint(0, TINY["vocab_size"], (2, L), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(L).expand(2, L)


# -------------------------------------------------------------------------------------------------- the layers
@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_quant_linear_computes_the_reference_w4a16_w8a16_product_with_bias(scheme, kernels):
    w, b = torch.randn(48, 96), torch.randn(48)
    packed = quantize_weight(w, scheme)
    layer = QuantLinear(packed, b)
    ref = int4_linear_ref if scheme == "int4" else int8_linear_ref
    ops = ops_for(kernels, "cpu", torch.float32)
    for rows in (1, 3, 20):  # decode rows (native GEMV) and prefill rows (the int8 block GEMM or the reference's)
        x = torch.randn(rows, 96)
        prefill_int8 = select.int8_prefill_through_int8_activations(packed) and native_quant.block_prefill_supports(
            x, packed)
        if kernels == "auto" and native_quant.available() and (native_quant.supports(x, packed) or prefill_int8):
            # the native kernels round x to int8 blocks first (llama.cpp's scheme): the reference on the rounded
            # activations, up to fp32 rounding over K = 96 (tests/quant/test_kernels_quant.py, test_block_prefill.py)
            torch.testing.assert_close(layer(x, ops), ref(native_quant.q8_activation_ref(x), packed, b),
                                       atol=1e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(layer(x, ops), ref(x, packed, b))


def test_quant_linear_calls_the_op_it_is_given():
    calls = []
    ops = dataclasses.replace(ops_for("torch", "cpu", torch.float32),
                              int4_linear=lambda x, w, b: calls.append(("int4", w)) or x[..., :4],
                              int8_linear=lambda x, w, b: calls.append(("int8", w)) or x[..., :8])
    w4, w8 = quantize_int4(torch.randn(4, 32)), quantize_weight(torch.randn(8, 32), "int8")
    x = torch.randn(1, 32)
    assert QuantLinear(w4)(x, ops).shape == (1, 4) and QuantLinear(w8)(x, ops).shape == (1, 8)
    assert [c[0] for c in calls] == ["int4", "int8"]
    assert calls[0][1].packed is not None and isinstance(calls[1][1], Int8Weight)


def test_quant_linear_keeps_its_packed_dtypes_through_a_model_dtype_change_and_round_trips_its_state_dict():
    w4 = quantize_int4(torch.randn(16, 64))
    layer = QuantLinear(w4, torch.randn(16)).to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and layer.packed.dtype == torch.uint8  # storage format is fixed
    assert layer.bias.dtype == torch.bfloat16  # the bias follows the activations
    assert torch.equal(layer.packed_weight.scales, w4.scales) and torch.equal(layer.packed_weight.mins, w4.mins)
    state = layer.state_dict()
    assert set(state) == {"packed", "scales", "mins", "bias"}
    fresh = QuantLinear(quantize_int4(torch.zeros(16, 64)), torch.zeros(16)).to(torch.bfloat16)
    fresh.load_state_dict(state)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    ops = ops_for("torch", "cpu", torch.bfloat16)
    torch.testing.assert_close(fresh(x, ops), layer(x, ops))


def test_quant_linear_rejects_a_float_weight_and_a_bias_of_the_wrong_size():
    with pytest.raises(TypeError, match="Int4Weight, Int8Weight, Q6KWeight or Fp8Weight"):
        QuantLinear(torch.randn(4, 32))
    with pytest.raises(ValueError, match=r"bias must be \[4\]"):
        QuantLinear(quantize_int4(torch.randn(4, 32)), torch.zeros(5))


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_quant_embedding_returns_the_dequantized_rows_of_its_table(scheme):
    packed = quantize_weight(torch.randn(50, 64), scheme)
    emb = QuantEmbedding(packed)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(emb(ids), packed.dequantize()[ids])
    assert emb.to(torch.bfloat16)(ids).dtype == torch.bfloat16


def test_cat_rows_stacks_packed_weights_exactly_and_refuses_mixed_groups():
    ws = [torch.randn(n, 64) for n in (8, 4, 4)]
    stacked = cat_rows([quantize_int4(w) for w in ws])
    assert torch.equal(stacked.dequantize(), torch.cat([quantize_int4(w).dequantize() for w in ws]))
    with pytest.raises(ValueError, match="one type, K, group size"):
        cat_rows([quantize_int4(ws[0], 32), quantize_int4(ws[1], 64)])


def test_int4_beside_int8_stacks_as_q8_0_blocks_within_half_an_8_bit_step_and_mixed_scale_dtypes_as_fp32():
    from minillm.quant.weight import quantize_q8_0

    ws = [torch.randn(n, 64) for n in (8, 4, 4)]
    q, k, v = quantize_int4(ws[0]), quantize_int4(ws[1], scale_dtype=torch.float32), quantize_q8_0(ws[2])
    stacked = cat_rows([q, k, v])  # a Q4_K_M layer: Q4_K q and k, Q6_K v
    assert isinstance(stacked, Int8Weight) and stacked.group_size == 32 and stacked.shape == (16, 64)
    want = torch.cat([q.dequantize(), k.dequantize(), v.dequantize()])
    step = stacked.scales.float().repeat_interleave(32, 1)
    assert ((stacked.dequantize() - want).abs() <= step / 2 * 1.001).all()
    assert torch.equal(stacked.dequantize()[12:], v.dequantize())  # the int8 part as it was
    assert (stacked.dequantize()[:12] - want[:12]).abs().max() > 0  # the int4 parts re-quantized
    both = cat_rows([q, k])  # fp16 and fp32 scales: fp32, exact
    assert both.scales.dtype == torch.float32 and torch.equal(both.dequantize(), want[:12])


# -------------------------------------------------------------------------------------------------- the swap
def float_twin(model):
    """The quantized ``model``'s float twin: same architecture with every packed weight dequantized (fp32)."""
    twin = tiny_model(tied=model.config.tie_word_embeddings)
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            twin.get_submodule(name).weight = torch.nn.Parameter(m.packed_weight.dequantize(), requires_grad=False)
    if isinstance(model.model.embed_tokens, QuantEmbedding):
        twin.model.embed_tokens.weight = twin.lm_head.weight
    return twin


@pytest.mark.parametrize("scheme,group", [("int4", None), ("int4", 64), ("int8", None), ("int8", 32)])
@pytest.mark.parametrize("tied", [True, False])
def test_quantize_model_swaps_every_linear_and_computes_the_dequantized_models_logits(scheme, group, tied,
                                                                                      monkeypatch):
    # prefill rows on the exact path: the int8 block GEMM rounds the activations (tests/quant/test_block_prefill.py)
    monkeypatch.setattr(select, "INT8_PREFILL", "exact")
    model = tiny_model(tied)
    original = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, Linear)}
    quantize_model(model, scheme, group)
    assert not any(isinstance(m, Linear) for m in model.modules())
    for name, w in original.items():
        packed = model.get_submodule(name).packed_weight
        head = name == "lm_head"
        expect = Int8Weight if head or scheme == "int8" else Int4Weight  # the head is int8 per channel
        assert isinstance(packed, expect)
        assert packed.group_size == (w.shape[1] if head or (scheme == "int8" and group is None) else group or 32)
        assert torch.equal(packed.dequantize(), quantize_weight(w, "int8" if head else scheme,
                                                                None if head else group).dequantize())
    ids, pos = ids_and_positions()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos), float_twin(model)(ids, pos))


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_no_float_copy_of_a_quantized_weight_remains_and_memory_drops(scheme):
    model = tiny_model(tied=True)
    before = packed_nbytes(model)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear)}
    quantize_model(model, scheme)
    tensors = [*model.state_dict().values(), *model.buffers(), *model.parameters()]
    assert not [t for t in tensors if t.is_floating_point() and tuple(t.shape) in shapes]
    assert isinstance(model.model.embed_tokens, QuantEmbedding)  # the tied embedding reads the head's int8 rows
    assert model.model.embed_tokens.qweight is model.lm_head.qweight
    assert packed_nbytes(model) < before / 3


def test_a_tied_quantized_model_still_shares_its_table_after_a_dtype_change():
    model = quantize_model(tiny_model(tied=True), "int4").to(torch.bfloat16)
    assert model.model.embed_tokens.qweight is model.lm_head.qweight
    assert model.dtype == torch.bfloat16 and model.lm_head.scales.dtype == torch.float32
    ids, pos = ids_and_positions()
    with torch.no_grad():
        assert model(ids, pos).dtype == torch.bfloat16


def test_an_unknown_scheme_is_a_value_error_listing_the_schemes():
    with pytest.raises(ValueError, match=r"one of \('int8', 'int4'\).*'int3'"):
        quantize_model(tiny_model(), "int3")


def test_a_group_that_does_not_divide_k_is_a_value_error_naming_the_fix_and_leaves_the_model_alone():
    model = tiny_model(hidden_size=96)  # K = 96 (attention, gate/up) and 256 (down)
    with pytest.raises(ValueError, match=r"group_size 128 does not divide K=96 .*choose a group size that divides "
                                         r"every K \(\[32\]\)"):
        quantize_model(model, "int4", 128)
    with pytest.raises(ValueError, match=r"group_size 48 does not divide K=256"):
        quantize_model(model, "int8", 48)
    with pytest.raises(ValueError, match=r"int4 group_size must be one of \(32, 64, 128\)"):
        quantize_model(model, "int4", 16)
    assert any(isinstance(m, Linear) for m in model.modules())


def _symmetric(w: torch.Tensor) -> Int4Weight:
    """A Q4_0-form weight (no mins) with quantize_int4's codes and scales."""
    q = quantize_int4(w)
    return Int4Weight(q.packed, q.scales, None, q.group_size)


def test_symmetric_int4_weights_stack_without_mins_and_beside_stored_ones_with_m_materialised():
    ws = [torch.randn(n, 64) for n in (8, 4, 4)]
    sym = [_symmetric(w) for w in ws]
    stacked = cat_rows(sym)
    assert stacked.mins is None and torch.equal(stacked.dequantize(), torch.cat([s.dequantize() for s in sym]))
    mixed = cat_rows([sym[0], quantize_int4(ws[1]), sym[2]])
    assert mixed.mins is not None
    assert torch.equal(mixed.dequantize(), torch.cat([sym[0].dequantize(), quantize_int4(ws[1]).dequantize(),
                                                      sym[2].dequantize()]))


def test_a_symmetric_quant_linear_and_embedding_run_and_round_trip_without_mins():
    w4 = _symmetric(torch.randn(16, 64))
    layer = QuantLinear(w4, torch.randn(16))
    assert set(layer.state_dict()) == {"packed", "scales", "bias"} and layer.packed_weight.mins is None
    x = torch.randn(3, 64)
    ops = ops_for("torch", "cpu", torch.float32)
    assert torch.equal(layer(x, ops), QuantLinear(w4.with_mins(), layer.bias)(x, ops))
    moved = layer.to(torch.bfloat16)
    assert moved.packed_weight.mins is None and moved.packed_weight.scales.dtype == torch.float16
    emb = QuantEmbedding(w4)
    ids = torch.tensor([[3, 0, 15], [7, 7, 1]])
    assert torch.equal(emb(ids), w4.dequantize()[ids])
