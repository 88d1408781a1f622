"""Functions the tensor-parallel tests run in spawned workers.  Kept apart from the test module so that a worker
imports only torch and minillm (the test module imports transformers: seconds of start-up per process)."""

import torch

from minillm.distributed import comm
from minillm.distributed.executor import rank_model
from minillm.engine.llm_engine import LLMEngine


def logits_and_tokens(ctx, model, ids, pos, prompts, params):
    """-> (logits [B, L, V], greedy tokens per prompt, K/V heads in the rank's paged cache); one spawn, both checks."""
    sharded = rank_model(ctx, model)
    with torch.inference_mode():
        logits = sharded(ids, pos)
    engine = LLMEngine(sharded)
    tokens = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    return logits, tokens, engine.kv_cache.k.shape[-2]


def fails_on_rank_one(ctx):
    """Rank 1 raises; rank 0 waits in a collective that will never complete (the parent must stop it)."""
    if ctx.rank == 1:
        raise KeyError("rank one's own message")
    comm.barrier(ctx)
