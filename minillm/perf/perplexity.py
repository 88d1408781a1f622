"""Perplexity on held-out text: how surprised a model is by text it was not tuned on, exp(mean NLL per token).

Text: the *evaluation* half of CPython's ``pydoc_data.topics`` (``minillm.quant.heldout``, re-exported here), never
the *calibration* half that AWQ/GPTQ statistics come from.

Long texts are scored in windows of ``window`` tokens that advance by ``stride`` (Hugging Face's sliding-window
recipe): every token after the first is scored exactly once, with at least ``window - stride`` tokens of
context except in the first window (the step is capped at ``window - 1``: a window's first token is context
only).  Cost: ≈ T / stride forward passes of ``window`` tokens.

``kv_cache_dtype`` "int8"/"fp8" scores through a quantized KV cache (``kv.contiguous.make_kv_cache``): each window
is prefilled into a fresh cache whose attention reads the dequantized K/V, so every token is predicted from
exactly the keys and values a decode step at that position would read back — the quantized cache's effect.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from minillm.quant.heldout import (  # noqa: F401  (re-exported: the text perplexity is measured on)
    SPLITS,
    Split,
    heldout_documents,
    heldout_token_ids,
    heldout_topic_names,
)


@dataclass(frozen=True)
class PerplexityResult:
    """exp(nll), the mean negative log-likelihood per scored token (nats), and how many tokens were scored."""

    ppl: float
    nll: float
    num_tokens: int


@torch.inference_mode()
def perplexity(model: Callable[..., Tensor], token_ids: Tensor, *, window: int = 512, stride: int = 256,
               kv_cache_dtype: str = "auto") -> PerplexityResult:
    """Perplexity of ``model`` (``model(input_ids [1, L], positions [1, L]) -> logits [1, L, V]``) on
    ``token_ids`` [T] (T ≥ 2), scoring tokens 1..T-1 once each in windows of ``window`` tokens every ``stride``.
    ``kv_cache_dtype`` other than "auto" needs a ``Transformer`` (it takes a ``cache`` argument) and scores each
    window through a KV cache of that dtype."""
    if token_ids.dim() != 1 or token_ids.numel() < 2:
        raise ValueError(f"token_ids must be a 1-D tensor of at least 2 tokens, got shape {tuple(token_ids.shape)}")
    if kv_cache_dtype != "auto" and not hasattr(model, "config"):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a minillm Transformer (it runs through a KV cache)")
    if not 0 < stride <= window or window < 2:
        raise ValueError(f"need window ≥ 2 and 0 < stride ≤ window, got window={window}, stride={stride}")
    T = token_ids.numel()
    device = next((p.device for p in model.parameters()), torch.device("cpu")) if hasattr(model, "parameters") \
        else torch.device("cpu")
    step = min(stride, window - 1)  # a window's first token is context only, so at most window - 1 new targets
    total, scored_to = 0.0, 1  # tokens [1, scored_to) are already scored
    while scored_to < T:
        end = min(window if scored_to == 1 else scored_to + step, T)
        begin = max(0, end - window)
        ids = token_ids[begin:end].to(device)[None]  # [1, L]
        positions = torch.arange(end - begin, device=device)[None]  # each window is its own sequence
        logits = _window_logits(model, ids, positions, kv_cache_dtype)[0, :-1].float()  # [L - 1, V]: row i
        # predicts token begin + i + 1
        first = scored_to - begin - 1  # first row whose target is not yet scored
        total += float(F.cross_entropy(logits[first:], ids[0, first + 1:], reduction="sum"))
        scored_to = end
    count = T - 1
    return PerplexityResult(math.exp(total / count), total / count, count)


def _window_logits(model, ids: Tensor, positions: Tensor, kv_cache_dtype: str) -> Tensor:
    """ids, positions [1, L] -> logits [1, L, V]: a plain causal forward, or one through a fresh KV cache of
    ``kv_cache_dtype`` (the same causal attention, over the K/V as the cache stores them)."""
    if kv_cache_dtype == "auto":
        return model(ids, positions)
    from minillm.kv.contiguous import make_kv_cache

    cache = make_kv_cache(model.config, 1, ids.shape[1], dtype=model.dtype, device=ids.device, kernels=model.kernels,
                          kv_cache_dtype=kv_cache_dtype)
    cache.begin(positions)
    return model(ids, positions, cache)
