"""Who am I in the group: a rank's ``ParallelContext``, passed explicitly to whatever communicates.

Megatron and vLLM keep the tensor-parallel group in module globals (``get_tensor_model_parallel_group()``); minillm
passes a frozen ``ParallelContext`` to the layers that need it instead (``layers/parallel.py``), so two groups (or a
test at world size 1 next to one at 2) never see each other's state.  The process group itself is built from a
``TCPStore`` rendezvous and the backend's ``ProcessGroup`` class directly — not ``init_process_group``, which would
set torch's process-wide default group.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class ParallelContext:
    """One rank of a tensor-parallel group.

    ``rank`` in [0, world_size); ``group``: the torch ``ProcessGroup`` all ranks joined (None at world size 1, where
    every collective is the identity); ``device``: where this rank computes (``cuda:<local rank>`` under NCCL).
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None
    backend: str = "gloo"
    device: torch.device = torch.device("cpu")

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {self.rank!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.world_size > 1 and self.group is None:
            raise ValueError(f"world_size={self.world_size} needs a process group (see init_parallel)")

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that reports results."""
        return self.rank == 0


def default_backend(device: torch.device | str) -> str:
    """gloo for CPU tensors, NCCL for CUDA tensors (what torch.distributed supports best for each)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_parallel(rank: int, world_size: int, *, host: str = "127.0.0.1", port: int, backend: str = "gloo",
                  timeout_s: float = 60.0, store=None) -> ParallelContext:
    """Rendezvous ``world_size`` processes at ``host:port`` (rank 0 hosts the ``TCPStore``) and build their group.
    ``store``: a store the processes already share (a launcher's), used instead of hosting one at ``host:port``.

    ``timeout_s`` bounds every wait: a rank that never arrives (or dies mid-collective) makes the others raise
    instead of hanging forever.  NCCL ranks compute on ``cuda:<rank % device count>``.
    """
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    device = torch.device("cpu")
    if world_size == 1:
        return ParallelContext(0, 1, None, backend, device)
    if store is None:
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(store, rank, world_size)
    else:
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    return ParallelContext(rank, world_size, group, backend, device)


def init_from_env(backend: str | None = None, timeout_s: float = 60.0) -> ParallelContext:
    """The context of a process launched by ``torchrun`` or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT (torch's ``env://`` convention).

    torchrun's agent already serves a store at MASTER_PORT and says so (TORCHELASTIC_USE_AGENT_STORE=True): every
    rank then joins it as a client, under a key prefix of its own, as torch's own ``env://`` rendezvous does — hosting
    a second store on a guessed neighbouring port could find that port taken.  Otherwise rank 0 hosts the store at
    MASTER_PORT.
    """
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    store = None
    if world_size > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        agent = dist.TCPStore(host, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))
        store = dist.PrefixStore("minillm/", agent)
    return init_parallel(rank, world_size, host=host, port=port, backend=backend, timeout_s=timeout_s, store=store)
