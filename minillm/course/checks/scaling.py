"""Checkers of notebook 10: scaling out.

Each checker computes what it expects with its own small reference (never the library's solution, which is hidden
while the checker runs so that a student function delegating to it fails) on fresh random inputs and edge cases:
sizes where a wrong split has the right shape (square weights), tensor-parallel sizes where a wrong ring factor
happens to be right (tp = 2: 2 (tp − 1)/tp = 1), stage times where a formula for equal stages is wrong.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import random
from collections.abc import Callable, Iterator

import torch

from minillm.course.checks.registry import _close, _passed, exercise


@contextlib.contextmanager
def _hidden(module: str, *names: str) -> Iterator[None]:
    """Replace ``module.name`` for each name by a function that fails, for the duration of a check."""
    mod = importlib.import_module(module)
    solved = {n: getattr(mod, n) for n in names}

    def refuse(*args, **kwargs):
        raise AssertionError(f"your function called the library's own solution in {module}: expected your own code")

    for n in names:
        setattr(mod, n, refuse)
    try:
        yield
    finally:
        for n, f in solved.items():
            setattr(mod, n, f)


# ---------------------------------------------------------------------------------------------- 10.1
@exercise("10.1", "minillm.layers.parallel.shard_linear", "the column/row split of a linear layer",
          "column: split W's rows (and b) part by part with .split(parts) then .chunk(world_size)[rank] and cat; "
          "row: W.chunk(world_size, dim=1)[rank], the bias on rank 0 only")
def check_shard_linear(shard_linear: Callable) -> None:
    """``shard_linear(weight, bias, style, rank, world_size, parts)`` against shards cut here, then the
    Megatron identities: concatenated column outputs are the whole output, summed row outputs are the whole."""
    with _hidden("minillm.layers.parallel", "shard_linear"):
        _check_shard_linear(shard_linear)
    _passed("10.1")


def _ref_column(w, parts, rank, tp):
    rows, at = [], 0
    for size in parts:
        step = size // tp
        rows.append(w[at + rank * step : at + (rank + 1) * step])
        at += size
    return torch.cat(rows)


def _check_shard_linear(shard_linear: Callable) -> None:
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    cases = [(8, 8, None, 2), (12, 12, None, 3), (24, 16, (8, 8, 8), 2), (32, 8, (16, 8, 8), 4),
             (12, 20, (6, 6), 2), (6, 6, None, 1)]
    for N, K, parts, tp in cases:
        w, b, x = (torch.randn(N, K, generator=g), torch.randn(N, generator=g), torch.randn(3, K, generator=g))
        w0, b0 = w.clone(), b.clone()
        whole = x @ w.T + b
        cols, rows = [], []
        for rank in range(tp):
            call = f"shard_linear(W [{N}, {K}], b [{N}], {{style}}, rank={rank}, world_size={tp}, parts={parts})"
            wc, bc = shard_linear(w, b, "column", rank, tp, parts)
            expect = _ref_column(w, parts or (N,), rank, tp)
            assert torch.equal(wc, expect), (
                f"{call.format(style='column')}: the weight shard is wrong (shape {tuple(wc.shape)}, expected "
                f"{tuple(expect.shape)}). Column-parallel keeps output features = W's rows; with parts={parts} the "
                "rank takes its 1/tp of *each* stacked part (whole q, k and v heads), in the same order.")
            assert bc is not None and torch.equal(bc, _ref_column(b[:, None], parts or (N,), rank, tp)[:, 0]), (
                f"{call.format(style='column')}: the bias shard is wrong: it must be split exactly as the rows are")
            cols.append(x @ wc.T + bc)
            wr, br = shard_linear(w, b, "row", rank, tp, None)
            expect = w[:, rank * (K // tp) : (rank + 1) * (K // tp)]
            assert torch.equal(wr, expect), (
                f"{call.format(style='row')}: the weight shard is wrong (shape {tuple(wr.shape)}, expected "
                f"{tuple(expect.shape)}). Row-parallel splits the *input* features = W's columns (dim 1): the rank "
                "multiplies its slice of x by them and gets a partial sum of the whole output.")
            assert (br is not None) == (rank == 0), (
                f"{call.format(style='row')}: returned a bias {'on' if br is not None else 'missing from'} rank "
                f"{rank}. The all-reduce adds every rank's partial, so a bias held by every rank would be added "
                f"{tp} times: keep it on rank 0 only.")
            rows.append(x[:, rank * (K // tp) : (rank + 1) * (K // tp)] @ wr.T + (br if br is not None else 0))
        assert torch.equal(w, w0) and torch.equal(b, b0), "shard_linear modified the weight or bias it was given"
        assert torch.allclose(sum(rows), whole, rtol=1e-5, atol=1e-5), (  # fp32 sums in another order
            f"W [{N}, {K}], tp={tp}: the all-reduced (summed) row-parallel outputs differ from the whole layer's")
        # column outputs: each part's rank slices, concatenated in rank order, are that part of the whole output
        at = 0
        for size in parts or (N,):
            got = torch.cat([c[:, at // tp : (at + size) // tp] for c in cols], dim=-1)
            assert torch.allclose(got, whole[:, at : at + size], rtol=1e-5, atol=1e-5), (
                f"W [{N}, {K}], tp={tp}: the ranks' column-parallel outputs of a part of {size} features, side by "
                "side in rank order, are not that part of the whole layer's output")
            at += size
    w = torch.randn(4, 4, generator=g)
    wr, br = shard_linear(w, None, "row", 1, 2, None)
    assert br is None and torch.equal(wr, w[:, 2:]), "shard_linear(W [4, 4], bias=None, 'row', rank 1 of 2): wrong"


# ---------------------------------------------------------------------------------------------- 10.2
def _ref_comm(tp, tokens, hidden, nbytes, alpha, beta):
    if tp == 1:
        return 0.0
    ring = 2 * (tp - 1) / tp * tokens * hidden * nbytes  # one rank's sends in one ring all-reduce
    return 2 * (alpha + ring / beta)  # two all-reduces per layer


@exercise("10.2", "minillm.perf.tp_cost.layer_comm_time", "communication per decoder layer",
          "two all-reduces per layer (after o_proj and down_proj); each costs latency + 2(tp−1)/tp × tokens × hidden "
          "× bytes per element / bandwidth; 0 at tp = 1")
def check_layer_comm_time(layer_comm_time: Callable) -> None:
    """``layer_comm_time(tp, tokens, hidden, dtype, link)`` on random links and sizes, tp in 1..8."""
    from minillm.perf import tp_cost

    with _hidden("minillm.perf.tp_cost", "layer_comm_time", "allreduce_bytes", "layer_allreduce_bytes"):
        _check_layer_comm_time(layer_comm_time, tp_cost.Link)
    _passed("10.2")


def _check_layer_comm_time(layer_comm_time: Callable, Link) -> None:
    rng = random.Random()
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
    cases = [(1, 1, 4096, "bfloat16"), (2, 1, 8192, "bfloat16"), (4, 1, 8192, "bfloat16"), (8, 16, 8192, "float32")]
    cases += [(rng.choice([2, 3, 4, 8]), rng.randint(1, 512), rng.choice([576, 4096, 8192]),
               rng.choice(list(sizes))) for _ in range(8)]
    for tp, tokens, hidden, dtype in cases:
        link = Link("test link", rng.uniform(1e9, 900e9), rng.choice([0.0, rng.uniform(1e-6, 50e-6)]), "made up")
        got = layer_comm_time(tp, tokens, hidden, dtype, link)
        want = _ref_comm(tp, tokens, hidden, sizes[dtype], link.latency_s, link.bandwidth)
        assert _close(got, want, rel=1e-9, abs_=1e-15), (
            f"layer_comm_time(tp={tp}, tokens={tokens}, hidden={hidden}, {dtype}, bandwidth "
            f"{link.bandwidth / 1e9:.1f} GB/s, latency {link.latency_s * 1e6:.1f} µs) = {got!r}, expected "
            f"{want:.4g} s. "
            "A layer does 2 all-reduces; a ring all-reduce of n bytes sends 2 (tp − 1)/tp × n per rank "
            "(reduce-scatter then all-gather: not n, which is right only at tp = 2); each also pays the latency.")


# ---------------------------------------------------------------------------------------------- 10.3
def _ref_schedule(times):
    p, m = len(times), len(times[0]) if times else 0
    end = [[0.0] * m for _ in range(p)]
    out = [[(0.0, 0.0)] * m for _ in range(p)]
    for j in range(m):  # micro-batch by micro-batch (the student's loop is likely stage by stage)
        for s in range(p):
            start = max(end[s - 1][j] if s else 0.0, end[s][j - 1] if j else 0.0)
            end[s][j] = start + times[s][j]
            out[s][j] = (start, end[s][j])
    return out


@exercise("10.3", "minillm.distributed.pipeline.gpipe_schedule", "the GPipe micro-batch schedule",
          "stage s starts micro-batch j at max(end of stage s−1 on j, end of stage s on j−1); 0 for the very first")
def check_gpipe_schedule(gpipe_schedule: Callable) -> None:
    """``gpipe_schedule(stage_times)`` on equal and unequal random stage times (1–5 stages, 1–8 micro-batches)."""
    with _hidden("minillm.distributed.pipeline", "gpipe_schedule"):
        _check_gpipe_schedule(gpipe_schedule)
    _passed("10.3")


def _check_gpipe_schedule(gpipe_schedule: Callable) -> None:
    rng = random.Random()
    cases = [[[1.0]], [[0.5] * 4, [0.5] * 4], [[1.0, 1.0], [3.0, 3.0], [1.0, 1.0]]]  # a slow middle stage
    cases += [[[rng.uniform(0.1, 2.0) for _ in range(m)] for _ in range(p)]
              for p, m in ((1, 5), (2, 1), (3, 8), (4, 4), (5, 2))]
    for times in cases:
        p, m = len(times), len(times[0])
        got = gpipe_schedule([list(r) for r in times])
        want = _ref_schedule(times)
        shape_ok = len(got) == p and all(len(r) == m for r in got)
        assert shape_ok, f"gpipe_schedule({p} stages × {m} micro-batches) returned {got!r}: expected [p][m] pairs"
        for s in range(p):
            for j in range(m):
                (a, b), (wa, wb) = got[s][j], want[s][j]
                assert _close(a, wa, abs_=1e-9) and _close(b, wb, abs_=1e-9), (
                    f"stage times {[[round(t, 3) for t in r] for r in times]}: stage {s}, micro-batch {j} runs "
                    f"({a:.4g}, {b:.4g}), expected ({wa:.4g}, {wb:.4g}). It starts when both its input (stage "
                    f"{s - 1} finished micro-batch {j}) and its stage (done with micro-batch {j - 1}) are ready.")
    p, m = 4, 6  # equal stage times: GPipe's (m + p − 1) t
    sched = gpipe_schedule([[0.25] * m for _ in range(p)])
    makespan = max(e for r in sched for _, e in r)
    assert math.isclose(makespan, (m + p - 1) * 0.25), (
        f"4 stages × 6 micro-batches of 0.25 s end at {makespan}, expected (m + p − 1) × t = 2.25 s")
