"""Linear layers.  At decode every linear layer is a GEMV whose cost is the bytes of its weight plus a fixed
per-call overhead; the implementation (native CPU GEMV, ``F.linear``) is the ``ops.linear`` the caller passes
(``kernels.select`` resolved it for the model's choice, device and dtype).

``QuantLinear`` is ``Linear`` with a packed int8/int4 weight (``minillm.quant.weight``) instead of a float one:
``quant.apply.quantize_model`` swaps it in (gpt-fast's ``replace_linear_*``), and its forward calls
``ops.int8_linear`` / ``ops.int4_linear``.  ``QuantEmbedding`` looks token rows up in a packed table, so a tied
embedding can share the quantized LM head's codes instead of keeping a float copy of the largest matrix.
``W8A8Linear`` and ``Fp8Linear`` (``quant.smooth.quantize_model_w8a8``) round the activations too and call
``ops.w8a8_linear`` / ``ops.fp8_linear``: integer (or fp8) matmuls instead of a dequantized weight.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from minillm.kernels.select import KernelOps
from minillm.quant.activation import Fp8Weight, check_w8a8_weight
from minillm.quant.weight import Int4Weight, Int8Weight, Q6KWeight

PackedWeight = Int4Weight | Int8Weight | Q6KWeight
# a float buffer seen as same-width integers (see _PackedModule._apply); 1 byte: fp8 codes
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class Linear(nn.Module):
    """A bias-optional linear layer: y = x @ weight.T + bias, computed by the ``ops.linear`` it is given."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: Tensor, ops: KernelOps) -> Tensor:
        """x [..., in_features] -> [..., out_features]."""
        return ops.linear(x, self.weight, self.bias)


class _PackedModule(nn.Module):
    """Holds one packed weight: its tensors are buffers (so ``.to(device)``, ``state_dict`` and ``load_state_dict``
    see them) and ``packed_weight`` is the ``Int4Weight``/``Int8Weight``/``Q6KWeight`` over those same tensors."""

    _kept: tuple[str, ...] = ()  # further buffers that keep their dtype through .to(dtype) (a static input scale)

    def __init__(self, weight: PackedWeight | Fp8Weight):
        super().__init__()
        if not isinstance(weight, (Int4Weight, Int8Weight, Q6KWeight, Fp8Weight)):
            raise TypeError(f"expected an Int4Weight, Int8Weight, Q6KWeight or Fp8Weight, got {type(weight).__name__}")
        self._kind = type(weight)
        self.group_size = weight.group_size
        fields = [f.name for f in dataclasses.fields(weight)]
        self._grouped = "group_size" in fields  # a constructor argument (Q6K's groups of 16 are its format's)
        self._names = tuple(n for n in fields if n != "group_size")
        for name in self._names:
            self.register_buffer(name, getattr(weight, name))
        self._rebuild()

    @property
    def packed_weight(self) -> PackedWeight:
        """The packed weight (its tensors are this module's buffers)."""
        return self._packed

    def _rebuild(self) -> None:
        self._packed = self._make({n: getattr(self, n) for n in self._names})

    def _make(self, tensors: dict[str, Tensor | None]):
        """A packed weight of this module's kind over ``tensors`` (its fields by name)."""
        return self._kind(**tensors, **({"group_size": self.group_size} if self._grouped else {}))

    def _apply(self, fn, recurse=True):
        # The packed format fixes its storage dtypes (Q4_1 keeps fp16 d and m), so a model-wide .to(bfloat16)
        # changes the activations, never the packed weight; device moves, pinning and sharing still apply.  Float
        # buffers go through ``fn`` as same-width integer views, which ``fn`` moves but does not cast.  ``.data``
        # is assigned in place (as nn.Module does for parameters) so a tied embedding that shares these tensors
        # stays shared after a move.
        saved = {n: self._buffers.pop(n) for n in (*self._names, *self._kept) if self._buffers.get(n) is not None}
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers.update(saved)
        for t in saved.values():
            moved = fn(t.view(_INT_VIEW[t.element_size()])).view(t.dtype) if t.is_floating_point() else fn(t)
            if moved is not t:
                t.data = moved
        self._rebuild()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._rebuild()  # load_state_dict(assign=True) replaces the buffers


