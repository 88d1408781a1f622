"""Scaling out with torch.distributed: a rank's context, collectives, spawned workers, the cost model."""
