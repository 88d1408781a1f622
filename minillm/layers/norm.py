"""RMSNorm: x / rms(x) * weight, statistics in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minillm.kernels.cpu import native


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in fp32 whatever the storage dtype (as transformers)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = "auto"  # set by Transformer.set_kernels

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels in ("auto", "native") and native.supports(x, self.weight):
            return native.rms_norm(x, self.weight, self.eps)  # decode rows: F.rms_norm costs ~35 µs here
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()  # half precision: fp32 statistics, round, then the weight multiply (as transformers)
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
