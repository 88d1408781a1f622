import numpy as np
import pytest
import torch

from minillm.quant.gguf import hf_name, q4_0_to_int4, q4_1_to_int4, q8_0_to_int8, read_gguf_weights, unpermute_index
from minillm.quant.weight import Int4Weight, Int8Weight, Q6KWeight

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


# ---- K-quants and 5-bit blocks, re-blocked into the int4/int8 forms -----------------------------------------------
def kquant_blocks(kind: str, rows: int, K: int, seed: int, scale: float = 1e-2) -> np.ndarray:
    """Random bytes [rows, K / block · bytes] laid out as ``kind``'s blocks, with every fp16 d (and dmin) set to a
    finite value around ``scale``: any bytes are valid codes and sub-scales."""
    from gguf.constants import GGML_QUANT_SIZES

    rng = np.random.default_rng(seed)
    qk, size = GGML_QUANT_SIZES[T[kind]]
    raw = rng.integers(0, 256, (rows * K // qk, size), dtype=np.uint8)
    where = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,)}[kind]  # byte offsets of fp16 d (dmin)
    for off in where:
        d = (rng.uniform(0.5, 1.0, raw.shape[0]) * scale).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def gguf_dequant(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, T[kind]), dtype=np.float32))


def test_q4_k_blocks_load_as_k_records_that_dequantize_bit_for_bit_like_gguf():
    from minillm.quant.gguf import q4_k_to_int4

    raw = kquant_blocks("Q4_K", 6, 512, seed=3)
    mine = q4_k_to_int4(raw.copy(), 6, 512)
    assert isinstance(mine, Int4Weight) and mine.group_size == 32 and mine.k_records
    assert mine.scales.dtype == torch.uint8 and mine.scales.shape == mine.mins.shape == (6, 2, 10)
    ref = gguf_dequant(raw, "Q4_K")
    assert torch.equal(mine.dequantize(), ref)  # codes re-paired, d·sc and −dmin·mn in fp32 as gguf computes them
    assert torch.equal(mine.expanded().dequantize(), ref)  # the fp32 form holds the same values
    assert mine.nbytes * 4.5 == raw.nbytes * 4.625  # 4.625 bits a weight against the file's 4.5
    assert mine.nbytes == 6 * 512 // 2 + 2 * 6 * 2 * 10  # codes + two 10-byte records per row and super-block


@pytest.mark.parametrize("d", [6e4, 2.0 ** -24, 3 * 2.0 ** -20], ids=["huge", "smallest-subnormal", "subnormal"])
def test_q4_k_records_stay_exact_for_huge_and_subnormal_super_scales(d):
    from minillm.quant.gguf import q4_k_to_int4

    raw = kquant_blocks("Q4_K", 4, 768, seed=4)
    raw.reshape(-1, 144)[:, 0:4] = np.array([d, d], np.float16).view(np.uint8)  # d and dmin
    mine, ref = q4_k_to_int4(raw.copy(), 4, 768), gguf_dequant(raw, "Q4_K")
    assert torch.equal(mine.dequantize(), ref) and ref.abs().max() > 0
    if d > 1e4:  # d·sc beyond fp16's 65504 (the former fp16 re-blocking needed an fp32 fallback here)
        assert mine.scales_f32().max() > 65504


def test_k_records_reject_shapes_and_groups_they_cannot_hold():
    from minillm.quant.gguf import q4_k_to_int4

    w = q4_k_to_int4(kquant_blocks("Q4_K", 2, 256, seed=9).copy(), 2, 256)
    with pytest.raises(ValueError, match="group_size=32"):
        Int4Weight(w.packed, w.scales, w.mins, 64)
    with pytest.raises(ValueError, match="mins are stored"):
        Int4Weight(w.packed, w.scales, None, 32)
    with pytest.raises(ValueError, match="uint8 K records"):
        Int4Weight(w.packed, w.scales_f32().half(), w.mins, 32)
    with pytest.raises(ValueError, match=r"multiple of 256"):
        Int4Weight(w.packed[:, :64], w.scales, w.mins, 32)
    with pytest.raises(ValueError, match=r"a multiple of 256 weights, got K=96"):
        q4_k_to_int4(np.zeros((2, 54), np.uint8), 2, 96)


