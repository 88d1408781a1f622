"""Checkers of notebook 04: attention kernels."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minillm.course.checks.registry import _passed, exercise
from minillm.course.checks.roofline import prediction_checker


def _score_tolerance(q: torch.Tensor, k: torch.Tensor, scale: float) -> dict:
    """assert_close's fp32 defaults, unless scores are large: one fp32 ulp of a score near 100 is ~1e-5, which
    exp() turns into a relative error of ~1e-5 in every weight, whatever the order of the sums."""
    big = ((q.float() @ k.float().transpose(-1, -2)).abs().amax() * scale).item() > 16
    return {"rtol": 1e-4, "atol": 1e-4} if big else {}


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale) v in fp64, the textbook formula: q [..., M, D], k/v [..., N, D] -> [..., M, D] fp32."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return (s.softmax(-1) @ v.double()).float()


@exercise("4.1", "minillm.kernels.reference.merge_attention_partials", "merge partial softmax results",
          "bring every split to one common max before adding; an empty split must weigh nothing")
def check_merge_attention_partials(merge_attention_partials: Callable) -> None:
    """``merge_attention_partials(m, den, o)`` of splits from ``attention_partial`` equals softmax attention over
    all keys: two halves, one split, empty splits first and in the middle, uneven splits, scores whose exp overflows."""
    from minillm.kernels.reference import attention_partial

    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    cases = [  # name, split edges over N = 40 keys, scale
        ("two halves", [0, 20, 40], 0.25),
        ("a single split (nothing to merge)", [0, 40], 0.25),
        ("uneven splits, the last holds one key", [0, 30, 39, 40], 0.25),
        ("an empty split in the middle (m = -inf, den = 0, o = 0)", [0, 10, 10, 40], 0.25),
        ("the first split empty", [0, 0, 25, 40], 0.25),
        ("large scores: exp(score) overflows fp32 unless rescaled by the max", [0, 13, 27, 40], 40.0),
    ]
    for name, edges, scale in cases:
        q = torch.randn(2, 3, 16, generator=g)  # 2 sequences × 3 query heads of one group, D = 16
        k, v = torch.randn(2, 40, 16, generator=g), torch.randn(2, 40, 16, generator=g)
        parts = [attention_partial(q, k[:, a:b], v[:, a:b], scale=scale) for a, b in zip(edges[:-1], edges[1:],
                                                                                            strict=True)]
        m = torch.stack([p[0] for p in parts], dim=-1)  # (2, 3, P)
        den = torch.stack([p[1] for p in parts], dim=-1)  # (2, 3, P)
        o = torch.stack([p[2] for p in parts], dim=-2)  # (2, 3, P, 16)
        got = merge_attention_partials(m.clone(), den.clone(), o.clone())
        expected = _softmax_attention(q, k, v, scale)
        where = (f"{name}: {len(parts)} splits of {[b - a for a, b in zip(edges[:-1], edges[1:], strict=True)]} "
                 f"keys, m {tuple(m.shape)}, den {tuple(den.shape)}, o {tuple(o.shape)}")
        assert isinstance(got, torch.Tensor) and got.shape == expected.shape, (
            f"{where}: returned {tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, "
            f"expected shape {tuple(expected.shape)} (the split axis merged away).")
        assert torch.isfinite(got).all(), (
            f"{where}: the result has inf/NaN at {(~torch.isfinite(got)).nonzero()[:3].tolist()}; expected finite "
            "values. Subtract the largest max M before exponentiating (exp(m − M) ≤ 1), and give empty splits "
            "(m = -inf) weight exp(-inf) = 0.")
        tol = _score_tolerance(q, k, scale)
        torch.testing.assert_close(got.float(), expected, **tol, msg=lambda msg, where=where: (
            f"{where}: the merged output differs from softmax attention over all the keys. Each split's den and o "
            f"were summed under its own max m_p: rescale them by exp(m_p − M) to a common max before adding. {msg}"))
    _passed("4.1")


@exercise("4.2", "minillm.kernels.reference.flash_tile_step", "one tile of FlashAttention's online softmax",
          "everything summed so far is relative to the old max: when a tile raises the max, correct the sums "
          "before adding the tile")
def check_flash_tile_step(flash_tile_step: Callable) -> None:
    """``flash_tile_step`` from the empty state equals ``attention_partial`` of the first tile; folded over all
    tiles (sizes 1 to all keys, ragged, growing scores, GQA-shaped leading dims) the state matches the library's
    step after every tile and acc / den equals softmax attention."""
    from minillm.kernels.reference import attention_partial

    def reference(m, den, acc, q, kt, vt, scale):  # the checker's own fold, in fp32 like the state it checks
        s = torch.einsum("...md,...nd->...mn", q.float(), kt.float()) * scale
        m_new = torch.where(s.amax(-1) > m, s.amax(-1), m)
        p = (s - m_new[..., None]).exp()
        keep = (m - m_new).exp()
        return m_new, den * keep + p.sum(-1), acc * keep[..., None] + torch.einsum("...mn,...nd->...md", p, vt.float())

    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    cases = [  # name, q shape [..., M, D], N keys, tile size, scale, key growth
        ("one tile holding every key", (2, 4, 16), 40, 40, 0.25, False),
        ("tiles of 16 keys, the last one ragged (8)", (2, 4, 16), 40, 16, 0.25, False),
        ("one key per tile", (1, 3, 8), 12, 1, 0.35, False),
        ("scores growing tile after tile (the max keeps rising; exp overflows without it)", (2, 4, 16), 48, 16,
         1.0, True),
        ("GQA: q viewed as [B, H_kv, G·L, D] against k [B, H_kv, N, D]", (1, 2, 6, 8), 24, 10, 8**-0.5, False),
    ]
    for name, q_shape, N, block, scale, growing in cases:
        q = torch.randn(q_shape, generator=g)
        lead, D = q_shape[:-2], q_shape[-1]
        k, v = torch.randn(*lead, N, D, generator=g), torch.randn(*lead, N, D, generator=g)
        if growing:
            k = k * torch.linspace(0.1, 30, N)[:, None]
        where = f"{name}: q {tuple(q.shape)}, k/v {tuple(k.shape)}, tile size {block}, scale {scale:.3g}"
        mine = (torch.full(q_shape[:-1], float("-inf")), torch.zeros(q_shape[:-1]), torch.zeros(q_shape))
        ref = tuple(t.clone() for t in mine)
        for t, start in enumerate(range(0, N, block)):
            kt, vt = k[..., start : start + block, :], v[..., start : start + block, :]
            out = flash_tile_step(*(x.clone() for x in mine), q.clone(), kt.clone(), vt.clone(), scale)
            ref = reference(*ref, q, kt, vt, scale)
            if t == 0:  # from the empty state, one step is exactly this tile's partial softmax
                ref = attention_partial(q, kt, vt, scale=scale)
            assert isinstance(out, tuple) and len(out) == 3, (
                f"{where}: flash_tile_step returned {type(out).__name__}, expected the new state as a tuple "
                "(m, den, acc).")
            for label, got, exp in zip(("m (running max)", "den (running sum of exp)", "acc (unnormalised output)"),
                                       out, ref, strict=True):
                assert isinstance(got, torch.Tensor) and got.shape == exp.shape, (
                    f"{where}, after tile {t}: returned {label} of shape "
                    f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}, expected "
                    f"{tuple(exp.shape)}.")
                step = f"{where}, after tile {t} (keys {start}..{min(N, start + block) - 1})"
                torch.testing.assert_close(got.float(), exp, **_score_tolerance(q, kt, scale),
                                           msg=lambda msg, step=step, label=label: (
                    f"{step}: {label} differs "
                    "from the expected state. When the max rises from m to m_new, everything summed so far was "
                    f"relative to m: multiply den and acc by exp(m − m_new) before adding this tile. {msg}"))
            mine = out
        torch.testing.assert_close((mine[2] / mine[1][..., None]).float(), _softmax_attention(q, k, v, scale),
                                   **_score_tolerance(q, k, scale),
                                   msg=lambda msg, where=where: f"{where}: acc / den after the last tile differs "
                                   f"from softmax attention over all keys. {msg}")
    _passed("4.2")


def _reference_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The checker's own decode attention in fp64: q [B, H_q, D] over each row's first lens[b] keys -> fp32."""
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kk, vv = k[b, h // G, : lens[b]].double(), v[b, h // G, : lens[b]].double()
            out[b, h] = ((kk @ q[b, h].double()) * D**-0.5).softmax(0) @ vv
    return out.float()


@exercise("4.3", "minillm.kernels.triton.decode.decode_partial_program", "the flash-decoding tile loop in Triton",
          "the same online softmax as exercise 4.2, one [BLOCK_N, D] tile of K and V at a time, in base 2; "
          "masked loads for the ragged last tile")
def check_decode_partial_program(decode_partial_program: Callable) -> None:
    """Your pass-1 program, compiled with ``triton.jit`` and launched by the library's flash-decoding (its merge
    kernel included), against the checker's own fp64 attention: GQA, MHA and MQA groups, splits and tiles that cut
    sequences anywhere, a split past a short sequence (must write m = -inf, l = 0), one-key sequences, a head dim
    that is not a power of two.  On CPU it runs in Triton's interpreter (TRITON_INTERPRET=1 before the kernels
    are defined)."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("exercise 4.3 needs the triton package (pip install triton; on CPU it runs interpreted)")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("exercise 4.3 on CPU needs TRITON_INTERPRET=1 set before triton is imported: restart "
                           "the kernel and run the notebook's first cells (they set it)")
    import triton

    from minillm.kernels.triton.decode import decode_attention_triton

    kernel = triton.jit(decode_partial_program)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    cases = [  # name, (H_q, H_kv, S_max, D), seq_lens, split_size, block_n
        ("grouped-query, one split, ragged last tile", (6, 2, 40, 16), [40, 23], 64, 16),
        ("splits and tiles cutting the keys anywhere", (4, 2, 70, 16), [70, 45, 1], 24, 16),
        ("a split past a short sequence (empty range: m = -inf, l = 0, acc = 0)", (4, 1, 64, 16), [64, 5], 16, 16),
        ("multi-head (G = 1), the head dim not a power of two", (3, 3, 33, 24), [33, 17], 32, 16),
        ("multi-query (H_kv = 1), the SmolLM2 group of 3", (3, 1, 50, 64), [50, 49, 2], 20, 32),
    ]
    for name, (Hq, Hkv, S, D), lens, split, block in cases:
        B = len(lens)
        q = torch.randn(B, Hq, D, generator=gen)
        k, v = torch.randn(B, Hkv, S, D, generator=gen), torch.randn(B, Hkv, S, D, generator=gen)
        expected = _reference_decode(q, k, v, lens)
        try:
            got = decode_attention_triton(q.to(device), k.to(device), v.to(device),
                                          torch.tensor(lens, dtype=torch.int32, device=device), split_size=split,
                                          block_n=block, partial_kernel=kernel).cpu()
        except Exception as e:  # the interpreter wraps what the program raised: a stub's NotImplementedError
            if isinstance(e.__cause__, NotImplementedError):  # goes through unchanged, as from any checker
                raise e.__cause__ from None
            raise
        where = (f"{name}: q {tuple(q.shape)}, k/v {tuple(k.shape)}, seq_lens {lens}, {split} keys per split, "
                 f"tiles of {block}")
        assert torch.isfinite(got).all(), (
            f"{where}: the output has inf/NaN at {(~torch.isfinite(got)).nonzero()[:3].tolist()}: an empty key range "
            "must leave m_i = -inf, l_i = 0, acc = 0, and keys past `end` must score -inf (mask them).")
        tol = {} if device == "cpu" else {"rtol": 1e-3, "atol": 1e-3}  # GPU: fp32 dots may run in TF32
        torch.testing.assert_close(got, expected, **tol, msg=lambda m, where=where: (
            f"{where}: the output differs from softmax attention over each sequence's keys. Rescale l_i and acc by "
            f"2^(m_old − m_new) when the max rises; mask keys ≥ end in the scores and in the loads. {m}"))
    _passed("4.3")


check_prediction_attention = prediction_checker(
    "4.0", "prediction_attention", "minillm.course.predictions.predict_attention_gb_s",
    "the GB/s of K/V decode attention reads", "GB/s")


check_prediction_launch = prediction_checker(
    "4.4", "prediction_launch", "minillm.course.predictions.predict_eager_step_ms",
    "the ms of an eager batch-1 decode step", "ms", example=(30.0, 30), kind="floor")
