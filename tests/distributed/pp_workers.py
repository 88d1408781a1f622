"""Functions the pipeline-parallel tests run in spawned workers (kept apart from the test module so that a worker
imports only torch and minillm, not transformers)."""

import os

import torch

from minillm.distributed.pipeline import PipelineStage, stage_forward, stage_generate


def logits_and_tokens(ctx, model, ids, pos, prompts, params, eos_ids, m):
    """-> (logits on the last stage, outputs on the last stage, layers and K/V cache layers this stage holds)."""
    stage = PipelineStage(model, ctx.rank, ctx.world_size)
    logits, _ = stage_forward(ctx, stage, ids, pos, m)
    outputs = stage_generate(ctx, stage, prompts, params, m, eos_ids)
    return logits, outputs, len(stage.layers), stage.config.num_layers


def last_stage_dies(ctx, model, prompts, params):
    """The last stage exits without a word; the others wait for activations or tokens that never come."""
    stage = PipelineStage(model, ctx.rank, ctx.world_size)
    if stage.is_last:
        os._exit(7)
    return stage_generate(ctx, stage, prompts, params, 2)


def child_pids(ctx):
    """This rank's process id (the test checks that it is gone once the call returned)."""
    return os.getpid(), torch.get_num_threads()
