"""W8A8 models: calibration statistics, SmoothQuant (Xiao et al., 2023) and the module swap.

Rounding activations to int8 fails where a few input *channels* carry values far above the rest in most tokens
(large models' outlier features): a per-token scale spends its 255 levels on the outlier, and every other channel
of the token rounds to a few levels.  Weights have no such channels.  SmoothQuant moves the difficulty from the
activations to the weights: for y = x Wᵀ and any per-input-channel s > 0,

    y = (x / s) (W · diag(s))ᵀ,    s_j = max|X_j|^α / max|W_j|^(1−α)

(``smoothing_factors``; max|X_j| over calibration tokens, max|W_j| over the output rows).  α = 0.5 splits the
range evenly; α → 1 pushes all of it into the weights.  The 1/s costs nothing at run time: it is folded into what
produced x (``smooth_model``):
- qkv_proj: into input_layernorm's weight (RMSNorm(x) · g / s); gate_up_proj: into post_attention_layernorm's;
- down_proj: into the up rows of gate_up_proj (silu(gate) · up is linear in up, so dividing up's row j by s_j
  divides down_proj's input channel j by s_j) — exact, as AWQ does (``quant.awq``);
- o_proj: left unsmoothed, as SmoothQuant does for Llama.  Its input is attention's output, linear in V, but with
  grouped K/V heads one V channel feeds every query head of its group, so s would have to be tied across groups.
The folded float model computes the same function as the original (up to fp32 rounding).

Schemes (``W8A8_SCHEMES``, ``quantize_model_w8a8``): "w8a8" (dynamic per-token activations), "w8a8-static"
(one per-tensor activation scale per linear, max|X| / 127 on the calibration split), "w8a8-smooth" (SmoothQuant's
folding, then dynamic per-token activations), "fp8" (e4m3 weights and per-token activations, CUDA ≥ 8.9 only).
The LM head stays int8 weight-only per channel, as in the weight-only schemes (SmoothQuant keeps it in fp16: its
error lands on every logit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from minillm.layers.linear import Fp8Linear, Linear, QuantLinear, W8A8Linear
from minillm.quant.activation import INT8_MAX, fp8_supported, quantize_fp8
from minillm.quant.apply import quantize_weight, swap_linears, tie_embedding
from minillm.quant.weight import quantize_int8

W8A8_SCHEMES = ("w8a8", "w8a8-static", "w8a8-smooth", "fp8")
CALIBRATED_W8A8 = ("w8a8-static", "w8a8-smooth")  # need activation statistics from the calibration split
DEFAULT_ALPHA = 0.5  # SmoothQuant's default migration strength (0.8 for some larger models)
SMOOTH_FLOOR = 1e-5  # SmoothQuant's floor on both maxima: a channel never seen active gets a finite factor


def check_alpha(alpha: float) -> float:
    """``alpha`` if it is a number in [0, 1]; else ValueError naming the range."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be a number in [0, 1] (0.5 balances activations and weights; "
                         f"0.8 moves more into the weights), got {alpha!r}")
    return float(alpha)


