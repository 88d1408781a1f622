"""Pruning: zero the weights that matter least, and measure what it costs in perplexity.

Two patterns on every decoder linear layer (embeddings and LM head left whole):
- **magnitude**, unstructured: in each output row, the ``sparsity`` share of weights with the smallest |w| become 0.
  Any pattern — so it saves nothing on dense hardware unless a sparse kernel exploits it.
- **2:4** (semi-structured): in every group of 4 consecutive input weights, the 2 smallest |w| become 0 — exactly
  50 %, the pattern NVIDIA's sparse tensor cores (Ampere and later) run at up to 2× the dense matmul rate.
Magnitude is the simplest criterion; SparseGPT and Wanda choose better (they weigh |w| by the activations) and
lose less at the same sparsity.  A weight set to zero stays stored here: this module measures quality, not speed.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from minillm.models.llama import Transformer

METHODS = ("magnitude", "2:4")


def magnitude_mask(weight: Tensor, sparsity: float) -> Tensor:
    """weight [N, K] -> bool mask [N, K], False for the round(sparsity × K) smallest |w| of each row."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    k = round(sparsity * weight.shape[1])
    mask = torch.ones_like(weight, dtype=torch.bool)
    if k:
        drop = weight.abs().topk(k, dim=1, largest=False).indices  # (N, k)
        mask.scatter_(1, drop, False)
    return mask


def two_four_mask(weight: Tensor) -> Tensor:
    """weight [N, K] (K divisible by 4) -> bool mask keeping the 2 largest |w| of every 4 consecutive inputs."""
    N, K = weight.shape
    if K % 4:
        raise ValueError(f"2:4 sparsity needs input features divisible by 4, got {K}")
    groups = weight.abs().reshape(N, K // 4, 4)
    keep = groups.topk(2, dim=-1).indices  # (N, K/4, 2)
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(N, K)


def prune_model(model: Transformer, method: str = "magnitude", sparsity: float = 0.5) -> Transformer:
    """A pruned copy of ``model``: every decoder linear weight masked by ``method`` ("magnitude" at ``sparsity``,
    or "2:4", always 50 %).  ``model`` is unchanged."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    pruned = copy.deepcopy(model)
    for layer in pruned.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            w = linear.weight.data
            mask = magnitude_mask(w, sparsity) if method == "magnitude" else two_four_mask(w)
            linear.weight.data = w * mask
    return pruned


def sparsity_of(model: Transformer) -> float:
    """The share of exact zeros among the decoder linear weights."""
    zeros = total = 0
    for layer in model.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            zeros += int((linear.weight == 0).sum())
            total += linear.weight.numel()
    return zeros / total