class QuantLinear(_PackedModule):
    """y = x @ dequant(W).T + bias with W stored packed (``Int4Weight``, or ``Int8Weight`` / GGUF Q6_K blocks
    ``Q6KWeight``, int8-coded; no float copy is kept or rebuilt here: the kernel dequantizes in registers, the
    reference per call).  Computed by ``ops.int4_linear`` or ``ops.int8_linear`` (``kernels.select`` picks native C
    on CPU, Triton on CUDA, else the reference)."""

    def __init__(self, weight: PackedWeight, bias: Tensor | None = None):
        super().__init__(weight)
        self.out_features, self.in_features = weight.shape
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}], got {tuple(bias.shape)}")
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.op = "int4_linear" if isinstance(weight, Int4Weight) else "int8_linear"

    def forward(self, x: Tensor, ops: KernelOps) -> Tensor:
        """x [..., in_features] -> [..., out_features] in x's dtype."""
        return getattr(ops, self.op)(x, self._packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.op[:4]}, " \
               f"group_size={self.group_size}, bias={self.bias is not None}"


class W8A8Linear(QuantLinear):
    """W8A8: an int8 weight per output channel (``Int8Weight``, group_size K) and int8 activations — rounded per
    token at each call (``input_scale`` None, "dynamic") or with one calibrated per-tensor scale (``input_scale``,
    a 0-dim fp32 buffer, "static") — multiplied as integers by ``ops.w8a8_linear`` (``quant.activation``)."""

    _kept = ("input_scale",)

    def __init__(self, weight: Int8Weight, bias: Tensor | None = None, input_scale: Tensor | None = None):
        if not isinstance(weight, Int8Weight):
            raise TypeError(f"W8A8Linear needs an Int8Weight, got {type(weight).__name__}")
        check_w8a8_weight(weight)
        super().__init__(weight, bias)
        if input_scale is not None and (input_scale.numel() != 1 or not input_scale.is_floating_point()):
            raise ValueError(f"input_scale must be one float (a per-tensor scale), got {tuple(input_scale.shape)}")
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(()))
        self.op = "w8a8_linear"

    def forward(self, x: Tensor, ops: KernelOps) -> Tensor:
        """x [..., in_features] -> [..., out_features] in x's dtype."""
        return ops.w8a8_linear(x, self._packed, self.input_scale, self.bias)

    def extra_repr(self) -> str:
        scale = "dynamic per-token" if self.input_scale is None else f"static {float(self.input_scale):.3g}"
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8, {scale}, " \
               f"bias={self.bias is not None}"


class Fp8Linear(QuantLinear):
    """FP8: an e4m3 weight per output channel (``Fp8Weight``) and e4m3 activations per token, multiplied by
    ``ops.fp8_linear`` (``torch._scaled_mm`` on CUDA with compute capability ≥ 8.9, else the reference)."""

    def __init__(self, weight: Fp8Weight, bias: Tensor | None = None):
        if not isinstance(weight, Fp8Weight):
            raise TypeError(f"Fp8Linear needs an Fp8Weight, got {type(weight).__name__}")
        super().__init__(weight, bias)
        self.op = "fp8_linear"


class QuantEmbedding(_PackedModule):
    """Token embedding read from a packed [V, hidden] table: ids [...] -> [..., hidden] in ``dtype``, dequantizing
    only the looked-up rows.  Built over a tied LM head's packed weight it shares that head's tensors, so the
    model holds one int8 table instead of a float table plus its quantized copy (V × hidden is the largest matrix).
    ``dtype`` follows the model's ``.to(dtype)`` like a float embedding's weight would."""

    def __init__(self, weight: PackedWeight, dtype: torch.dtype = torch.float32):
        super().__init__(weight)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.dtype = dtype

    def _apply(self, fn, recurse=True):
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype  # what a float weight would have become
        return super()._apply(fn, recurse)

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids [...] int -> [..., hidden] in ``self.dtype``."""
        flat = input_ids.reshape(-1)
        # a symmetric Int4Weight has no mins; a Q6K row is its row of super-blocks
        rows = self._make({n: None if (t := getattr(self, n)) is None else t[flat] for n in self._names})
        return rows.dequantize(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self._kind.__name__}, group_size={self.group_size}"
