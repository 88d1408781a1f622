"""GPTQ (Frantar et al., 2022): int4 weights chosen column by column so each column's rounding error is
compensated by the columns not yet quantized, weighted by the layer's input statistics.

For a linear y = W x with calibration inputs X [n, K], the output error of a quantized Ŵ is
‖(W - Ŵ) Xᵀ‖² = Σ_rows (w - ŵ) H (w - ŵ)ᵀ with H = XᵀX / n (the Hessian of that loss, K × K).  Quantizing column
j alone costs err_j = (w_j - q(w_j)) / [H⁻¹]_jj, and the optimal fix-up of the not-yet-quantized columns
j+1.. is w_{j+1:} -= err_j · [H⁻¹]_{j, j+1:} (Optimal Brain Surgeon, one column at a time, same order for every
row).  With U the upper Cholesky factor of H⁻¹, row j of U holds exactly those coefficients, computed once.

- dampening: H += ``damp`` · mean(diag H) · I keeps H invertible (dead or collinear input channels);
- lazy batch updates: columns are processed in blocks of ``block_size``; inside a block the fix-ups touch only
  the block, and the rest of W gets the block's accumulated error in one matmul (Err [N, B] @ U [B, K-…]) —
  the same result with far less memory traffic;
- groups: each group of ``group_size`` columns gets its Q4_1 scale and minimum from its (already updated)
  weights when the sweep reaches its first column, so the packed result is the same ``Int4Weight`` the
  kernels run (``quant/weight.py``): no new format, no new kernel.

Cost per linear: O(N·K²) flops (the block updates) + K small column steps.  Not done here: act-order (columns
by decreasing diag H), which helps at larger models but reorders groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minillm.quant.weight import BLOCK, Int4Weight, fit_group_size, pack_int4

DAMP = 0.01  # the GPTQ paper's default: 1 % of the mean diagonal


def hessian(x: Tensor) -> Tensor:
    """x [n, K] calibration inputs -> H = xᵀx / n [K, K] fp32."""
    x = x.float()
    return x.T @ x / x.shape[0]


def q4_params(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, g] one group's weights -> (d, m) [N] fp16 as ``quantize_int4`` picks them: d = (max - min) / 15,
    m = min."""
    lo, hi = w.amin(-1), w.amax(-1)
    return ((hi - lo) / 15).half(), lo.half()


def q4_round(w: Tensor, d: Tensor, m: Tensor) -> Tensor:
    """w [N] -> codes [N] in 0..15 for the group's fp16 (d, m) (a zero-range group: code 0, w = m)."""
    df, mf = d.float(), m.float()
    inv = torch.where(df > 0, 1 / df, torch.zeros_like(df))
    return torch.clamp(torch.round((w - mf) * inv), 0, 15)


def gptq_quantize(w: Tensor, h: Tensor, group_size: int = 128, damp: float = DAMP,
                  block_size: int = 128) -> Int4Weight:
    """w [N, K] float, h [K, K] (``hessian`` of the inputs) -> ``Int4Weight`` (Q4_1 groups of ``group_size``, a
    multiple of 32 dividing K).  ``block_size`` (rounded to a multiple of the group) is the lazy-update width."""
    N, K = w.shape
    if h.shape != (K, K):
        raise ValueError(f"the Hessian must be [K, K] = [{K}, {K}], got {tuple(h.shape)}")
    if group_size % BLOCK or K % group_size:
        raise ValueError(f"group_size {group_size} must be a multiple of {BLOCK} dividing K={K}")
    W, H = w.detach().float().clone(), h.float().clone()
    dead = H.diagonal() == 0  # an input channel that never fired: its weights cannot matter, zero them
    H[dead, dead] = 1
    W[:, dead] = 0
    H.diagonal().add_(damp * H.diagonal().mean())
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # H⁻¹ = UᵀU
    codes = torch.zeros(N, K, device=W.device)
    d = torch.zeros(N, K // group_size, dtype=torch.float16, device=W.device)
    m = torch.zeros_like(d)
    width = group_size * max(1, block_size // group_size)  # blocks hold whole groups
    for b0 in range(0, K, width):
        b1 = min(b0 + width, K)
        Wb, Err = W[:, b0:b1].clone(), torch.zeros(N, b1 - b0, device=W.device)
        for j in range(b1 - b0):
            col = b0 + j
            if col % group_size == 0:  # a new group: its scale and minimum from its updated weights
                g = col // group_size
                d[:, g], m[:, g] = q4_params(Wb[:, j : j + group_size])
            g = col // group_size
            q = q4_round(Wb[:, j], d[:, g], m[:, g])
            codes[:, col] = q
            err = (Wb[:, j] - (q * d[:, g].float() + m[:, g].float())) / U[col, col]
            Wb[:, j:] -= err[:, None] * U[col, col:b1][None, :]  # fix up the rest of the block
            Err[:, j] = err
        W[:, b1:] -= Err @ U[b0:b1, b1:]  # the lazy update of every later column, one matmul
    return Int4Weight(pack_int4(codes.to(torch.uint8)), d, m, group_size)


def gptq_layer_quantizer(group_size: int = 128, damp: float = DAMP):
    """A ``calibrate.LayerQuantizer``: each linear of a decoder layer by ``gptq_quantize`` with the Hessian of its
    captured inputs, in the group size ``weight.fit_group_size`` fits to its K."""

    def quantize_layer(layer, inputs: dict[str, Tensor]) -> dict:
        out = {}
        for name, x in inputs.items():
            w = layer.get_submodule(name).weight
            out[name] = gptq_quantize(w, hessian(x), fit_group_size(w.shape[1], group_size), damp)
        return out

    return quantize_layer
