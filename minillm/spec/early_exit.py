"""Early-exit self-drafting: the target's first ``num_layers`` layers, then its final norm and LM head.

The drafter shares the target's weights (it holds the target and runs a prefix of its layer list: no copy, no
extra weight bytes); its cost per token is about num_layers / L of the target's layer bytes plus the LM head.
It has its own small K/V for those layers (``draft.DraftModelProposer``: a paged pool for the fused native step,
which runs it as ``as_transformer()``, or a contiguous cache per sequence),
because the target's paged K/V at those layers was computed from the *target's* tokens only up to the last
committed one — the drafts' K/V lives only in the drafter.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from minillm.kernels.select import KernelOps
from minillm.models.llama import Body, Transformer


class EarlyExitModel:
    """A model-like view of ``target`` truncated after ``num_layers`` layers (same interface the drafter uses:
    ``config``, ``device``, ``dtype``, ``kernels``, ``kernel_ops``, ``hidden_states``, ``compute_logits``)."""

    def __init__(self, target, num_layers: int):
        if not 1 <= num_layers <= target.config.num_layers:
            raise ValueError(f"num_layers={num_layers} must lie in [1, {target.config.num_layers}]")
        self.target, self.num_layers = target, num_layers
        self.config = dataclasses.replace(target.config, num_layers=num_layers)  # sizes the drafter's K/V

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    @property
    def kernels(self) -> str:
        return self.target.kernels

    def kernel_ops(self) -> KernelOps:
        return self.target.kernel_ops()

    def hidden_states(self, input_ids: Tensor, positions: Tensor, cache=None) -> Tensor:
        """input_ids, positions [B, L] -> hidden [B, L, hidden] after the first ``num_layers`` layers + final norm."""
        return self.target.hidden_states(input_ids, positions, cache, num_layers=self.num_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[..., hidden] -> [..., V] through the target's own LM head."""
        return self.target.compute_logits(hidden)

    def __call__(self, input_ids: Tensor, positions: Tensor, cache=None) -> Tensor:
        """[B, L] -> [B, L, V] logits of the truncated model."""
        return self.compute_logits(self.hidden_states(input_ids, positions, cache))

    def as_transformer(self) -> Transformer:
        """The truncated model as a ``Transformer`` of ``num_layers`` layers sharing the target's modules (no weight
        copy), so code that needs a plain ``Transformer`` — the fused native decode step — can run it."""
        return LayerPrefix(self.target, self.num_layers, self.config)


class LayerPrefix(Transformer):
    """A ``Transformer`` whose modules are ``target``'s embedding, first ``num_layers`` layers, final norm and LM head
    (shared, not copied); its kernel choice follows the target's.  Built without ``Transformer.__init__``, which
    would allocate a second set of weights."""

    def __init__(self, target: Transformer, num_layers: int, config):
        nn.Module.__init__(self)
        self.config = config
        self._kernel_choice = lambda: target.kernels  # a function, not the module: no submodule registered
        body = Body.__new__(Body)
        nn.Module.__init__(body)
        src = target.model
        body.embed_tokens, body.norm, body.rotary_emb = src.embed_tokens, src.norm, src.rotary_emb
        body.layers = nn.ModuleList(list(src.layers[:num_layers]))
        self.model, self.lm_head = body, target.lm_head

    @property
    def kernels(self) -> str:
        """The target's kernel choice (``set_kernels`` on the target takes effect here too)."""
        return self._kernel_choice()
