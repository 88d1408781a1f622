"""Float prefill linears through oneDNN with each weight packed once (``torch.ops.mkldnn``), beside the plain one.

``F.linear`` on CPU hands oneDNN/MKL a plain [N, K] weight on every call, so each GEMM re-lays the weight out into
the register-blocked panels its microkernel reads.  ``torch.ops.mkldnn._reorder_linear_weight`` does that once;
``torch.ops.mkldnn._linear_pointwise`` then runs the GEMM on the packed copy.  The cost is memory: the packed copy
is a second copy of every linear's weight (the plain one stays: the native decode GEMVs and the fused decode step
read it).  So this path packs only when all of the following hold, decided in ``packs`` — the one rule:

- ``ONEDNN_PACK`` (environment ``MINILLM_ONEDNN_PACK``: "auto", "on" or "off") is not "off";
- fp32 x and weight on CPU ("auto"; "on" adds bf16), no autograd through the weight, a weight made outside
  ``torch.inference_mode`` (it keeps the version counter the repacking reads), oneDNN built into torch;
- the packed copies made so far plus this one stay within ``PACK_MEMORY_FRACTION`` of the memory that was
  available when the first weight was packed (``kernels.probe.available_memory``), so a model that barely fits
  never doubles.

Packed copies live as long as their weight (a weak-keyed cache) and are redone when the weight changes in place
(its version counter).  Reference: ``F.linear`` (equal within fp32 rounding: the same products, another order).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from minillm.kernels.probe import available_memory

ONEDNN_PACK = os.environ.get("MINILLM_ONEDNN_PACK", "auto")
if ONEDNN_PACK not in ("auto", "on", "off"):
    raise ValueError(f"MINILLM_ONEDNN_PACK must be 'auto', 'on' or 'off', got {ONEDNN_PACK!r}")
PACK_MEMORY_FRACTION = 0.25  # at most this share of the memory available at the first pack goes to packed copies

_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> (its version when packed, packed copy)
_budget: list[int] = []  # bytes the packed copies may take (set at the first pack)


def supported() -> bool:
    """Whether this torch has oneDNN and its packed-linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packs(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear`` runs x [..., K] @ weight [N, K]ᵀ on a packed copy (see the module docstring)."""
    dtypes = (torch.float32,) if ONEDNN_PACK == "auto" else (torch.float32, torch.bfloat16)
    return (ONEDNN_PACK != "off" and x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in dtypes
            and not (weight.requires_grad and torch.is_grad_enabled())
            and not weight.is_inference() and supported())  # an inference tensor keeps no version to check


def packed_bytes() -> int:
    """Bytes held by the packed copies alive now."""
    return sum(p.nbytes for _, p in _packed.values())


def packed_weight(weight: Tensor) -> Tensor | None:
    """The packed copy of ``weight`` [N, K] (made on first use, redone after an in-place change), or None when the
    memory rule leaves it plain."""
    version = weight._version
    entry = _packed.get(weight)
    if entry is not None and entry[0] == version:
        return entry[1]
    if not _budget:
        _budget.append(int(PACK_MEMORY_FRACTION * available_memory()))
    held = packed_bytes() - (entry[1].nbytes if entry is not None else 0)
    if held + weight.nbytes > _budget[0]:
        _packed.pop(weight, None)
        return None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    _packed[weight] = (version, packed)
    return packed


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x @ weight.T + bias.  x [..., K], weight [N, K], bias [N] | None -> [..., N]: on the packed copy where
    ``packs`` and the memory rule allow, else ``F.linear``."""
    packed = packed_weight(weight) if packs(x, weight) else None
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
