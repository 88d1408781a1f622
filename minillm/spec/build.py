"""``build_proposer``: the proposer a ``SpeculativeConfig`` names (ngram, early exit, a draft model, the target's int4
copy).  Its own module so the proposers can import the protocol without the protocol importing them."""

from __future__ import annotations

from minillm.config import SpeculativeConfig
from minillm.models.llama import Transformer
from minillm.spec.draft import DraftModelProposer
from minillm.spec.early_exit import EarlyExitModel
from minillm.spec.ngram import NgramProposer
from minillm.spec.proposer import Proposer


def build_proposer(config: SpeculativeConfig, target: Transformer, max_len: int) -> Proposer:
    """The proposer ``config`` names, for ``target``; ``max_len`` caps a sequence (draft KV sizes).

    Raises ``ValueError`` for an early-exit depth out of range, a draft with another vocabulary, or the quantized
    method without quantization support in this tree.
    """
    config.validate_for(target.config)
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "early_exit":
        return DraftModelProposer(EarlyExitModel(target, config.num_layers), max_len, reads_target_kv=True)
    if config.method == "quantized":
        import copy

        from minillm.quant.apply import quantize_model  # the target's int4 twin: its own packed weights

        return DraftModelProposer(quantize_model(copy.deepcopy(target), "int4"), max_len, reads_target_kv=True)
    draft = config.model
    if not hasattr(draft, "hidden_states"):  # a path or hub id
        from minillm.models.loader import load_model

        draft = load_model(draft, dtype=target.dtype, device=target.device, kernels=target.kernels)
    config.validate_for(target.config, draft.config)
    return DraftModelProposer(draft, max_len)