def test_q5_0_blocks_load_as_int8_codes_that_dequantize_bit_for_bit_like_gguf():
    from minillm.quant.gguf import q5_0_to_int8

    for raw in (kquant_blocks("Q5_0", 5, 128, seed=5),
                gguf.quants.quantize(np.random.default_rng(6).standard_normal((5, 128)).astype(np.float32), T.Q5_0)):
        mine = q5_0_to_int8(raw.copy(), 5, 128)
        assert mine.group_size == 32 and int(mine.qweight.min()) >= -16 and int(mine.qweight.max()) <= 15
        assert torch.equal(mine.dequantize(), gguf_dequant(raw, "Q5_0"))


@pytest.mark.parametrize("kind", ["Q6_K", "Q5_K", "Q5_1"])
def test_six_and_five_bit_blocks_requantize_to_q8_0_within_half_a_step(kind):
    from minillm.quant.gguf import _requantized

    K = 512
    raw = (gguf.quants.quantize(np.random.default_rng(7).standard_normal((3, K)).astype(np.float32), T.Q5_1)
           if kind == "Q5_1" else kquant_blocks(kind, 3, K, seed=8))
    mine, ref = _requantized(raw.copy(), 3, K, T[kind]), gguf_dequant(raw, kind)
    assert isinstance(mine, Int8Weight) and mine.group_size == 32 and mine.scales.dtype == torch.float16
    step = mine.scales.float().repeat_interleave(32, 1)
    assert ((mine.dequantize() - ref).abs() <= step / 2 * 1.001).all()
    assert (mine.qweight.view(3, -1, 32).abs().amax(-1) >= 126).all()  # each block's largest weight near ±127


def test_quantize_q8_0_keeps_zero_blocks_zero():
    from minillm.quant.weight import quantize_q8_0

    w = torch.zeros(2, 64)
    w[1, 32:] = torch.linspace(-1, 1, 32)
    q = quantize_q8_0(w)
    assert torch.equal(q.qweight[0], torch.zeros(64, dtype=torch.int8)) and float(q.scales[0].abs().max()) == 0
    assert int(q.qweight[1, 32:].abs().max()) == 127


