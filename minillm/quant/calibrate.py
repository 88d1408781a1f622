"""Calibration for activation-aware weight quantization (AWQ, GPTQ): run the model layer by layer on calibration
text and hand each decoder layer's linear inputs to a quantizer.

Text: the *calibration* half of ``pydoc_data.topics`` (``quant.heldout``); perplexity is measured on the other
half, so no document is both tuned on and scored.

Layer by layer, as GPTQ and AWQ do: the inputs of layer i are produced by layers 0..i-1 *already quantized*, so
each layer's quantizer sees (and compensates for) the error upstream, and only one layer's activations are held at
a time (rows × (3·hidden + intermediate) floats: ~50 MB for 2 048 tokens of SmolLM2-135M).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from minillm.layers.linear import Linear, PackedWeight, QuantLinear
from minillm.quant.heldout import heldout_token_ids

# the four linears of a decoder layer, under their module names (stacked as in models/llama.py)
LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
LayerQuantizer = Callable[[nn.Module, dict[str, Tensor]], dict[str, PackedWeight]]


def calibration_token_ids(tokenizer, num_sequences: int = 8, seq_len: int = 256) -> Tensor:
    """[num_sequences, seq_len] int64: consecutive pieces of the calibration split (never the evaluation one)."""
    ids = heldout_token_ids(tokenizer, "calibration", num_sequences * seq_len)
    if ids.numel() < num_sequences * seq_len:
        raise ValueError(f"the calibration split has {ids.numel()} tokens, fewer than {num_sequences}×{seq_len}")
    return ids.view(num_sequences, seq_len)


def _capture(layer: nn.Module, args: tuple) -> dict[str, Tensor]:
    """Run ``layer(*args)`` with hooks on its linears; -> {name: its input rows [rows, K] fp32}."""
    inputs: dict[str, Tensor] = {}
    hooks = [layer.get_submodule(name).register_forward_hook(
        lambda _m, args, _out, name=name: inputs.__setitem__(name, args[0].reshape(-1, args[0].shape[-1]).float()))
        for name in LAYER_LINEARS]
    try:
        layer(*args)
    finally:
        for h in hooks:
            h.remove()
    return inputs


def swap_packed(layer: nn.Module, packed: dict[str, PackedWeight]) -> None:
    """Replace each named ``Linear`` of ``layer`` by a ``QuantLinear`` over its packed weight (bias kept)."""
    for name, w in packed.items():
        parent, _, child = name.rpartition(".")
        old = layer.get_submodule(name)
        if not isinstance(old, Linear):
            raise TypeError(f"{name} is a {type(old).__name__}, not a float Linear")
        bias = None if old.bias is None else old.bias.detach()
        setattr(layer.get_submodule(parent), child, QuantLinear(w, bias))


@torch.no_grad()
def quantize_layers(model: nn.Module, input_ids: Tensor, quantize_layer: LayerQuantizer) -> nn.Module:
    """For each decoder layer of ``model`` (a float ``Transformer``): capture its four linears' inputs on
    ``input_ids`` [n, L] (calibration text, causal, no cache), call ``quantize_layer(layer, inputs)`` — which may
    also rescale the layer's float weights and norms (AWQ) — and swap in the packed weights it returns; then run the
    quantized layer to make the next layer's inputs.  In place; returns ``model``.  The LM head is left to the
    caller."""
    n, L = input_ids.shape
    ops = model.kernel_ops()
    positions = torch.arange(L, device=input_ids.device).expand(n, L)
    x = model.model.embed_tokens(input_ids.to(model.device))
    cos, sin = model.model.rotary_emb(positions.to(model.device), x.dtype)
    residual = None
    for i, layer in enumerate(model.model.layers):
        inputs = _capture(layer, (x, residual, cos, sin, i, ops))
        swap_packed(layer, quantize_layer(layer, inputs))
        x, residual = layer(x, residual, cos, sin, i, ops)  # (n, L, hidden) through the quantized layer
    return model
