import numpy as np
import pytest
import torch

from minillm.quant.gguf import hf_name, q4_0_to_int4, q4_1_to_int4, q8_0_to_int8, read_gguf_weights, unpermute_index
from minillm.quant.weight import Int4Weight, Int8Weight

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


READERS = {"Q4_1": q4_1_to_int4, "Q4_0": q4_0_to_int4, "Q8_0": q8_0_to_int8}


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_gguf_blocks_load_as_packed_weights_that_dequantize_bit_for_bit_like_gguf(kind):
    w = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    raw = gguf.quants.quantize(w, T[kind])
    mine = READERS[kind](raw.copy(), 6, 128)
    assert torch.equal(mine.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, T[kind])))


def test_q4_0_blocks_keep_their_codes_and_scales_and_store_no_mins():
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, T.Q4_0)
    mine = q4_0_to_int4(raw.copy(), 4, 64)
    blocks = raw.reshape(4, 2, 18)
    assert mine.scales.dtype == torch.float16 and mine.mins is None  # symmetric: m = −8·d where it is read
    assert np.array_equal(mine.scales.numpy(), blocks[..., :2].copy().view(np.float16)[..., 0])
    assert np.array_equal(mine.packed.numpy(), blocks[..., 2:].reshape(4, 32))  # the nibbles as they are
    assert mine.nbytes == raw.nbytes == 4 * 2 * 18  # the file's own 18 bytes per block of 32
    assert torch.equal(mine.mins_f32(), -8 * mine.scales.float())


def test_q4_0_scales_whose_minimum_overflows_fp16_stay_fp16_and_exact():
    w = np.random.default_rng(2).standard_normal((2, 64)).astype(np.float32)
    w[1, :32] *= 3e4  # d ≈ max|w| / 8 > 8188, so -8·d is beyond fp16's 65504 (but never stored)
    raw = gguf.quants.quantize(w, T.Q4_0)
    mine = q4_0_to_int4(raw.copy(), 2, 64)
    assert mine.scales.dtype == torch.float16 and mine.mins is None and float(mine.scales.abs().max()) > 8188
    assert torch.equal(mine.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_0)))


def test_row_unpermutation_equals_transformers_reverse_permute():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(3 * 64 * 5, dtype=np.float32).reshape(3 * 64, 5)
    expected = LlamaTensorProcessor._reverse_permute_weights(None, rows, 9, 3)  # k_proj: 9 query, 3 K/V heads
    assert np.array_equal(rows[unpermute_index(3 * 64, 3).numpy()], expected)


def test_gguf_names_map_to_hugging_face_names():
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(ValueError, match="no Hugging Face name"):
        hf_name("blk.0.ssm_conv.weight")


@pytest.fixture(scope="module")
def default_gguf():
    from minillm.models.loader import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_default_model_q4_1_blocks_reproduce_gguf_dequantization_bit_for_bit(default_gguf):
    reader = gguf.GGUFReader(default_gguf)
    packed = read_gguf_weights(default_gguf, unpermute=False)
    kinds = set()
    for t in reader.tensors:
        w = packed[hf_name(t.name)]
        if t.tensor_type in (T.Q4_1, T.Q8_0):
            kinds.add(t.tensor_type.name)
            assert isinstance(w, Int4Weight if t.tensor_type == T.Q4_1 else Int8Weight)
            ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
            assert torch.equal(w.dequantize(), ref), t.name
    assert kinds == {"Q4_1", "Q8_0"}


@pytest.mark.slow
def test_packed_default_model_equals_the_weights_minillm_loads(default_gguf, default_model_dir):
    from minillm.models.loader import read_safetensors

    loaded = read_safetensors(default_model_dir)
    packed = read_gguf_weights(default_gguf)
    assert set(packed) == set(loaded)
    for name, w in packed.items():  # q_proj / k_proj included: the row un-permutation matches transformers'
        dense = w if isinstance(w, torch.Tensor) else w.dequantize()
        assert torch.equal(dense, loaded[name]), name