def write_llama_gguf(path, tensors: dict[str, tuple[np.ndarray, str]], n_head: int, n_kv: int) -> None:
    """A GGUF with the llama head counts and raw ``(bytes [rows, ...], type name)`` tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    for name, (raw, kind) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_q4_k_m_style_file_reads_every_tensor_as_gguf_dequantizes_it_q_and_k_unpermuted(tmp_path):
    K, n_head, n_kv = 256, 4, 2
    tensors = {"blk.0.attn_q.weight": (kquant_blocks("Q4_K", 64, K, 10), "Q4_K"),
               "blk.0.attn_k.weight": (kquant_blocks("Q4_K", 32, K, 11), "Q4_K"),
               "blk.0.attn_v.weight": (kquant_blocks("Q6_K", 32, K, 12), "Q6_K"),
               "blk.0.ffn_down.weight": (kquant_blocks("Q5_0", 16, K, 13), "Q5_0"),
               "output.weight": (kquant_blocks("Q6_K", 48, K, 14), "Q6_K")}
    write_llama_gguf(tmp_path / "m.gguf", tensors, n_head, n_kv)
    got = read_gguf_weights(tmp_path / "m.gguf")
    for name, (raw, kind) in tensors.items():
        w = got[hf_name(name)]
        ref = gguf_dequant(raw, kind)
        if "attn_q" in name or "attn_k" in name:
            ref = ref[unpermute_index(ref.shape[0], n_head if "attn_q" in name else n_kv)]
        assert isinstance(w, {"Q4_K": Int4Weight, "Q6_K": Q6KWeight}.get(kind, Int8Weight)), name
        assert torch.equal(w.dequantize(), ref), name  # each as gguf dequantizes it, bit for bit


def test_an_unsupported_block_type_names_the_conversion_that_fixes_it(tmp_path):
    write_llama_gguf(tmp_path / "q3.gguf", {"blk.0.attn_v.weight": (kquant_blocks("Q4_K", 8, 256, 1)[:, :110], "Q3_K")},
                     2, 2)
    with pytest.raises(ValueError, match="Q3_K.*llama-quantize.*Q4_K_M"):
        read_gguf_weights(tmp_path / "q3.gguf")


def test_a_llama_of_q4_k_weights_runs_its_records_as_the_expanded_fp32_form_bit_for_bit():
    """A tiny Llama whose every linear, tied head and embedding are Q4_K blocks (K = 256 and 512) loaded as K records:
    its logits (per-layer path) and the engine's greedy tokens (the fused native decode step) equal those of the same
    weights with d·sc and −dmin·mn expanded to fp32 — while it holds 20 bytes of scales per 256 weights, not 64."""
    from minillm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
    from minillm.engine.native_runner import NativeRunner
    from minillm.kernels.cpu import decode
    from minillm.layers.linear import QuantLinear
    from minillm.quant.apply import model_from_packed
    from minillm.quant.gguf import q4_k_to_int4

    cfg = ModelConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=64, tie_word_embeddings=True)
    shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256), "self_attn.v_proj": (128, 256),
              "self_attn.o_proj": (256, 256), "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256),
              "mlp.down_proj": (256, 512)}
    weights, seed = {"model.norm.weight": torch.ones(256)}, 20

    def q4_k(N, K):  # random Q4_K blocks, their groups then centred (a random model with biased groups repeats
        nonlocal seed  # one token): sub-scales 0..8, min = −d · round(7.5 · sc) ≈ the mean code's value
        seed += 1
        w = q4_k_to_int4(kquant_blocks("Q4_K", N, K, seed, scale=1e-2).copy(), N, K)
        w.scales[..., 2:] %= 9
        w.mins.copy_(w.scales)
        w.mins[..., 1] |= 0x80  # −d: the fp16 sign bit
        w.mins[..., 2:] = (w.scales[..., 2:].float() * 7.5).round().to(torch.uint8)
        return w

    weights["model.embed_tokens.weight"] = q4_k(96, 256)
    for i in range(2):
        weights.update({f"model.layers.{i}.{n}.weight": q4_k(*s) for n, s in shapes.items()})
        weights.update({f"model.layers.{i}.{n}.weight": torch.ones(256)
                        for n in ("input_layernorm", "post_attention_layernorm")})
    wide = {n: w.expanded() if isinstance(w, Int4Weight) else w for n, w in weights.items()}
    models = [model_from_packed(cfg, ws, dtype=torch.float32, device="cpu") for ws in (weights, wide)]
    int4 = [[m.packed_weight for m in model.modules() if isinstance(m, QuantLinear)] for model in models]
    assert all(w.k_records for w in int4[0]) and not any(w.k_records for w in int4[1])  # stacked as records
    assert sum(w.nbytes for w in int4[0]) < sum(w.nbytes for w in int4[1])
    ids = torch.tensor([[1, 2, 3, 40, 50, 17, 95]])
    with torch.inference_mode():
        logits = [m(ids, torch.arange(7)[None]) for m in models]
    assert torch.isfinite(logits[0]).all() and torch.equal(logits[0], logits[1])
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 40], [50, 17, 95, 9, 8, 7]]
    engines = [LLMEngine(m, config=EngineConfig()) for m in models]
    if decode.available():  # where the fused step builds, it is what decodes the records
        assert all(isinstance(e.runner, NativeRunner) for e in engines)
    tokens = [[o.token_ids for o in e.generate(prompts, [params] * 2)] for e in engines]
    assert tokens[0] == tokens[1] and len(tokens[0][0]) == 10 and len(set(tokens[0][0] + tokens[0][1])) > 2


def test_block_readers_and_q8_0_refuse_shapes_that_do_not_fit_naming_them():
    from minillm.models.synthetic import gguf_type, synthetic_config, tensor_plan
    from minillm.quant.gguf import q4_k_to_int4, q5_0_to_int8
    from minillm.quant.weight import quantize_q8_0

    with pytest.raises(ValueError, match="a Q4_K row has a multiple of 256 weights, got K=320"):
        q4_k_to_int4(kquant_blocks("Q4_K", 2, 256, 1), 2, 320)
    with pytest.raises(ValueError, match="Q5_0 has 22 bytes per 32 weights: 2 rows of K=64 need 88 bytes, got 86"):
        q5_0_to_int8(kquant_blocks("Q5_0", 2, 64, 1)[:, :-1].copy(), 2, 64)
    with pytest.raises(ValueError, match=r"quantize_q8_0 needs a float \[N, K\]"):
        quantize_q8_0(torch.zeros(64))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="'q4_k_m' is not written here"):
        gguf_type(tensor_plan(synthetic_config("tiny"))[0], "q4_k_m")  # the embedding: a matrix


def test_a_llama_of_q6_k_blocks_decodes_in_the_fused_step_as_its_layers_do_and_near_the_exact_reference():
    """A tiny Llama whose every linear, tied head and embedding are Q6_K blocks as stored (``Q6KWeight``, 6.56 bits a
    weight): the fused native decode step's greedy tokens equal the per-layer native path's (the same kernels in
    the same order), and the native logits are the exact reference's (``kernels="torch"``: the blocks dequantized,
    fp32 activations) up to the int8 rounding of the activations."""
    from minillm import EngineConfig, LLMEngine, ModelConfig, SamplingParams
    from minillm.engine.native_runner import NativeDecodeStack, NativeRunner
    from minillm.kernels.cpu import decode
    from minillm.layers.linear import QuantEmbedding, QuantLinear
    from minillm.quant.apply import model_from_packed
    from minillm.quant.gguf import q6_k_blocks

    cfg = ModelConfig(vocab_size=96, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position_embeddings=64, tie_word_embeddings=True)
    shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256), "self_attn.v_proj": (128, 256),
              "self_attn.o_proj": (256, 256), "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256),
              "mlp.down_proj": (256, 512)}
    seeds = iter(range(40, 80))

    def q6_k(N, K):
        return q6_k_blocks(kquant_blocks("Q6_K", N, K, next(seeds), scale=2e-5).copy(), N, K)

    weights = {"model.norm.weight": torch.ones(256), "model.embed_tokens.weight": q6_k(96, 256)}
    for i in range(2):
        weights.update({f"model.layers.{i}.{n}.weight": q6_k(*s) for n, s in shapes.items()})
        weights.update({f"model.layers.{i}.{n}.weight": torch.ones(256)
                        for n in ("input_layernorm", "post_attention_layernorm")})
    model = model_from_packed(cfg, weights, dtype=torch.float32, device="cpu")
    assert all(isinstance(m.packed_weight, Q6KWeight) for m in model.modules() if isinstance(m, QuantLinear))
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    ids = torch.tensor([[1, 2, 3, 40, 50, 17, 95]])
    with torch.inference_mode():
        native = model(ids, torch.arange(7)[None])
        exact = model.set_kernels("torch")(ids, torch.arange(7)[None])
        model.set_kernels("auto")
    assert torch.isfinite(exact).all() and exact.std() > 0
    assert (native - exact).abs().max() < 0.05 * exact.abs().max()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 40], [50, 17, 95, 9, 8, 7]]

    def decode_logits(engine):  # every step's logits of both prompts, decoded side by side
        rows = {}
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=str(i))
        while engine.has_unfinished_requests():
            for u in engine.step():
                rows.setdefault(u.request_id, []).append(u.logits)
        return [torch.stack(rows[str(i)]) for i in range(2)]

    fused = LLMEngine(model, config=EngineConfig(return_logits=True))
    if decode.available():  # where the fused step builds, it is what decodes the blocks
        assert isinstance(fused.runner, NativeRunner)
    layered = LLMEngine(model, config=EngineConfig(return_logits=True, enforce_eager=True))  # the per-layer path
    assert not isinstance(layered.runner, NativeRunner)
    got, want = decode_logits(fused), decode_logits(layered)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and got[0].shape == (6, 96)
    if decode.available():  # 12 rows in one fused call: each row's logits as 12 one-row calls give them (past 8
        from minillm.engine.model_runner import DecodeBatch  # rows the GEMM tiles would sum another way)
        from minillm.kv.paged_cache import PagedKVCache

        caches = [PagedKVCache(cfg, 8 * 13, 4, dtype=torch.float32, device="cpu") for _ in range(2)]
        g = torch.Generator().manual_seed(3)
        for c in caches:
            c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(3)))
            c.v.copy_(torch.randn(c.v.shape, generator=g.manual_seed(4)))
        lens = [3 + i for i in range(12)]
        tables = [[8 * i + j for j in range(-(-L // 4))] for i, L in enumerate(lens)]
        rows = DecodeBatch([(7 * i) % 96 for i in range(12)], [L - 1 for L in lens],
                           [t[(L - 1) // 4] * 4 + (L - 1) % 4 for t, L in zip(tables, lens, strict=True)], tables, lens)
        together = NativeDecodeStack(model, caches[0]).logits(rows)
        one = NativeDecodeStack(model, caches[1])
        fields = (rows.input_ids, rows.positions, rows.slot_mapping, rows.block_tables, rows.seq_lens)
        alone = torch.cat([one.logits(DecodeBatch(*([f[i]] for f in fields))) for i in range(12)])
        assert torch.equal(together, alone)
