"""kernels.select: one vocabulary, one table, resolved per (choice, op, device, dtype); layers run what they get."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import minillm.kernels as K
from minillm import ModelConfig
from minillm.kernels import select
from minillm.kernels.cpu import native
from minillm.kernels.select import CHOICES, KERNELS, OPS, describe, ops_for, resolve
from minillm.models.loader import build_model

ATTENTION = ("prefill_attention", "decode_attention", "paged_decode_attention")
ALL_TORCH = dict.fromkeys(OPS, "torch")
NATIVE_CPU = {"linear": "native", "rms_norm": "native", "prefill_attention": "native", "decode_attention": "native",
              "paged_decode_attention": "native", "add_rms_norm": "native", "rope": "native", "silu_and_mul": "native",
              "write_kv": "native", "int4_linear": "native", "int8_linear": "native",
              "w8a8_linear": "native", "fp8_linear": "torch"}  # prefill: SDPA over query tiles; fp8 is GPU-only
QUANT = ("int4_linear", "int8_linear")  # the dequant GEMVs
TRITON = {op: "triton" if op in ATTENTION + QUANT else "torch" for op in OPS}  # no Triton linear / rms_norm yet
EIGHT_BIT_GEMMS = {"w8a8_linear": "native", "fp8_linear": "native"}  # ATen's int8 / fp8 GEMMs, on CUDA too


@pytest.fixture
def machine(monkeypatch):
    """Pretend what is installed: ``machine(native=..., triton=..., interpret=...)``."""

    def pretend(*, native_built: bool, triton: bool = True, interpret: bool = True):
        monkeypatch.setattr(native, "available", lambda: native_built)
        monkeypatch.setattr(select, "triton_available", lambda: triton)
        if interpret:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    return pretend


def tiny(kernels, dtype=torch.float32):
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return build_model(ModelConfig.from_hf(cfg), LlamaForCausalLM(cfg).state_dict(), dtype=dtype, device="cpu",
                       kernels=kernels)


# ------------------------------------------------------------------------------------------------ the table
def test_every_op_has_one_torch_reference_and_every_row_names_a_known_op_and_backend():
    for op in OPS:
        assert [k.impl for k in KERNELS if k.op == op].count("torch") == 1, op
    assert {k.op for k in KERNELS} == set(OPS)
    assert {k.impl for k in KERNELS} <= set(CHOICES) - {"auto"}


# ------------------------------------------------------------------------------------------------ resolution on CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_and_native_on_cpu_pick_the_native_kernels_when_the_library_built(machine, dtype):
    machine(native_built=True)
    assert describe("auto", "cpu", dtype) == NATIVE_CPU
    assert describe("native", "cpu", dtype) == NATIVE_CPU
    assert describe("torch", "cpu", dtype) == ALL_TORCH
    assert describe("triton", "cpu", dtype) == TRITON


def test_fp16_on_cpu_has_no_native_kernel_so_auto_and_native_run_the_references(machine):
    machine(native_built=True)
    assert describe("auto", "cpu", torch.float16) == ALL_TORCH
    assert describe("native", "cpu", torch.float16) == ALL_TORCH


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_without_the_native_library_auto_runs_the_references_and_native_is_refused(machine, dtype):
    machine(native_built=False)
    assert describe("auto", "cpu", dtype) == ALL_TORCH
    assert describe("torch", "cpu", dtype) == ALL_TORCH
    assert describe("triton", "cpu", dtype) == TRITON
    with pytest.raises(RuntimeError, match="native CPU kernels .* failed to build"):
        describe("native", "cpu", dtype)


def test_disabling_the_native_library_by_environment_turns_auto_into_the_references(monkeypatch):
    monkeypatch.setenv("MINILLM_DISABLE_NATIVE", "1")
    native._lib.cache_clear()
    try:
        assert describe("auto", "cpu", torch.float32) == ALL_TORCH
        with pytest.raises(RuntimeError, match="MINILLM_DISABLE_NATIVE"):
            ops_for("native", "cpu", torch.float32)
    finally:
        monkeypatch.delenv("MINILLM_DISABLE_NATIVE")
        native._lib.cache_clear()


def test_triton_on_cpu_needs_the_interpreter_and_the_package(machine):
    machine(native_built=True, interpret=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        describe("triton", "cpu", torch.float32)
    assert describe("auto", "cpu", torch.float32) == NATIVE_CPU  # "auto" never picks the interpreter
    machine(native_built=True, triton=False)
    with pytest.raises(RuntimeError, match="pip install"):
        describe("triton", "cpu", torch.float32)


def test_auto_on_cuda_picks_triton_attention_when_installed_and_the_references_otherwise(machine):
    machine(native_built=True, interpret=False)
    assert describe("auto", "cuda", torch.bfloat16) == TRITON | EIGHT_BIT_GEMMS
    assert describe("triton", "cuda", torch.float16) == TRITON
    assert describe("native", "cuda", torch.float32) == ALL_TORCH | EIGHT_BIT_GEMMS  # the C kernels are CPU-only
    machine(native_built=True, triton=False, interpret=False)
    assert describe("auto", "cuda", torch.bfloat16) == ALL_TORCH | EIGHT_BIT_GEMMS


@pytest.mark.parametrize("capability, name, runs_triton", [((7, 5), "Tesla T4", False), ((8, 0), "A100", True),
                                                         ((9, 0), "H100", True)])
def test_triton_runs_on_cuda_only_from_compute_capability_8_and_says_why_not(machine, monkeypatch, capability,
                                                                          name, runs_triton):
    machine(native_built=True, interpret=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    select.clear_cache()  # the device's generation is not in the cache key
    try:
        if runs_triton:
            assert describe("auto", "cuda", torch.float16) == TRITON | EIGHT_BIT_GEMMS  # (ATen's, not Triton's)
            assert select.triton_unsupported_reason() == ""
            return
        with pytest.warns(RuntimeWarning, match=r"Tesla T4 is sm_75: .*compute capability 8\.0\+.*torch references"):
            assert describe("auto", "cuda", torch.float16) == ALL_TORCH | EIGHT_BIT_GEMMS
        with pytest.raises(RuntimeError, match=r"kernels='triton': Tesla T4 is sm_75"):
            describe("triton", "cuda", torch.float16)
    finally:
        select.clear_cache()


def test_clear_cache_works_while_triton_available_is_a_stand_in(machine):
    machine(native_built=True, triton=True)
    assert describe("triton", "cpu", torch.float32) == TRITON
    select.clear_cache()  # the stand-in has no cache_clear of its own
    assert select._resolve.cache_info().currsize == 0 and select._ops.cache_info().currsize == 0


def test_no_decision_made_under_a_stand_in_probe_outlives_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no device generation to rule triton out
    select.clear_cache()
    try:
        real = describe("auto", "cuda", torch.bfloat16)
        installed = select.triton_available()
        with monkeypatch.context() as m:
            m.setattr(select, "triton_available", lambda: not installed)
            assert describe("auto", "cuda", torch.bfloat16) != real  # the attention ops follow the probe
        assert describe("auto", "cuda", torch.bfloat16) == real
    finally:
        select.clear_cache()


def test_resolution_is_cached_per_choice_device_and_dtype():
    assert ops_for("torch", "cpu", torch.float32) is ops_for("torch", torch.device("cpu"), torch.float32)
    assert ops_for("torch", "cpu", torch.float32) is not ops_for("torch", "cpu", torch.bfloat16)
    assert resolve("torch", "linear", "cpu", torch.float32).fn is torch.nn.functional.linear


@pytest.mark.parametrize("bad", ["fast", "cuda", "", "Torch"])
def test_an_unknown_choice_is_a_value_error_naming_the_allowed_values(bad):
    allowed = r"\('auto', 'torch', 'native', 'triton', 'compiled'\)"
    with pytest.raises(ValueError, match=f"kernels must be one of {allowed}"):
        ops_for(bad, "cpu", torch.float32)
    with pytest.raises(ValueError, match=allowed):
        resolve(bad, "linear", "cpu", torch.float32)
    with pytest.raises(ValueError, match=f"kernels must be one of {allowed}"):
        tiny(bad)
    x = torch.randn(1, 1, 2, 16)
    with pytest.raises(ValueError, match=f"impl must be one of {allowed}"):
        K.flash_attention(x, x, x, impl=bad)


def test_an_unknown_op_is_a_value_error_naming_the_ops():
    with pytest.raises(ValueError, match="paged_decode_attention"):
        resolve("auto", "int3_linear", "cpu", torch.float32)


# ------------------------------------------------------------------------------------------------ what runs
def test_a_model_on_auto_gives_the_logits_of_the_model_on_torch():
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))  # 18 rows: native GEMV range
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(tiny("auto")(ids, pos), tiny("torch")(ids, pos))


def test_set_kernels_changes_the_ops_the_model_passes_down_and_refuses_a_bad_choice():
    model = tiny("torch")
    assert model.kernel_ops() is ops_for("torch", "cpu", torch.float32)
    assert model.set_kernels("auto").kernel_ops() is ops_for("auto", "cpu", torch.float32)
    with pytest.raises(ValueError, match="kernels must be one of"):
        model.set_kernels("fast")
    assert model.kernels == "auto"  # a refused choice leaves the model as it was


def recording(ops, *names):
    """``ops`` with each op in ``names`` replaced by a fake that records its call and returns a marker tensor."""
    calls = []

    def fake(name):
        def run(*args, **kwargs):
            calls.append((name, args, kwargs))
            out = getattr(ops, name)(*args, **kwargs)
            return tuple(o * 0 + 7.0 for o in out) if isinstance(out, tuple) else out * 0 + 7.0

        return run

    return dataclasses.replace(ops, **{n: fake(n) for n in names}), calls


def test_linear_and_rms_norm_call_the_implementation_they_are_given():
    from minillm.layers.linear import Linear
    from minillm.layers.norm import RMSNorm

    ops, calls = recording(ops_for("torch", "cpu", torch.float32), "linear", "rms_norm")
    lin = Linear(4, 3, bias=True).requires_grad_(False)
    lin.weight.copy_(torch.randn(3, 4))
    x = torch.randn(2, 4)
    assert torch.equal(lin(x, ops), torch.full((2, 3), 7.0))
    assert calls[-1][0] == "linear" and calls[-1][1][0] is x and calls[-1][1][1] is lin.weight
    norm = RMSNorm(4, 1e-5)
    assert torch.equal(norm(x, ops), torch.full((2, 4), 7.0))
    assert calls[-1][0] == "rms_norm" and calls[-1][1][2] == 1e-5


def test_every_layer_of_the_model_runs_the_ops_of_the_models_choice(monkeypatch):
    model = tiny("torch")
    ops, calls = recording(model.kernel_ops(), "linear", "rms_norm", "add_rms_norm", "rope", "silu_and_mul",
                           "prefill_attention")
    monkeypatch.setattr(model, "kernel_ops", lambda: ops)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None])
    names = [c[0] for c in calls]
    layers = model.config.num_layers
    assert names.count("linear") == 4 * layers + 1  # qkv, o, gate_up, down per layer + the LM head
    # 2 norms per layer + the final one; each but the first also adds the residual stream before it
    assert names.count("rms_norm") == 1
    assert names.count("add_rms_norm") == 2 * layers
    assert names.count("rope") == names.count("silu_and_mul") == names.count("prefill_attention") == layers


def test_the_kv_caches_attend_with_the_kernels_of_their_choice():
    from minillm.kv.contiguous import KVCache

    model = tiny("torch")
    cache = KVCache(model.config, 1, 8, dtype=torch.float32, device="cpu", kernels="torch")
    assert cache.ops is ops_for("torch", "cpu", torch.float32)
    ops, calls = recording(cache.ops, "decode_attention", "prefill_attention")
    cache.ops = ops  # the test's fake in place of the resolved kernels
    with torch.no_grad():
        cache.begin(torch.arange(3)[None])
        model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache)
        cache.begin(torch.tensor([[3]]))
        model(torch.tensor([[4]]), torch.tensor([[3]]), cache)
    names = [c[0] for c in calls]
    assert names == ["prefill_attention"] * model.config.num_layers + ["decode_attention"] * model.config.num_layers


@pytest.mark.skipif(not native.available(), reason="no C compiler")
def test_public_decode_functions_accept_native_and_agree_with_torch():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 12, 16, generator=g), torch.randn(2, 2, 12, 16,
                                                                                                     generator=g)
    lens = torch.tensor([5, 12])
    torch.testing.assert_close(K.decode_attention(q, k, v, lens, impl="native"),
                               K.decode_attention(q, k, v, lens, impl="torch"))
    kc = k.transpose(1, 2).reshape(6, 4, 2, 16)  # 2 sequences × 3 blocks of 4 slots
    vc = v.transpose(1, 2).reshape(6, 4, 2, 16)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    torch.testing.assert_close(K.paged_decode_attention(q, kc, vc, tables, lens, impl="native"),
                               K.decode_attention(q, k, v, lens, impl="torch"))
