"""Held-out text: CPython's ``pydoc_data.topics`` (the help() pages, shipped with every Python, so offline and
identical everywhere), split in two.  Its documents, sorted by name, alternate between a *calibration* half (for
AWQ/GPTQ statistics, ``quant.calibrate``) and an *evaluation* half (for perplexity, ``minillm.perf.perplexity``):
a document is in exactly one, so no document is both tuned on and scored.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Split = Literal["calibration", "evaluation"]
SPLITS = ("calibration", "evaluation")


def heldout_topic_names(split: Split) -> list[str]:
    """The ``split`` half of ``pydoc_data.topics``'s topic names: sorted, even indices calibration, odd indices
    evaluation (deterministic; the halves are disjoint and together cover every topic)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    from pydoc_data.topics import topics

    return sorted(topics)[SPLITS.index(split)::2]


def heldout_documents(split: Split) -> list[str]:
    """The texts of ``heldout_topic_names(split)``, in that order."""
    from pydoc_data.topics import topics

    return [topics[n] for n in heldout_topic_names(split)]


def heldout_token_ids(tokenizer, split: Split = "evaluation", max_tokens: int | None = None) -> Tensor:
    """The split's documents joined by blank lines and tokenized (no special tokens) -> [T] int64, cut at
    ``max_tokens`` when given."""
    ids = tokenizer("\n\n".join(heldout_documents(split)), add_special_tokens=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.int64)
    return ids if max_tokens is None else ids[:max_tokens]
