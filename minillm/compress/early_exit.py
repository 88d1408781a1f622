"""Early exit: stop after the first k decoder layers, apply the final norm and the LM head, and see how much worse
the next-token predictions get.  ``Transformer.hidden_states(num_layers=k)`` runs exactly that (the same path as
the early-exit drafter of speculative decoding, notebook 08).  Layers are not trained to be exited from, so
quality falls steeply for small k; models trained with an exit loss (LayerSkip, CALM) keep more of it."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from minillm.models.llama import Transformer
from minillm.perf.perplexity import PerplexityResult, perplexity


def exit_model(model: Transformer, k: int):
    """A callable ``(input_ids, positions) -> logits`` [B, L] -> [B, L, V] that exits after ``k`` layers."""
    if not 1 <= k <= model.config.num_layers:
        raise ValueError(f"exit layer k={k} must lie in [1, {model.config.num_layers}]")

    def forward(input_ids: Tensor, positions: Tensor) -> Tensor:
        return model.compute_logits(model.hidden_states(input_ids, positions, num_layers=k))

    forward.parameters = model.parameters  # perplexity() finds the device through it
    return forward


def exit_perplexities(model: Transformer, token_ids: Tensor, layers: Sequence[int], *, window: int = 256,
                      stride: int = 128) -> dict[int, PerplexityResult]:
    """Perplexity on ``token_ids`` [T] when exiting after each k in ``layers``."""
    return {k: perplexity(exit_model(model, k), token_ids, window=window, stride=stride) for k in layers}
