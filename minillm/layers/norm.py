"""RMSNorm: x / rms(x) * weight, statistics in fp32."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minillm.kernels.select import KernelOps


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in fp32 whatever the storage dtype (as transformers), computed by the
    ``ops.rms_norm`` it is given (reference ``kernels.select.torch_rms_norm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, ops: KernelOps) -> Tensor:
        """x [..., dim] -> [..., dim]."""
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: Tensor, residual: Tensor, ops: KernelOps) -> tuple[Tensor, Tensor]:
        """The residual add before the norm, fused: x, residual [..., dim] -> (norm(x + residual), x + residual)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)
