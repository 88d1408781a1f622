"""Linear layers.  At decode every linear layer is a GEMV whose cost is the bytes of its weight plus a fixed
per-call overhead; the implementation (native CPU GEMV, ``F.linear``) is the one ``kernels.select`` resolved."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minillm.kernels.cpu import native


class Linear(nn.Module):
    """A bias-optional linear layer that takes the native CPU GEMV at decode when ``kernels`` allows it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.kernels = "auto"  # set by Transformer.set_kernels

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels in ("auto", "native") and native.prefers_native(x, self.weight):
            return native.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
