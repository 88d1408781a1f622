"""Notebook 07's checkers (7.1 quantize, 7.2 quantize_int4, 7.3 int4_linear_ref): each passes the solution, lets the
stub's NotImplementedError through, and fails the mistakes a student plausibly makes — with an AssertionError that
names the input, the expected and the received value."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minillm.course import checks
from minillm.course.checks import EXERCISES
from minillm.quant.formats import Granularity, Quantized, QuantSpec, group_view
from minillm.quant.weight import BLOCK, Int4Weight, int4_linear_ref

ROOT = Path(__file__).resolve().parents[2]


def _build():
    if "course_build" not in sys.modules:
        spec = importlib.util.spec_from_file_location("course_build", ROOT / "course" / "build.py")
        sys.modules["course_build"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["course_build"]


def _rendered(number: str, student: bool):
    ex = EXERCISES[number]
    namespace = dict(vars(importlib.import_module(ex.module)))
    exec(compile(_build().render_exercise(ex, student=student), f"<exercise {number}>", "exec"), namespace)
    return namespace[ex.qualname]


# Wrong answers built on the solution use copies made here, outside any check: while a checker runs, the library's own
# function is hidden (calling it is what a delegating student answer does, and fails as such).
SOLVED_QUANTIZE = EXERCISES["7.1"].answer()
SOLVED_QUANTIZE_INT4 = EXERCISES["7.2"].answer()

CHECKS = {"7.1": checks.check_quantize, "7.2": checks.check_quantize_int4, "7.3": checks.check_int4_linear_ref}


@pytest.mark.parametrize("number", sorted(CHECKS))
def test_solution_cell_passes_and_stub_raises_its_own_exercise(number, capsys):
    CHECKS[number](_rendered(number, student=False))
    assert f"✓ Exercise {number} passed" in capsys.readouterr().out
    with pytest.raises(NotImplementedError, match=f"^Exercise {number}: "):
        CHECKS[number](_rendered(number, student=True))


# ---------------------------------------------------------------------------------------- 7.1 wrong answers
def _quantize_forgetting_zero_point(x, spec):
    """The right scales, but codes round(x / scale) with zero point 0: asymmetric negative values clip to qmin."""
    quantize = SOLVED_QUANTIZE
    ok = quantize(x, spec)
    xg = group_view(x.float(), spec)
    scale = ok.scale.reshape(*xg.shape[:-1], 1)
    q = torch.clamp(torch.round(xg / scale), spec.qmin, spec.qmax).to(ok.q.dtype).reshape(x.shape)
    return Quantized(q, ok.scale, torch.zeros_like(ok.zero_point), spec)


def _quantize_per_tensor_always(x, spec):
    """Right maps, but one scale for the whole tensor whatever the granularity, broadcast to the asked shape."""
    quantize = SOLVED_QUANTIZE
    whole = quantize(x, QuantSpec(spec.bits, spec.symmetric, "tensor", None, spec.clip_ratio))
    if spec.granularity is Granularity.TENSOR:
        return whole
    n = 1 if spec.granularity is Granularity.CHANNEL else x.shape[-1] // spec.group_size
    shape = (*x.shape[:-1], n)
    return Quantized(whole.q, whole.scale.expand(shape), whole.zero_point.expand(shape), spec)


def _quantize_without_clipping(x, spec):
    """Ignores clip_ratio: right whenever it is 1."""
    quantize = SOLVED_QUANTIZE
    return quantize(x, QuantSpec(spec.bits, spec.symmetric, spec.granularity, spec.group_size, 1.0))


@pytest.mark.parametrize("wrong, says", [(_quantize_forgetting_zero_point, "zero_point"),
                                         (_quantize_per_tensor_always, "scale"),
                                         (_quantize_without_clipping, "scale")],
                         ids=["no zero point", "per-tensor instead of per-group", "clip_ratio ignored"])
def test_quantize_mistakes_fail_with_what_was_expected(wrong, says):
    with pytest.raises(AssertionError, match=says) as info:
        checks.check_quantize(wrong)
    assert "expected" in str(info.value) and "seed" in str(info.value)


def test_quantize_that_accepts_a_group_not_dividing_k_fails():
    quantize = SOLVED_QUANTIZE
    def padded(x, spec):  # silently zero-pads K instead of raising
        if spec.granularity is Granularity.GROUP and x.shape[-1] % spec.group_size:
            return quantize(F.pad(x, (0, spec.group_size - x.shape[-1] % spec.group_size)), spec)
        return quantize(x, spec)

    with pytest.raises(AssertionError, match="expected a ValueError"):
        checks.check_quantize(padded)


# ---------------------------------------------------------------------------------------- 7.2 wrong answers
def _pack(q, order):
    N, K = q.shape
    if order == "swapped":  # byte j = q[j] << 4 | q[j + 16]
        qb = q.view(N, K // BLOCK, 2, BLOCK // 2)
        return ((qb[:, :, 0] << 4) | qb[:, :, 1]).reshape(N, K // 2)
    qp = q.view(N, K // 2, 2)  # "adjacent": byte j = q[2j] | q[2j + 1] << 4 (a common layout, not Q4_1's)
    return (qp[..., 0] | (qp[..., 1] << 4)).contiguous()


def _int4_packed(order):
    def quantize_int4_wrong(w, group_size=32, scale_dtype=torch.float16):
        ok = SOLVED_QUANTIZE_INT4(w, group_size, scale_dtype)
        return Int4Weight(_pack(ok.codes(), order), ok.scales, ok.mins, group_size)

    return quantize_int4_wrong


def _quantize_int4_per_tensor_range(w, group_size=32, scale_dtype=torch.float16):
    """One min/max for the whole weight, stored in every group's slot."""
    N, K = w.shape
    lo, hi = w.float().min(), w.float().max()
    d, m = ((hi - lo) / 15).to(scale_dtype), lo.to(scale_dtype)
    q = torch.clamp(torch.round((w.float() - m.float()) / d.float()), 0, 15).to(torch.uint8)
    full = (N, K // group_size)
    return Int4Weight(_pack_q41(q), d.expand(full).contiguous(), m.expand(full).contiguous(), group_size)


def _pack_q41(q):
    N, K = q.shape
    qb = q.view(N, K // BLOCK, 2, BLOCK // 2)
    return (qb[:, :, 0] | (qb[:, :, 1] << 4)).reshape(N, K // 2)


@pytest.mark.parametrize("wrong", [_int4_packed("swapped"), _int4_packed("adjacent"), _quantize_int4_per_tensor_range],
                         ids=["swapped nibbles", "adjacent pairs", "per-tensor range"])
def test_quantize_int4_mistakes_fail_with_what_was_expected(wrong):
    with pytest.raises(AssertionError, match="expected") as info:
        checks.check_quantize_int4(wrong)
    assert "quantize_int4(w [" in str(info.value)


# ---------------------------------------------------------------------------------------- 7.3 wrong answers
def _unpacked(w4, pairing):
    N, K = w4.shape
    p = w4.packed
    if pairing == "swapped":  # high nibble first
        b = p.view(N, K // BLOCK, BLOCK // 2)
        return torch.cat([b >> 4, b & 0x0F], dim=-1).reshape(N, K)
    g = w4.group_size  # pairs j with j + g/2 inside each group: right for g = 32 only
    b = p.view(N, K // g, g // 2)
    return torch.cat([b & 0x0F, b >> 4], dim=-1).reshape(N, K)


def _gemv(pairing, with_mins=True):
    def int4_linear_wrong(x, w4, bias=None):
        N, K = w4.shape
        q = _unpacked(w4, pairing).float().view(N, K // w4.group_size, w4.group_size)
        w = q * w4.scales.float().unsqueeze(-1) + (w4.mins.float().unsqueeze(-1) if with_mins else 0)
        return F.linear(x, w.view(N, K).to(x.dtype), bias)

    return int4_linear_wrong


def _gemv_without_mins(x, w4, bias=None):
    N, K = w4.shape
    b = w4.packed.view(N, K // BLOCK, BLOCK // 2)
    q = torch.cat([b & 0x0F, b >> 4], dim=-1).view(N, K // w4.group_size, w4.group_size).float()
    return F.linear(x, (q * w4.scales.float().unsqueeze(-1)).view(N, K).to(x.dtype), bias)  # forgot + m


def _gemv_via_dequantize(x, w4, bias=None):
    return F.linear(x, w4.dequantize(x.dtype), bias)  # the library's decoder: not the exercise


@pytest.mark.parametrize("wrong", [_gemv("swapped"), _gemv("per-group halves"), _gemv_without_mins,
                                   _gemv_via_dequantize],
                         ids=["swapped nibbles", "pairs j with j + g/2", "no minimum", "calls dequantize"])
def test_int4_gemv_mistakes_fail_with_what_was_expected(wrong):
    with pytest.raises(AssertionError, match="expected"):
        checks.check_int4_linear_ref(wrong)


def test_int4_gemv_pairing_per_group_passes_when_the_group_is_the_block():
    """The per-group-halves mistake is invisible at g = 32; the checker catches it through g = 64 and 128."""
    from minillm.quant.weight import quantize_int4 as q4

    w4 = q4(torch.randn(3, 64), 32)
    x = torch.randn(2, 64)
    torch.testing.assert_close(_gemv("per-group halves")(x, w4), int4_linear_ref(x, w4))


@pytest.mark.parametrize("rounding", ["torch.floor(xg / scale + 0.5)",  # half up
                                      "torch.sign(xg / scale) * torch.floor((xg / scale).abs() + 0.5)"],  # away
                         ids=["half up", "half away from zero"])
def test_quantize_rounding_ties_otherwise_than_half_to_even_fails(rounding):
    """The contract rounds half to even (torch.round); the right answer with another tie rule must fail."""
    ex = EXERCISES["7.1"]
    code = ex.code(student=False)
    assert code.count("torch.round(xg / scale)") == 1
    wrong = ex._run(code.replace("torch.round(xg / scale)", rounding), "tie rule")
    with pytest.raises(AssertionError, match="round half to even"):
        checks.check_quantize(wrong)