def decoder_linears(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of the decoder layers' linears (``model.layers.i.self_attn.qkv_proj`` ...), not the head."""
    return {n: m for n, m in model.named_modules() if n.startswith("model.layers.") and isinstance(m, Linear)}


@torch.no_grad()
def activation_absmax(model: nn.Module, input_ids: Tensor, batch: int = 2) -> dict[str, Tensor]:
    """{linear name: max |x_j| over every calibration token, per input channel j [K] fp32} for each decoder linear
    of the float ``model``, from causal forwards over ``input_ids`` [n, L] (``batch`` sequences at a time)."""
    linears = decoder_linears(model)
    stats: dict[str, Tensor] = {}

    def hook(name):
        def record(_m, args, _out):
            m = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
            stats[name] = m if name not in stats else torch.maximum(stats[name], m)
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    try:
        ids = input_ids.to(model.device)
        for chunk in ids.split(batch):
            positions = torch.arange(chunk.shape[1], device=ids.device).expand_as(chunk)
            model.hidden_states(chunk, positions)
    finally:
        for h in handles:
            h.remove()
    return stats


def smoothing_factors(act_absmax: Tensor, weight: Tensor, alpha: float) -> Tensor:
    """s [K] = max|X_j|^α / max|W_j|^(1−α) for act_absmax [K] (max |x_j| over calibration tokens) and weight
    [N, K] (max over its N rows); both maxima floored at 1e-5.  Dividing x by s and multiplying W's columns by s
    leaves x Wᵀ unchanged and gives x / s and W · s the same per-channel range max|X_j|^(1−α) · max|W_j|^α."""
    check_alpha(alpha)
    ### BEGIN SOLUTION
    x_max = act_absmax.float().clamp_min(SMOOTH_FLOOR)
    w_max = weight.detach().float().abs().amax(0).clamp_min(SMOOTH_FLOOR)
    return x_max.pow(alpha) / w_max.pow(1 - alpha)
    ### END SOLUTION


@torch.no_grad()
def fold_into_norm(norm_weight: Tensor, linear_weight: Tensor, s: Tensor) -> None:
    """In place: the norm's weight g [K] becomes g / s and the linear's weight W [N, K] becomes W · diag(s), so
    linear(rms_norm(x) · g / s) = linear(rms_norm(x) · g) with the smoothed input (x / s) feeding the linear."""
    ### BEGIN SOLUTION
    norm_weight.copy_((norm_weight.float() / s).to(norm_weight.dtype))
    linear_weight.copy_((linear_weight.float() * s).to(linear_weight.dtype))
    ### END SOLUTION


@torch.no_grad()
def smooth_model(model: nn.Module, act_absmax: dict[str, Tensor], alpha: float = DEFAULT_ALPHA, *,
                 factors: Callable[[Tensor, Tensor, float], Tensor] | None = None,
                 fold: Callable[[Tensor, Tensor, Tensor], None] | None = None) -> dict[str, Tensor]:
    """SmoothQuant on a float ``Transformer``, in place: per decoder layer, qkv_proj's factors folded into
    input_layernorm, gate_up_proj's into post_attention_layernorm, down_proj's into gate_up_proj's up rows (see the
    module doc); o_proj is left as it is.  ``act_absmax``: ``activation_absmax`` of this model before smoothing.
    ``factors`` / ``fold``: other implementations of ``smoothing_factors`` / ``fold_into_norm`` (a notebook passes
    its own).  Returns the statistics of the smoothed model's inputs (max|x_j| / s_j; o_proj's unchanged)."""
    check_alpha(alpha)
    factors, fold = factors or smoothing_factors, fold or fold_into_norm
    out = dict(act_absmax)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        for norm, name in ((layer.input_layernorm, "self_attn.qkv_proj"),
                           (layer.post_attention_layernorm, "mlp.gate_up_proj")):
            lin = layer.get_submodule(name)
            s = factors(act_absmax[p + name], lin.weight, alpha)
            fold(norm.weight, lin.weight, s)
            out[p + name] = act_absmax[p + name] / s
        up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
        F = down.weight.shape[1]
        s = factors(act_absmax[p + "mlp.down_proj"], down.weight, alpha)
        up.weight[F:] = (up.weight[F:].float() / s[:, None]).to(up.weight.dtype)  # up's row j feeds channel j
        if up.bias is not None:
            up.bias[F:] = (up.bias[F:].float() / s).to(up.bias.dtype)
        down.weight.copy_((down.weight.float() * s).to(down.weight.dtype))
        out[p + "mlp.down_proj"] = act_absmax[p + "mlp.down_proj"] / s
    return out


def outlier_ratios(act_absmax: dict[str, Tensor]) -> dict[str, float]:
    """{linear name: max_j / median_j of max|x_j|}: how far the largest input channel stands above a typical one
    (1 for a flat profile; the rounding step of a per-token int8 scale grows with it)."""
    return {n: float(a.max() / a.median().clamp_min(SMOOTH_FLOOR)) for n, a in act_absmax.items()}


def check_w8a8_scheme(scheme: str, alpha: float | None = None) -> None:
    """ValueError unless ``scheme`` is one of ``W8A8_SCHEMES`` and ``alpha`` (w8a8-smooth only) is in [0, 1]."""
    if scheme not in W8A8_SCHEMES:
        raise ValueError(f"activation-quantization scheme must be one of {W8A8_SCHEMES}, got {scheme!r}")
    if alpha is not None:
        if scheme != "w8a8-smooth":
            raise ValueError(f"alpha applies to quantization='w8a8-smooth' only, got it with {scheme!r}")
        check_alpha(alpha)


@torch.no_grad()
def quantize_model_w8a8(model: nn.Module, scheme: str, calibration_ids: Tensor | None = None,
                        alpha: float | None = None, head_scheme: str = "int8",
                        act_absmax: dict[str, Tensor] | None = None) -> nn.Module:
    """Swap every decoder ``Linear`` of a float ``Transformer`` for a ``W8A8Linear`` (int8 weights per channel)
    or, for "fp8", an ``Fp8Linear``; the LM head becomes an int8 weight-only ``QuantLinear`` (``head_scheme``) and
    a tied embedding shares its codes.  "w8a8-static" and "w8a8-smooth" first measure ``activation_absmax`` on
    ``calibration_ids`` [n, L] (the calibration split; ValueError without it); "w8a8-smooth" then folds
    SmoothQuant's factors (``alpha``, default 0.5) into the float model before rounding.  In place; returns
    ``model``.  ``act_absmax``: this model's ``activation_absmax``, already measured (the calibration pass is
    then skipped: a sweep over α measures once).  ValueError for "fp8" where the device has no fp8 GEMM (the
    message says what to use)."""
    check_w8a8_scheme(scheme, alpha)
    if scheme == "fp8" and (why := fp8_supported(model.device)) is not None:
        raise ValueError(why)
    stats = None
    if scheme in CALIBRATED_W8A8:
        if calibration_ids is None and act_absmax is None:
            raise ValueError(f"quantization={scheme!r} calibrates activation statistics: pass calibration_ids "
                             "[n, L] (quant.calibrate.calibration_token_ids(tokenizer))")
        stats = activation_absmax(model, calibration_ids) if act_absmax is None else act_absmax
        if scheme == "w8a8-smooth":
            stats = smooth_model(model, stats, DEFAULT_ALPHA if alpha is None else alpha)

    def make(name: str, m: Linear) -> nn.Module:
        bias = None if m.bias is None else m.bias.detach()
        if name == "lm_head":
            return QuantLinear(quantize_weight(m.weight, head_scheme), bias)
        if scheme == "fp8":
            return Fp8Linear(quantize_fp8(m.weight), bias)
        scale = stats[name].max() / INT8_MAX if scheme == "w8a8-static" else None
        return W8A8Linear(quantize_int8(m.weight.detach()), bias, scale)

    swap_linears(model, make)
    if getattr(model.config, "tie_word_embeddings", False):
        tie_embedding(model)
    return model
