"""AWQ (Lin et al., 2023): protect the weights that meet large activations by scaling them up before rounding.

For y = W x, any per-input-channel s > 0 gives the same product y = (W · diag(s)) (x / s).  Rounding W·s to int4
groups makes the *relative* error of a scaled-up column smaller, and the columns that matter are those whose
inputs are large.  AWQ takes s = mean|x|^α per input channel (from calibration activations), normalised so
max(s)·min(s) = 1, and picks α on a grid in [0, 1) by the output error ‖X Wᵀ - (X / s) Q(W·s)ᵀ‖² on calibration
rows (α = 0 is plain round-to-nearest, so the search can only match or beat it on those rows).

The 1/s on the input is folded into whatever produced it, so the model runs plain int4 ``QuantLinear``s with no
extra op (the same packed format and kernels as ``quantization="int4"``):
- qkv_proj and gate_up_proj: into the RMSNorm weight before them;
- o_proj: into the v rows of qkv_proj (attention is linear in V).  With grouped K/V heads one V channel feeds
  every query head of its group, so s is searched tied across the group (one value per (KV head, d));
- down_proj: into the up rows of gate_up_proj (silu(gate) · up is linear in up).
Not done here: AWQ's weight-clipping search (a second, smaller gain).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minillm.quant.weight import fit_group_size, quantize_int4

GRID = 20  # α ∈ {0, 0.05, …, 0.95}, the AWQ paper's grid
MAX_ROWS = 256  # calibration rows the loss is evaluated on (the statistic mean|x| uses all of them)


def _normalise(s: Tensor) -> Tensor:
    s = s.clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


def search_scales(w: Tensor, x: Tensor, group_size: int, grid: int = GRID, stat: Tensor | None = None,
                  max_rows: int = MAX_ROWS) -> tuple[Tensor, float]:
    """w [N, K], x [n, K] calibration inputs -> (s [K], the α chosen).  ``stat`` [K]: the per-channel mean|x| to
    raise to α (default: from x; o_proj passes its group-tied one).  The loss uses ``max_rows`` evenly spaced rows."""
    w, x = w.float(), x.float()
    stat = x.abs().mean(0) if stat is None else stat
    rows = x[torch.linspace(0, x.shape[0] - 1, min(max_rows, x.shape[0]), device=x.device).long()]
    y = rows @ w.T
    best = (float("inf"), torch.ones_like(stat), 0.0)
    for i in range(grid):
        alpha = i / grid
        s = _normalise(stat.pow(alpha))
        wq = quantize_int4(w * s, group_size).dequantize() / s  # what the layer computes with, on x
        loss = float((rows @ wq.T - y).pow(2).mean())
        if loss < best[0]:
            best = (loss, s, alpha)
    return best[1], best[2]


def _scale_rows(linear: nn.Module, rows: slice, s: Tensor) -> None:
    """Divide output rows ``rows`` of a float linear (and its bias) by s [rows]."""
    linear.weight[rows] /= s[:, None].to(linear.weight.dtype)
    if linear.bias is not None:
        linear.bias[rows] /= s.to(linear.bias.dtype)


def fold_scales(layer: nn.Module, config, scales: dict[str, Tensor]) -> None:
    """Multiply each linear's columns by its s (``scales``: module name -> s [K]) and divide where its input comes
    from by s, in place on a float decoder layer — the layer computes the same function (up to fp rounding).
    o_proj's s must be tied across each K/V head's query group (one value per (KV head, d))."""
    attn, mlp = layer.self_attn, layer.mlp
    hq, hkv, D, F = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    for name, s in scales.items():  # W · diag(s): every linear's columns
        w = layer.get_submodule(name).weight
        w *= s.to(w.dtype)
    norm1, norm2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
    norm1 /= scales["self_attn.qkv_proj"].to(norm1.dtype)
    norm2 /= scales["mlp.gate_up_proj"].to(norm2.dtype)
    s_o = scales["self_attn.o_proj"].view(hkv, hq // hkv, D)
    if not torch.equal(s_o, s_o[:, :1].expand_as(s_o)):
        raise ValueError("o_proj's scales must be equal across the query heads that share a K/V head")
    v_rows = slice(config.q_size + config.kv_size, config.q_size + 2 * config.kv_size)
    _scale_rows(attn.qkv_proj, v_rows, s_o[:, 0].reshape(-1))  # one per V channel
    _scale_rows(mlp.gate_up_proj, slice(F, 2 * F), scales["mlp.down_proj"])  # the up rows


def awq_layer_quantizer(config, group_size: int = 128, grid: int = GRID):
    """A ``calibrate.LayerQuantizer``: searches s for the four linears of a decoder layer on their captured inputs,
    folds them in (``fold_scales``), then rounds W·s to int4 groups (``weight.fit_group_size`` per K)."""

    hq, hkv, D = config.num_heads, config.num_kv_heads, config.head_dim

    @torch.no_grad()
    def quantize_layer(layer, inputs: dict[str, Tensor]) -> dict:
        g = {n: fit_group_size(layer.get_submodule(n).weight.shape[1], group_size) for n in inputs}
        o_stat = inputs["self_attn.o_proj"].abs().mean(0).view(hkv, hq // hkv, D).mean(1)  # tied per (KV head, d)
        stats = {"self_attn.o_proj": o_stat[:, None, :].expand(hkv, hq // hkv, D).reshape(-1)}
        scales = {n: search_scales(layer.get_submodule(n).weight, x, g[n], grid, stat=stats.get(n))[0]
                  for n, x in inputs.items()}
        fold_scales(layer, config, scales)
        return {name: quantize_int4(layer.get_submodule(name).weight.detach(), g[name]) for name in inputs}

    return quantize_layer
