"""Notebook 10's checkers (10.1 the column/row split, 10.2 communication per layer, 10.3 the GPipe schedule): the
library's solution passes, the stubs fail with their own NotImplementedError, and the mistakes a student plausibly
makes fail with a message that names them.  ``WRONG_10`` also feeds ``test_checks.WRONG``."""

from __future__ import annotations

import pytest
import torch

from minillm.course import checks
from minillm.course.checks import EXERCISES
from minillm.perf.tp_cost import ALLREDUCES_PER_LAYER

solved_split = EXERCISES["10.1"].answer()  # a copy: the library's own is hidden while a checker runs
from minillm.perf.hardware import dtype_bytes  # noqa: E402


# ---- 10.1: the split
def _row_split_on_the_wrong_dim(weight, bias, style, rank, world_size, parts=None):
    """Row-parallel cut along the output features (dim 0), as if it were column-parallel."""
    if style == "column":
        return solved_split(weight, bias, style, rank, world_size, parts)
    return weight.chunk(world_size, dim=0)[rank].contiguous(), bias if rank == 0 else None


def _bias_on_every_rank(weight, bias, style, rank, world_size, parts=None):
    """Right weights, but every row-parallel rank keeps the bias: the all-reduce adds it tp times."""
    if style == "column":
        return solved_split(weight, bias, style, rank, world_size, parts)
    return weight.chunk(world_size, dim=1)[rank].contiguous(), bias


def _column_ignores_parts(weight, bias, style, rank, world_size, parts=None):
    """Column split of the whole stack at once: rank 0 gets all of q and no K/V heads."""
    if style == "row":
        return weight.chunk(world_size, dim=1)[rank].contiguous(), bias if rank == 0 else None
    return weight.chunk(world_size, dim=0)[rank].contiguous(), None if bias is None else bias.chunk(world_size)[rank]


def _delegates_split(weight, bias, style, rank, world_size, parts=None):
    from minillm.layers import parallel

    return parallel.shard_linear(weight, bias, style, rank, world_size, parts)


# ---- 10.2: the cost
def _bytes_once(tp, tokens, hidden, dtype, link):
    """Each all-reduce sends the payload n once instead of 2 (tp − 1)/tp × n: right only at tp = 2."""
    if tp == 1:
        return 0.0
    return ALLREDUCES_PER_LAYER * (link.latency_s + tokens * hidden * dtype_bytes(dtype) / link.bandwidth)


def _one_allreduce_per_layer(tp, tokens, hidden, dtype, link):
    """Forgets one of the two all-reduces (the MLP's after down_proj)."""
    if tp == 1:
        return 0.0
    return link.latency_s + 2 * (tp - 1) / tp * tokens * hidden * dtype_bytes(dtype) / link.bandwidth


def _no_latency(tp, tokens, hidden, dtype, link):
    return 0.0 if tp == 1 else 2 * 2 * (tp - 1) / tp * tokens * hidden * dtype_bytes(dtype) / link.bandwidth


# ---- 10.3: the schedule
def _equal_stage_formula(stage_times):
    """(s + j) × t with t the first stage's time: GPipe's picture, wrong once stages differ."""
    t = stage_times[0][0]
    return [[((s + j) * t, (s + j + 1) * t) for j in range(len(row))] for s, row in enumerate(stage_times)]


def _ignores_the_busy_stage(stage_times):
    """Starts when the input is ready, even while the stage still runs the previous micro-batch."""
    out = []
    for s, row in enumerate(stage_times):
        out.append([((out[s - 1][j][1] if s else 0.0),) * 1 + ((out[s - 1][j][1] if s else 0.0) + t,)
                    for j, t in enumerate(row)])
    return out


WRONG_10 = {"10.1": _row_split_on_the_wrong_dim, "10.2": _bytes_once, "10.3": _ignores_the_busy_stage}


@pytest.mark.parametrize("wrong, says", [
    (_row_split_on_the_wrong_dim, "input\\* features = W's columns"),
    (_bias_on_every_rank, "rank 0 only"),
    (_column_ignores_parts, "each\\* stacked part"),
    (_delegates_split, "library's own solution"),
])
def test_split_mistakes_fail_the_checker_by_name(wrong, says):
    with pytest.raises(AssertionError, match=says):
        checks.check_shard_linear(wrong)


@pytest.mark.parametrize("wrong", [_bytes_once, _one_allreduce_per_layer, _no_latency])
def test_cost_mistakes_fail_the_checker(wrong):
    with pytest.raises(AssertionError, match=r"2 \(tp − 1\)/tp"):
        checks.check_layer_comm_time(wrong)


def test_bytes_once_is_right_at_tp_two_so_the_checker_must_try_other_sizes():
    from minillm.perf.tp_cost import LINKS, layer_comm_time

    assert _bytes_once(2, 8, 4096, "bfloat16", LINKS["H100-PCIe"]) == layer_comm_time(2, 8, 4096, "bfloat16",
                                                                                          LINKS["H100-PCIe"])


@pytest.mark.parametrize("wrong", [_equal_stage_formula, _ignores_the_busy_stage])
def test_schedule_mistakes_fail_the_checker(wrong):
    with pytest.raises(AssertionError, match="expected"):
        checks.check_gpipe_schedule(wrong)


@pytest.mark.parametrize("number", ["10.1", "10.2", "10.3"])
def test_library_solutions_pass_and_the_hidden_symbol_is_restored(number, capsys, solution_copy):
    ex = EXERCISES[number]
    solved = ex.reference()
    code = solved.__code__
    ex.check(solution_copy(ex))
    assert f"✓ Exercise {number} passed" in capsys.readouterr().out
    assert ex.reference() is solved and solved.__code__ is code  # restored after the check


def test_a_split_with_the_wrong_dim_cannot_hide_behind_square_shapes():
    w = torch.randn(6, 6)
    right = solved_split(w, None, "row", 0, 2)[0]
    wrong = _row_split_on_the_wrong_dim(w, None, "row", 0, 2)[0]
    assert right.shape == (6, 3) and wrong.shape == (3, 6)  # rectangular here; the checker's square cases catch it
