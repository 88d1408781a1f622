"""Functions the pipeline-parallel tests run in spawned workers (kept apart from the test module so that a worker
imports only torch and minillm, not transformers)."""

import os

import torch

from minillm.distributed.pipeline import PipelineStage, stage_forward


def logits_and_layers(ctx, model, ids, pos, m):
    """-> (logits on the last stage, the layers this stage holds, the layers a K/V cache of its config holds)."""
    stage = PipelineStage(model, ctx.rank, ctx.world_size)
    logits, _ = stage_forward(ctx, stage, ids, pos, m)
    return logits, len(stage.layers), stage.config.num_layers


def last_stage_dies(ctx, model, ids, pos):
    """The last stage exits without a word; the first waits on activations it sends that nobody receives."""
    stage = PipelineStage(model, ctx.rank, ctx.world_size)
    if stage.is_last:
        os._exit(7)
    return stage_forward(ctx, stage, ids, pos, 2)


def child_pids(ctx):
    """This rank's process id (the test checks that it is gone once the call returned)."""
    return os.getpid(), torch.get_num_threads()
