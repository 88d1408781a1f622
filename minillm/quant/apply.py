"""Weight-only quantization by module swap (gpt-fast's ``replace_linear_*``): every ``Linear`` of a model becomes a
``QuantLinear`` holding the packed weight, and the float weight is dropped — the model then stores (and a decode
step streams) the packed bytes only.

Schemes (``SCHEMES``):
- ``"int8"``: W8A16, symmetric int8, one fp32 scale per output channel (``group_size`` None) or per group.
- ``"int4"``: W4A16, asymmetric 4-bit groups in llama.cpp's Q4_1 layout (``group_size`` 32 by default; 64 or 128
  where they divide every K).

- ``"awq"`` / ``"gptq"``: the same int4 groups (group 128 by default, ``fit_group_size`` per K), their codes
  chosen on calibration text (``quantize_model_calibrated``: ``quant/awq.py``, ``quant/gptq.py``).

The LM head is quantized too, tied or not, with ``head_scheme`` ("int8" per channel by default whatever the body's
scheme: its error lands directly on every logit, and llama.cpp's Q4 files keep it at 8 bits for the same reason —
the default GGUF's head is Q8_0).  A *tied* embedding then reads its rows from the head's packed table
(``QuantEmbedding``, sharing the head's tensors) instead of keeping a float copy of the largest matrix; an untied
embedding keeps its float table (a lookup reads B rows per step, not the table: it costs memory, not bandwidth).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from minillm.layers.linear import Linear, PackedWeight, QuantEmbedding, QuantLinear
from minillm.quant.weight import (
    INT4_GROUP_SIZES,
    Int4Weight,
    Int8Weight,
    Q6KWeight,
    fit_group_size,
    quantize_int4,
    quantize_int8,
    quantize_q8_0,
)

SCHEMES = ("int8", "int4")
CALIBRATED_SCHEMES = ("awq", "gptq")
CALIBRATED_GROUP_SIZE = 128  # AWQ's and GPTQ's usual group, where it divides K (else 64, then 32)


def check_scheme(scheme: str, name: str = "scheme") -> str:
    """``scheme`` if it is one of ``SCHEMES``; else ValueError listing them."""
    if scheme not in SCHEMES:
        raise ValueError(f"{name} must be one of {SCHEMES}, got {scheme!r}")
    return scheme


def quantize_weight(w: Tensor, scheme: str, group_size: int | None = None) -> PackedWeight:
    """w [N, K] float -> its packed form: "int8" per channel (``group_size`` None) or per group; "int4" Q4_1 groups
    (``group_size`` None = 32).  ValueError when the group does not divide K (the message names the fix)."""
    check_scheme(scheme)
    if scheme == "int8":
        return quantize_int8(w.detach(), group_size)
    return quantize_int4(w.detach(), 32 if group_size is None else group_size)


def cat_rows(weights: list[PackedWeight]) -> PackedWeight:
    """Stack packed weights along N (q;k;v -> qkv_proj, gate;up -> gate_up_proj) by concatenating codes, scales
    and mins row-wise: exact, since every per-row quantity moves with its row.  Same K and group size.
    Symmetric (Q4_0) ``Int4Weight``s stack without mins; beside ones with mins they are stored with m = −8·d
    (``Int4Weight.with_mins``: the same values).  Mixed fp16/fp32 scales stack as fp32 (exact), as do K records
    beside another form; K records beside K records stack as they are (a record belongs to one row).  Int4 groups of 32
    beside int8 ones (a Q4_K_M file's Q6_K attn_v beside Q4_K q/k) stack as int8: the int4 parts re-quantized to
    Q8_0 blocks (``quantize_q8_0``: each weight moves by at most half an 8-bit step, well under its 4-bit one).
    GGUF Q6_K blocks (``Q6KWeight``) stack as they are beside each other, and beside other types as Q8_0 blocks (the
    same re-quantization, well under their 6-bit step)."""
    if all(isinstance(w, Q6KWeight) for w in weights):
        return Q6KWeight(torch.cat([w.blocks for w in weights]))
    weights = [quantize_q8_0(w.dequantize()) if isinstance(w, Q6KWeight) else w for w in weights]
    if any(isinstance(w, Int4Weight) and w.mins is None for w in weights) \
            and not all(isinstance(w, Int4Weight) and w.mins is None for w in weights):
        weights = [w.with_mins() if isinstance(w, Int4Weight) else w for w in weights]
    if len({type(w) for w in weights}) > 1 and all(w.group_size == 32 for w in weights):
        weights = [quantize_q8_0(w.dequantize()) if isinstance(w, Int4Weight) else w for w in weights]
    if len({w.scales.dtype for w in weights}) > 1:
        weights = [_with_fp32_scales(w) for w in weights]
    kinds = {(type(w), w.shape[1], w.group_size, w.scales.dtype) for w in weights}
    if len(kinds) != 1:
        raise ValueError(f"can only stack packed weights of one type, K, group size and scale dtype; got {kinds}")
    if isinstance(weights[0], Int4Weight):
        mins = None if weights[0].mins is None else torch.cat([w.mins for w in weights])
        return Int4Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scales for w in weights]), mins,
                          weights[0].group_size)
    return Int8Weight(torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]),
                      weights[0].group_size)


def _with_fp32_scales(w: PackedWeight) -> PackedWeight:
    """The same weight with fp32 scales (and mins; K records expanded): exact."""
    if isinstance(w, Int4Weight):
        return Int4Weight(w.packed, w.scales_f32(), None if w.mins is None else w.mins_f32(), w.group_size)
    return Int8Weight(w.qweight, w.scales.float(), w.group_size)


def swap_linears(model: nn.Module, make: Callable[[str, Linear], nn.Module]) -> nn.Module:
    """Replace every ``Linear`` submodule ``name`` of ``model`` by ``make(name, linear)``; returns ``model``."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, make(name, module))
    return model


def tie_embedding(model: nn.Module) -> None:
    """Point a tied model's embedding at its quantized head's packed table (``QuantEmbedding``)."""
    head = model.lm_head
    model.model.embed_tokens = QuantEmbedding(head.packed_weight, dtype=model.dtype)


def quantize_model(model: nn.Module, scheme: str, group_size: int | None = None,
                   head_scheme: str = "int8", fit_group: bool = False) -> nn.Module:
    """Swap every ``Linear`` of a ``Transformer`` (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head) for a
    ``QuantLinear`` holding its ``scheme`` packed weight (the LM head: ``head_scheme``, per channel for int8, group
    32 for int4); a tied embedding then shares the head's packed rows.  In place; returns ``model``.

    ``group_size`` (the body's): int8 None = per channel; int4 None = 32, else one of 32/64/128 dividing every K.
    Checked for every layer before any is swapped, so a bad group leaves the model as it was.  ``fit_group``: each
    layer uses ``fit_group_size(K, group_size)`` instead (the rule AWQ and GPTQ follow, for a like-for-like baseline).
    """
    check_scheme(scheme)
    check_scheme(head_scheme, "head_scheme")
    if scheme == "int4" and group_size is not None and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    if fit_group and group_size is not None:
        fitted = {n: group_size if n == "lm_head" else fit_group_size(m.weight.shape[1], group_size)
                  for n, m in linears.items()}
        return _swap_with(model, lambda name, m: quantize_weight(
            m.weight, head_scheme if name == "lm_head" else scheme, None if name == "lm_head" else fitted[name]))
    for name, m in linears.items():
        g = _group(name, scheme, group_size)
        K = m.weight.shape[1]
        if g is not None and K % g:
            fits = [s for s in INT4_GROUP_SIZES if all(x.weight.shape[1] % s == 0 for x in linears.values())]
            raise ValueError(f"group_size {g} does not divide K={K} of {name}: choose a group size that divides "
                             f"every K ({fits}), or None for the default")
    return _swap_with(model, lambda name, m: quantize_weight(
        m.weight, head_scheme if name == "lm_head" else scheme, None if name == "lm_head" else group_size))


def _swap_with(model: nn.Module, pack: Callable[[str, Linear], PackedWeight]) -> nn.Module:
    """Swap every ``Linear`` for a ``QuantLinear`` over ``pack(name, linear)``; a tied embedding then reads the
    head's packed rows."""
    def make(name: str, m: Linear) -> QuantLinear:
        return QuantLinear(pack(name, m), None if m.bias is None else m.bias.detach())

    swap_linears(model, make)
    if getattr(model.config, "tie_word_embeddings", False):
        tie_embedding(model)
    return model


def quantize_model_calibrated(model: nn.Module, scheme: str, calibration_ids: Tensor,
                              group_size: int = CALIBRATED_GROUP_SIZE, head_scheme: str = "int8") -> nn.Module:
    """AWQ or GPTQ (``scheme``) on a float ``Transformer``: layer by layer on ``calibration_ids`` [n, L]
    (``calibrate.quantize_layers``), each decoder linear becomes int4 groups of ``fit_group_size(K, group_size)``;
    then the LM head is rounded to ``head_scheme`` (int8 per channel) as in ``quantize_model``.  In place."""
    from minillm.quant.calibrate import quantize_layers

    if scheme not in CALIBRATED_SCHEMES:
        raise ValueError(f"calibrated scheme must be one of {CALIBRATED_SCHEMES}, got {scheme!r}")
    check_scheme(head_scheme, "head_scheme")
    if scheme == "awq":
        from minillm.quant.awq import awq_layer_quantizer

        quantizer = awq_layer_quantizer(model.config, group_size)
    else:
        from minillm.quant.gptq import gptq_layer_quantizer

        quantizer = gptq_layer_quantizer(group_size)
    quantize_layers(model, calibration_ids, quantizer)
    return _swap_with(model, lambda name, m: quantize_weight(m.weight, head_scheme))  # only the head is left


def _group(name: str, scheme: str, group_size: int | None) -> int | None:
    if name == "lm_head":
        return None
    return 32 if scheme == "int4" and group_size is None else group_size


def packed_nbytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (shared tensors once): what the model holds in memory."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = t.nbytes
    return sum(seen.values())


def model_from_packed(config, weights: dict[str, Tensor | PackedWeight], *, dtype: torch.dtype,
                      device: torch.device | str, kernels: str = "auto", scheme: str = "int4") -> nn.Module:
    """A quantized ``Transformer`` built straight from packed weights under Hugging Face names (what
    ``quant.gguf.read_gguf_weights`` returns): q/k/v and gate/up stacked by ``cat_rows``, no float round trip —
    for the default GGUF, exactly the Q4_1 blocks (and the Q8_0 head) llama.cpp runs.  A linear whose weight is
    a float tensor is quantized with ``scheme`` (the head with int8).  Norms (and a float untied embedding) load in
    ``dtype``; a tied model's embedding reads the head's packed table.
    """
    from minillm.layers.rotary import RotaryEmbedding
    from minillm.models.llama import Transformer

    w = dict(weights)
    with torch.device("meta"):  # nothing is allocated for weights that arrive packed
        model = Transformer(config)
    embed = "model.embed_tokens.weight"

    def take(names: list[str], head: bool) -> PackedWeight:
        parts = [w[n] if head and n == embed else w.pop(n) for n in names]
        parts = [quantize_weight(p.float(), "int8" if head else scheme) if isinstance(p, Tensor) else p
                 for p in parts]
        return cat_rows(parts) if len(parts) > 1 else parts[0]

    def make(name: str, m: Linear) -> QuantLinear:
        prefix, _, leaf = name.rpartition(".")
        parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(leaf, [leaf])
        stem = f"{prefix}." if prefix else ""
        names = [f"{stem}{p}.weight" for p in parts]
        if name == "lm_head" and "lm_head.weight" not in w:
            names = [embed]  # tied: the head is the embedding's table
        missing = [n for n in names if n not in w]
        if missing:
            raise ValueError(f"checkpoint does not match the {config.model_type} architecture: missing {missing}")
        biases = [w.pop(f"{stem}{p}.bias") for p in parts if f"{stem}{p}.bias" in w]
        bias = torch.cat(biases).to(dtype) if biases else None
        return QuantLinear(take(names, name == "lm_head"), bias)

    swap_linears(model, make)
    if config.tie_word_embeddings:
        w.pop(embed, None)
        model.model.embed_tokens = QuantEmbedding(model.lm_head.packed_weight, dtype)
    elif embed in w and not isinstance(w[embed], Tensor):  # an untied packed table (a Q8_0 token_embd)
        model.model.embed_tokens = QuantEmbedding(w.pop(embed), dtype)
    w.pop("lm_head.weight", None)
    floats = {k: v.to(dtype) for k, v in w.items() if isinstance(v, Tensor) and "rotary_emb" not in k}
    _, unexpected = model.load_state_dict(floats, strict=False, assign=True)
    model.model.rotary_emb = RotaryEmbedding(config)  # a computed buffer, not in the checkpoint
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    packed_left = [k for k, v in w.items() if not isinstance(v, Tensor)]
    if left or unexpected or packed_left:
        raise ValueError(f"checkpoint does not match the {config.model_type} architecture: missing {left[:6]}, "
                         f"unexpected {(unexpected + packed_left)[:6]}")
    model.requires_grad_(False)
    return model.to(device).eval().set_kernels(kernels)
