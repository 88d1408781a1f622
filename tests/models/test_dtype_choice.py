"""The library picks a dtype per machine (fp32 on CPU, bf16 only where native; bf16 or fp16 on CUDA) and says why.

Feature detection is monkeypatched, so both branches run on any CPU.
"""

import warnings

import pytest
import torch

import minillm.kernels.cpu.features as features
import minillm.models.loader as loader
from minillm.models.loader import DtypeChoice, choose_dtype, resolve_dtype

CPU = torch.device("cpu")


@pytest.fixture
def native_bf16(monkeypatch):
    """Set whether this CPU 'has' native bf16; the once-per-process warning starts (and ends) unsent."""

    def set_to(value: bool):
        monkeypatch.setattr(features, "cpu_has_native_bf16", lambda: value)

    loader._warn_emulated_bf16.cache_clear()
    yield set_to
    loader._warn_emulated_bf16.cache_clear()


@pytest.mark.parametrize("native", [True, False])
def test_cpu_default_is_fp32_whatever_the_cpu(native_bf16, native):
    native_bf16(native)
    choice = choose_dtype("cpu")
    assert isinstance(choice, DtypeChoice) and choice.dtype == torch.float32
    assert str(choice).startswith("float32: the CPU default")
    assert ("has no native bf16" in choice.reason) == (not native)


def test_bf16_checkpoint_stays_bf16_only_on_a_cpu_with_native_bf16(native_bf16):
    native_bf16(True)
    assert choose_dtype("cpu", "bfloat16").dtype == torch.bfloat16
    assert resolve_dtype(None, "torch.bfloat16", CPU) == torch.bfloat16
    native_bf16(False)
    assert choose_dtype("cpu", "bfloat16").dtype == torch.float32
    assert resolve_dtype(None, "bfloat16", CPU) == torch.float32


def test_asking_for_bf16_on_a_cpu_without_it_warns_once_with_the_measured_cost(native_bf16):
    native_bf16(False)
    with pytest.warns(UserWarning, match=r"no native bf16.*bf16 matmul runs at \d+\.\d GFLOP/s here, .* fp32 "
                                         r"\(\d+\.\d GFLOP/s\); use dtype='float32'"):
        assert resolve_dtype("bfloat16", None, CPU) == torch.bfloat16  # honoured: the user asked for it
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert resolve_dtype(torch.bfloat16, None, CPU) == torch.bfloat16
    assert not again, "the cost is measured and reported once per process"


def test_asking_for_bf16_on_a_cpu_with_it_is_silent(native_bf16):
    native_bf16(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_dtype("bf16", None, CPU) == torch.bfloat16
        assert resolve_dtype("float32", None, CPU) == torch.float32
    assert not caught


@pytest.mark.parametrize(("has_bf16", "ckpt", "want"), [
    (True, None, torch.bfloat16), (True, "float32", torch.bfloat16), (True, "float16", torch.float16),
    (False, None, torch.float16), (False, "bfloat16", torch.float16),  # a T4: no bf16, so fp16
])
def test_cuda_default_is_bf16_where_supported_else_fp16(monkeypatch, has_bf16, ckpt, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(loader, "_cuda_has_bf16", lambda device: has_bf16)
    choice = choose_dtype("cuda", ckpt)
    assert choice.dtype == want and "Tesla T4" in choice.reason
    assert resolve_dtype(None, ckpt, torch.device("cuda")) == want
