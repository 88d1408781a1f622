"""Quantized GEMV benchmark: fp32 ``F.linear`` next to the native int8 and int4 (Q4_1) kernels over SmolLM2-135M's
layer stack, in GB/s counted in *stored* bytes (packed codes + scales), the roofline unit of a bandwidth-bound
decode.  Every layer gets its own weights, so the stack (≈ 390 MB fp32, 100 MB int8, 61 MB int4 over 30 layers)
is streamed from memory, not served from cache, as in a real decode step.  Not a test: it times, it asserts
nothing.  On a shared machine the numbers move with the neighbours' load; compare ratios within one run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from minillm.quant.weight import quantize_int4, quantize_int8

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query / 3 KV heads of 64 -> (N, K) of each linear per layer
SMOLLM2_LAYER_SHAPES = ((576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536))  # qkv, o, gate_up, down
SMOLLM2_LAYERS = 30


def _stack_pass(fn: Callable, xs: dict[int, torch.Tensor], weights: list) -> float:
    """Seconds for one pass over every weight in order; ``xs[K]`` is the input for a weight with K columns."""
    t0 = time.perf_counter()
    for w in weights:
        fn(xs[w.shape[1]], w)
    return time.perf_counter() - t0


def _read_pass(buf: torch.Tensor) -> float:
    """Seconds for one streaming read of ``buf`` (native.read_sum: the roof the GEMVs are compared with)."""
    from minillm.kernels.cpu import native

    t0 = time.perf_counter()
    native.read_sum(buf)
    return time.perf_counter() - t0


def bench_quant_gemv(rows: int = 1, layers: int = SMOLLM2_LAYERS, repeats: int = 5, group_size: int = 32,
                     seed: int = 0, read_bandwidth: bool = True) -> list[dict]:
    """Time y = x @ W.T over ``layers`` × SmolLM2's four linears with ``rows`` input rows (1..8): fp32 F.linear,
    native int8 (per-channel) and native int4 (Q4_1, ``group_size``), each with int8 activations (the default
    kernels) and exact fp32 activations.  The schemes take turns within every repeat and each keeps its best pass
    (on a shared machine the least-disturbed one), so their ratios come from the same minutes.  With
    ``read_bandwidth`` a 256 MiB streaming read takes its turn too, and every scheme reports its stored-bytes rate
    as a share of it (``pct_of_read``).  Returns one dict per scheme: ms per stack, stored MB, GB/s (stored bytes /
    time), speed-up over fp32 and, for the read probe, scheme "read bandwidth"."""
    from minillm.kernels.cpu import native
    from minillm.kernels.cpu import quant as native_quant

    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(n, k, generator=g) * 0.02 for _ in range(layers) for n, k in SMOLLM2_LAYER_SHAPES]
    xs = {k: torch.randn(rows, k, generator=g) for _, k in SMOLLM2_LAYER_SHAPES}
    schemes: list[tuple[str, Callable, list, int]] = [("fp32 F.linear", F.linear, dense, sum(w.nbytes for w in dense))]
    if native_quant.available():
        w8 = [quantize_int8(w) for w in dense]
        w4 = [quantize_int4(w, group_size) for w in dense]
        n8, n4 = sum(w.nbytes for w in w8), sum(w.nbytes for w in w4)
        schemes += [("int8 native", native_quant.int8_linear, w8, n8),
                    ("int8 native exact", lambda x, w: native_quant.int8_linear(x, w, exact=True), w8, n8),
                    (f"int4 g{group_size} native", native_quant.int4_linear, w4, n4),
                    (f"int4 g{group_size} exact", lambda x, w: native_quant.int4_linear(x, w, exact=True), w4, n4)]
    buf = torch.ones(256 << 18) if read_bandwidth and native.available() else None  # 256 MiB fp32, ≫ L3
    best = {name: float("inf") for name, *_ in schemes} | ({"read bandwidth": float("inf")} if buf is not None else {})
    with torch.inference_mode():
        for _name, fn, weights, _ in schemes:
            for w in weights[:4]:
                fn(xs[w.shape[1]], w)  # warm-up (and the native library's first-use compile)
        for _ in range(repeats):
            for name, fn, weights, _ in schemes:
                best[name] = min(best[name], _stack_pass(fn, xs, weights))
            if buf is not None:
                best["read bandwidth"] = min(best["read bandwidth"], _read_pass(buf))
    out = [{"scheme": name, "rows": rows, "ms": best[name] * 1e3, "MB": nbytes / 1e6,
            "GB/s": nbytes / best[name] / 1e9} for name, _, _, nbytes in schemes]
    if buf is not None:
        out.append({"scheme": "read bandwidth", "rows": rows, "ms": best["read bandwidth"] * 1e3,
                    "MB": buf.nbytes / 1e6, "GB/s": buf.nbytes / best["read bandwidth"] / 1e9})
    for r in out:
        r["speedup_vs_fp32"] = out[0]["ms"] / r["ms"] if r["scheme"] != "read bandwidth" else float("nan")
        if buf is not None:
            r["pct_of_read"] = 100 * r["GB/s"] / out[-1]["GB/s"]
    return out


def print_table(rows: list[dict]) -> None:
    """One line per scheme."""
    print(f"{'scheme':<20}{'rows':>5}{'ms/stack':>10}{'MB':>8}{'GB/s':>8}{'x fp32':>8}{'% read':>8}")
    for r in rows:
        print(f"{r['scheme']:<20}{r['rows']:>5}{r['ms']:>10.2f}{r['MB']:>8.1f}{r['GB/s']:>8.1f}"
              f"{r['speedup_vs_fp32']:>8.2f}{r.get('pct_of_read', float('nan')):>8.0f}")


if __name__ == "__main__":
    for m in (1, 4, 8):
        print_table(bench_quant_gemv(rows=m))
