"""Scaling out with torch.distributed: a rank's context, collectives, spawned workers, the tensor-parallel driver
and its step messages, pipeline stages, the cost model."""
