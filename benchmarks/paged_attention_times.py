"""Median time of ``kernels.paged_decode_attention`` at SmolLM2-135M's heads (9 query, 3 K/V, D 64) or Llama-3's
(32 / 8, D 128) with ``--llama``, fp32, 16-token blocks in a random order, for a few (batch, context) points, beside
the dense kernel (``kernels.decode_attention``) on the same keys: paging should cost nothing but the table lookups.
To compare two trees, run it under each in turn:

    PYTHONPATH=/path/to/tree python benchmarks/paged_attention_times.py LABEL [--threads N] [--llama]

and alternate the runs (ratios within one sitting only).
"""
import argparse
import statistics
import time

import torch

from minillm import kernels


def median_seconds(fn, *args, repeat: int = 30) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("label", nargs="?", default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama", action="store_true", help="Llama-3's 32 / 8 heads of 128 instead of SmolLM2's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    H_Q, H_KV, D = (32, 8, 128) if args.llama else (9, 3, 64)
    BS = 16
    for B, S in ((1, 8192), (8, 8192), (32, 128), (1, 512)):
        g = torch.Generator().manual_seed(0)
        per = S // BS
        q = torch.randn(B, H_Q, D, generator=g)
        k_dense, v_dense = (torch.randn(B, H_KV, S, D, generator=g) for _ in range(2))
        order = torch.randperm(B * per, generator=g)  # physical block of each logical block, shuffled
        pools = []
        for dense in (k_dense, v_dense):
            pool = torch.empty(B * per, BS, H_KV, D)
            pool[order] = dense.transpose(1, 2).reshape(B * per, BS, H_KV, D)
            pools.append(pool)
        tables = order.view(B, per).to(torch.int32)
        lens = torch.full((B,), S, dtype=torch.int32)
        paged = median_seconds(kernels.paged_decode_attention, q, *pools, tables, lens)
        dense = median_seconds(kernels.decode_attention, q, k_dense, v_dense, lens)
        gbs = 2 * B * H_KV * S * D * 4 / 1e9
        print(args.label, f"B={B} S={S}: paged {paged * 1e6:.0f} us ({gbs / paged:.1f} GB/s), dense "
              f"{dense * 1e6:.0f} us ({gbs / dense:.1f} GB/s), paged/dense speed {dense / paged:.0%}", flush=True)


if __name__ == "__main__":
    main()
