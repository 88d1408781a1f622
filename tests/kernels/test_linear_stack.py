"""perf/bench/linear_stack.LinearStack (csrc/decode.c linear_stack): a list of GEMVs in one native call must give each
weight's per-call native result exactly, whichever threading layout runs it and however many threads split the
rows."""

import pytest
import torch

from minillm.kernels.cpu import decode, native
from minillm.kernels.cpu import quant as native_quant
from minillm.perf.bench.linear_stack import LinearStack
from minillm.quant.weight import Int8Weight, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not decode.available(), reason="the native decode library did not build here")


def weights() -> list:
    """Every kind the fused step runs: Q4_1 at groups 32 and 64, int8 per channel and in blocks of 32 (fp16
    scales), int8 with K not a multiple of 32 (the exact kernel), fp32; N·K above quant.c's 2^18 one-thread limit
    for two of them, so the per-GEMV regions split their rows too; and SmolLM2's K = 576 and 1536 at groups of 32
    (Q4_1 takes blocks 16 at a time: one whole group of 16 and a partial one of 2, three whole ones)."""
    g = torch.Generator().manual_seed(0)

    def w(n, k):
        return torch.randn(n, k, generator=g)

    w8h = quantize_int8(w(70, 96), 32)
    return [quantize_int4(w(600, 512), 32), quantize_int4(w(37, 128), 64), quantize_int8(w(520, 576)),
            Int8Weight(w8h.qweight, w8h.scales.half(), 32), quantize_int8(w(33, 80)), w(41, 96),
            quantize_int4(w(22, 576), 32), quantize_int4(w(14, 1536), 32), quantize_int8(w(18, 576))]


def per_call(w, x: torch.Tensor) -> torch.Tensor:
    """The same product through the per-layer path's native kernels (one ctypes call each).  Past their
    MAX_ROWS the quantized ones take a row at a time: a row's result does not depend on the rows beside it."""
    if isinstance(w, torch.Tensor):
        return native.linear(x, w)
    fn = native_quant.int8_linear if isinstance(w, Int8Weight) else native_quant.int4_linear
    if x.shape[0] > native_quant.MAX_ROWS:
        return torch.cat([fn(x[i:i + 1], w) for i in range(x.shape[0])])
    return fn(x, w)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("one_region", [False, True], ids=["region-per-gemv", "one-region"])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_every_output_equals_the_per_call_kernel_bit_for_bit(rows, one_region, threads):
    ws = weights()
    stack = LinearStack(ws, rows)
    g = torch.Generator().manual_seed(rows)
    for x in stack.inputs:
        x.copy_(torch.randn(x.shape, generator=g))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = [y.clone() for y in stack.run(one_region=one_region)]
    finally:
        torch.set_num_threads(before)
    for w, x, y in zip(ws, stack.inputs, got, strict=True):
        assert y.shape == (rows, w.shape[0])
        assert torch.equal(y, per_call(w, x))


def test_inputs_are_shared_per_width_and_a_second_run_overwrites_the_outputs():
    ws = weights()
    stack = LinearStack(ws, 2)
    assert stack.inputs[0] is not stack.inputs[2] and stack.inputs[1].shape == (2, 128)
    assert stack.inputs[5].shape == (2, 96) and stack.inputs[5] is stack.inputs[3]  # K = 96 twice: one tensor
    stack.inputs[0].fill_(1.0)
    first = stack.run()[0].clone()
    stack.inputs[0].fill_(-1.0)
    assert torch.equal(stack.run()[0], per_call(ws[0], stack.inputs[0]))
    assert not torch.equal(first, stack.outputs[0])


def test_it_refuses_other_weights_and_row_counts():
    with pytest.raises(ValueError, match="rows"):
        LinearStack(weights(), 0)
    with pytest.raises(ValueError, match="rows"):
        LinearStack(weights(), decode.MAX_ROWS + 1)
    with pytest.raises(ValueError, match="Int8Weight"):
        LinearStack([object()], 1)
    with pytest.raises(ValueError, match="contiguous"):
        LinearStack([torch.randn(64, 32).T], 1)
    with pytest.raises(ValueError, match="fp32"):  # bf16 weights run only in the bf16 decode step
        LinearStack([torch.randn(64, 32, dtype=torch.bfloat16)], 1)


@pytest.mark.parametrize("threads", [1, 2])
def test_read_only_reads_every_stored_byte_of_every_weight(threads):
    """One nonzero byte anywhere in the codes, scales or mins of any weight makes the read nonzero; all zeros read 0."""
    g = torch.Generator().manual_seed(1)
    ws = weights()
    parts = []  # every stored tensor of every weight, zeroed in place
    for w in ws:
        for t in ([w] if isinstance(w, torch.Tensor) else [w.qweight, w.scales] if isinstance(w, Int8Weight)
                  else [w.packed, w.scales, w.mins]):
            t.zero_()
            parts.append(t)
    stack = LinearStack(ws, 1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert stack.read_only() == 0
        for t in parts:
            flat = t.view(torch.uint8).view(-1)
            for i in (0, flat.numel() // 2, flat.numel() - 1, int(torch.randint(flat.numel(), (1,), generator=g))):
                flat[i] = 0x40
                assert stack.read_only() != 0, (t.shape, i)
                flat[i] = 0
    finally:
        torch.set_num_threads(before)
