"""Scaling out with torch.distributed: a rank's context, collectives, spawned workers, and the engine's two
executors — the tensor-parallel driver (``driver``) and the pipeline-parallel driver (``pp_driver``) — with the step
messages they send (``step``); the GPipe schedule and pipelined full forward (``pipeline``)."""
