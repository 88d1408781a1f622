"""Prefill linears on oneDNN-packed weights (``kernels/cpu/onednn.py``) against ``F.linear``, the switch, the
memory rule and repacking after an in-place weight change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minillm.kernels.cpu import onednn

pytestmark = pytest.mark.skipif(not onednn.supported(), reason="this torch has no oneDNN")


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(onednn, "_packed", onednn.WeakIdKeyDictionary())
    monkeypatch.setattr(onednn, "_budget", [])
    monkeypatch.setattr(onednn, "ONEDNN_PACK", "auto")


@pytest.mark.parametrize("rows, n, k", [(64, 960, 576), (37, 576, 1536), (512, 96, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows + n)
    x, w = torch.randn(1, rows, k, generator=g), 0.05 * torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    with torch.inference_mode():
        got = onednn.linear(x, w, b)
    assert onednn.packed_weight(w) is not None  # it did run on a packed copy
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_a_strided_activation_gives_the_same_rows():
    x, w = torch.randn(40, 3, 64)[:, 1], torch.randn(32, 64)
    torch.testing.assert_close(onednn.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_an_in_place_weight_change_is_packed_again():
    x, w = torch.randn(70, 64), torch.randn(48, 64)
    first = onednn.linear(x, w)
    w.mul_(2)
    torch.testing.assert_close(onednn.linear(x, w), 2 * first, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("case", ["off", "bf16", "grad", "inference weight", "over budget"])
def test_what_stays_on_f_linear(case, monkeypatch):
    x, w = torch.randn(70, 64), torch.randn(48, 64)
    if case == "off":
        monkeypatch.setattr(onednn, "ONEDNN_PACK", "off")
    elif case == "bf16":  # "auto" packs fp32 only
        x, w = x.bfloat16(), w.bfloat16()
    elif case == "grad":
        w.requires_grad_(True)
    elif case == "inference weight":
        with torch.inference_mode():
            w = w.clone()
    else:
        monkeypatch.setattr(onednn, "_budget", [w.nbytes - 1])
    got = onednn.linear(x, w)
    assert len(onednn._packed) == 0
    torch.testing.assert_close(got, F.linear(x, w))  # the plain path: the same bits


def test_the_memory_rule_packs_until_the_budget_is_spent(monkeypatch):
    ws = [torch.randn(48, 64) for _ in range(3)]
    monkeypatch.setattr(onednn, "_budget", [2 * ws[0].nbytes])
    x = torch.randn(70, 64)
    for w in ws:
        onednn.linear(x, w)
    assert [onednn.packed_weight(w) is not None for w in ws] == [True, True, False]
    del ws[0]  # a freed weight frees its packed copy and its share of the budget
    assert onednn.packed_weight(ws[1]) is not None and onednn.packed_bytes() == 2 * ws[0].nbytes


def test_the_engine_linear_packs_prefill_rows_only():
    from minillm.kernels import select

    if not select.native.available():
        pytest.skip("the native kernels did not build here")
    linear = select.ops_for("auto", "cpu", torch.float32).linear
    w = torch.randn(48, 64)
    linear(torch.randn(4, 64), w)  # decode rows: the native GEMV
    assert len(onednn._packed) == 0
    x = torch.randn(100, 64)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)
    assert len(onednn._packed) == 1
