"""GPTQ (quant/gptq.py): lower output error than round-to-nearest at the same group size, the same packed int4
format, and a calibrated model that runs."""

import pytest
import torch

from minillm.quant.gptq import gptq_quantize, hessian
from minillm.quant.weight import Int4Weight, quantize_int4


def correlated_inputs(n: int, K: int, seed: int = 0) -> torch.Tensor:
    """[n, K] rows with strongly correlated channels (a random low-rank mix plus noise), as activations are."""
    basis = torch.randn(K // 8, K, generator=torch.Generator().manual_seed(100))  # one distribution for every seed
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, K // 8, generator=g) @ basis + 0.1 * torch.randn(n, K, generator=g)


def output_error(w, wq, x) -> float:
    return float((x @ (w - wq).T).pow(2).mean())


@pytest.mark.parametrize("group_size", [32, 128])
def test_gptq_output_error_is_lower_than_round_to_nearest_at_the_same_group_size(group_size):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    x = correlated_inputs(1024, 256)
    held_out = correlated_inputs(512, 256, seed=2)  # the same distribution, rows GPTQ never saw
    gptq = gptq_quantize(w, hessian(x), group_size)
    rtn = quantize_int4(w, group_size)
    assert isinstance(gptq, Int4Weight) and gptq.group_size == group_size and gptq.shape == w.shape
    assert output_error(w, gptq.dequantize(), held_out) < 0.5 * output_error(w, rtn.dequantize(), held_out)


def test_gptq_with_uncorrelated_inputs_rounds_like_round_to_nearest():
    """With H = I there is nothing to compensate through: GPTQ is round-to-nearest (same codes, scales, mins)."""
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    gptq, rtn = gptq_quantize(w, torch.eye(64), 32, damp=0.0), quantize_int4(w, 32)
    assert torch.equal(gptq.packed, rtn.packed) and torch.equal(gptq.scales, rtn.scales)


def test_a_dead_input_channel_gets_zero_weight_and_no_nan():
    x = correlated_inputs(256, 64)
    x[:, 5] = 0
    wq = gptq_quantize(torch.randn(4, 64), hessian(x), 32).dequantize()
    assert torch.isfinite(wq).all()


def test_bad_shapes_are_value_errors_naming_the_rule():
    with pytest.raises(ValueError, match="multiple of 32 dividing K=96"):
        gptq_quantize(torch.randn(4, 96), torch.eye(96), 64)
    with pytest.raises(ValueError, match=r"Hessian must be \[K, K\]"):
        gptq_quantize(torch.randn(4, 64), torch.eye(32), 32)
