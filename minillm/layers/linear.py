"""Linear layers.  At decode every linear layer is a GEMV whose cost is the bytes of its weight plus a fixed
per-call overhead; the implementation (native CPU GEMV, ``F.linear``) is the ``ops.linear`` the caller passes
(``kernels.select`` resolved it for the model's choice, device and dtype)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minillm.kernels.select import KernelOps


class Linear(nn.Module):
    """A bias-optional linear layer: y = x @ weight.T + bias, computed by the ``ops.linear`` it is given."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: Tensor, ops: KernelOps) -> Tensor:
        """x [..., in_features] -> [..., out_features]."""
        return ops.linear(x, self.weight, self.bias)
