"""The tensor-parallel driver: one scheduler in this process, persistent worker ranks that run what it sends.

    driver = TPDriver(model, tensor_parallel_size=2)        # spawns ranks 1..N-1 once; this process is rank 0
    engine = LLMEngine(driver.model, tokenizer, EngineConfig(...), executor=driver)   # rank 0's engine
    engine.generate(...); engine.generate(...)             # the same worker processes serve every call
    driver.shutdown()                                      # also on garbage collection and interpreter exit

What runs where:
- rank 0 (the calling process): the whole ``LLMEngine`` — scheduler, block manager, detokenizer, sampling — over
  its shard of the model (H_q/tp and H_kv/tp heads, F/tp MLP units, V/tp vocabulary rows) and its heads' K/V.
- ranks 1..N−1 (spawned once, ``torch.multiprocessing`` "spawn", running ``worker.serve_steps``): their shard and
  their heads' K/V, nothing else.  Each waits on its pipe for a step header, receives the step's tensor (one
  broadcast), runs the block copies and the forward (``engine.model_runner.forward_step``) and waits again; it
  never schedules, samples or detokenizes.
Per step: a ~100-byte header down each worker's pipe, one broadcast of the packed step (``step.py``: 8 · B (6 + w)
bytes for a decode batch of B whose longest block table has w entries), then the forward's own collectives —
one all-reduce of [T, hidden] for the embedding, two per layer, one all-gather of the [B_s, V] logits.  Only rank 0
samples: the logits are identical everywhere after the gather.  Because one scheduler decides for all ranks,
any policy works — "dynamic" (it waits on the wall clock) and whatever a scheduler does not deterministically.
The price is latency, not bytes: a worker sleeps in its pipe read while rank 0 samples and schedules, and the
broadcast waits until it has been woken (BENCHMARKS.md times packing, pipe and broadcast) — a wake-up that SPMD
ranks (each scheduling concurrently) do not pay; vLLM's multiprocess executor has its workers poll a
shared-memory ring buffer instead of sleeping on a pipe, which trades a spinning core for that latency.

The engine sees the driver as its ``executor`` (``engine.model_runner.Executor``): ``attach_kv`` when its runner
allocates the K/V cache, ``run_step`` for every step; the engine's own sampling, stop rules and outputs do the rest.
The process machinery — spawning, start-up, the step message, health and failure, shutdown — is ``StepDriver``'s;
``TPDriver`` adds what a rank holds (its shard) and runs per step (the whole forward, ``shard_step``), as
``pp_driver.PPDriver`` does for pipeline stages (its layers, activations passed rank to rank).

Failure, so that nothing hangs and nothing fails silently:
- every step first checks that each worker is alive (``Process.is_alive``: a ``waitpid``, microseconds);
- a worker that dies mid-step closes its sockets, so gloo raises at once in rank 0's next collective; a worker
  that raises sends its traceback before it exits; every collective is bounded by ``timeout_s``; a watchdog thread
  aborts an NCCL group when a worker exits (NCCL would otherwise wait for a dead peer; that path is untested
  here, for want of a machine with two GPUs);
- on an error the driver names the rank (its exit code or traceback) in a ``WorkerError`` (a ``RuntimeError``),
  stops the other workers (they would wait forever in a collective) and refuses every later call with that error.
  An error in rank 0 alone (a request it cannot sample) is told apart by a ping: idle workers answer at once.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait

import torch
from torch import Tensor

from minillm.config import EngineConfig
from minillm.distributed.comm import broadcast
from minillm.distributed.parallel_state import ParallelContext, default_backend, init_parallel
from minillm.distributed.step import pack_step
from minillm.distributed.worker import WorkerError, free_port, serve_steps
from minillm.engine.model_runner import StepInputs, forward_step
from minillm.kv.paged_cache import PagedKVCache
from minillm.layers.parallel import check_shardable, shard_model
from minillm.models.llama import Transformer

PING_TIMEOUT_S = 5.0  # an idle worker answers in milliseconds; one still in a collective never does


class StepDriver:
    """Rank 0 of a group of ``size`` ranks and the worker processes of ranks 1..size−1, started once; every engine
    step goes to all of them.  The process machinery (start-up, health, failure, shutdown) is here; what a rank
    holds and does is two module-level functions (they reach the spawned workers by name):

        piece(model, ctx) -> this rank's part of the whole ``model`` (a shard, a stage); rank 0's is ``self.model``
        run(piece, kv, step, ctx) -> what each rank does with a ``StepInputs``: the logits [R + pad, V] on rank 0

    ``TPDriver`` (shards, collectives inside the forward) and ``pp_driver.PPDriver`` (stages, activations passed
    rank to rank) are the two kinds.  ``threads_per_worker``: torch threads per worker (default: the cores divided
    among the ranks; this process's own setting is left alone).  ``timeout_s`` bounds every collective;
    ``start_timeout_s`` the start-up.
    """

    kind = "parallel"  # the group's name in messages ("tensor-parallel", "pipeline-parallel")
    prefix = "minillm-group"  # the worker processes' names: prefix-rank{r}

    def __init__(self, model: Transformer, size: int, piece: Callable, run: Callable, *,
                 threads_per_worker: int | None = None, timeout_s: float = 60.0, start_timeout_s: float = 300.0):
        import torch.multiprocessing as mp

        self.world_size, self.timeout_s, self._run = size, timeout_s, run
        self.failure: RuntimeError | None = None  # set once: every later call raises it
        self._kv: PagedKVCache | None = None  # rank 0's cache of the engine whose K/V the workers hold
        backend, port = default_backend(model.device), free_port()
        threads = threads_per_worker or max(1, (os.cpu_count() or 1) // size)
        mpc = mp.get_context("spawn")  # a fresh interpreter per rank, as CUDA requires
        self._procs, self._conns = [], []
        for rank in range(1, size):
            conn, child = mpc.Pipe()
            self._procs.append(mpc.Process(target=serve_steps, name=f"{self.prefix}-rank{rank}", daemon=True,
                                           args=(rank, size, port, backend, threads, model, child, timeout_s,
                                                 piece, run)))
            self._procs[-1].start()
            child.close()  # the worker's end: with it closed here, a dead worker reads as EOF on ours
            self._conns.append(conn)
        self._stop_watch = None
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        try:
            deadline = time.monotonic() + start_timeout_s
            self.ctx = self._rendezvous(port, backend, deadline)
            if backend == "nccl":
                stop_reader, self._stop_watch = mpc.Pipe(duplex=False)
                threading.Thread(target=_watchdog, args=(self._procs, stop_reader, self.ctx.group), daemon=True,
                                 name=f"{self.prefix}-watchdog").start()
            self.model = piece(model, self.ctx)
            self.pids: list[int] = self._replies("ready", deadline)  # the workers' process ids, rank order
        except BaseException:
            self._finalizer()  # no half-started group outlives a failed start
            raise

    # ---- start-up --------------------------------------------------------------------------------------------
    def _rendezvous(self, port: int, backend: str, deadline: float) -> ParallelContext:
        """Join the group as rank 0 in a thread while watching the workers: one that fails to start raises here
        at once instead of after the store's timeout."""
        joined: dict[str, object] = {}

        def join():
            try:
                joined["ctx"] = init_parallel(0, self.world_size, port=port, backend=backend, timeout_s=self.timeout_s)
            except BaseException as e:  # noqa: BLE001 — handed to the main thread
                joined["error"] = e

        thread = threading.Thread(target=join, daemon=True, name=f"{self.prefix}-rendezvous")
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            self._raise_if_dead("while starting")
            if time.monotonic() > deadline:
                raise self._fail(f"{self.kind} workers did not join within the start-up timeout")
        if "error" in joined:
            raise self._fail(f"rank 0 could not join the group: {joined['error']!r}")
        return joined["ctx"]

    def _replies(self, kind: str, deadline: float) -> list:
        """One ``(kind, value)`` message from every worker (in rank order), watching them while waiting."""
        values = []
        for rank, conn in enumerate(self._conns, start=1):
            while not conn.poll(0.1):
                self._raise_if_dead(f"before answering {kind!r}")
                if time.monotonic() > deadline:
                    raise self._fail(f"worker rank {rank} did not answer {kind!r} in time (stuck in a collective "
                                     "rank 0 left, or still starting): the ranks no longer agree")
            values.append(self._receive(rank, conn, kind))
        return values

    def _receive(self, rank: int, conn, kind: str):
        try:
            got, value = conn.recv()
        except (EOFError, OSError):
            raise self._fail(self._death(rank) or f"worker rank {rank} closed its pipe") from None
        if got == "error":
            raise self._fail(f"worker rank {rank} raised:\n{value}")
        if got != kind:
            raise self._fail(f"worker rank {rank} answered {got!r} instead of {kind!r}: the ranks no longer agree")
        return value

    # ---- health ------------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the driver's failure (a ``WorkerError``, or the shut-down error) if it has one, or if a worker has
        died or reported an error since the last step; else return (cost: one ``waitpid`` per worker)."""
        if self.failure is not None:
            raise self.failure
        self._raise_if_dead("between steps")
        for rank, conn in enumerate(self._conns, start=1):
            if conn.poll():  # a worker speaks unasked only to report its own error
                self._receive(rank, conn, "nothing")

    def _death(self, rank: int, wait_s: float = 1.0) -> str | None:
        """'worker rank r died with exit code c' once that process has exited (waiting up to ``wait_s``)."""
        proc = self._procs[rank - 1]
        proc.join(wait_s)
        return None if proc.exitcode is None else f"worker rank {rank} died with exit code {proc.exitcode}"

    def _raise_if_dead(self, when: str) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            if not proc.is_alive():
                conn = self._conns[rank - 1]
                if conn.poll():  # it may have said why before exiting
                    self._receive(rank, conn, "nothing")
                raise self._fail(f"worker rank {rank} died with exit code {proc.exitcode} {when}")

    def _fail(self, message: str) -> WorkerError:
        """Record the failure, stop every worker (the others would wait forever in a collective); -> the error."""
        if self.failure is None:
            self.failure = WorkerError(f"{message}; the {self.kind} workers were stopped: create a new LLM")
            self._finalizer()
            if self._stop_watch is not None:
                self._stop_watch.close()
        return self.failure

    def diagnose(self, error: BaseException) -> BaseException:
        """After rank 0 raised mid-step: a ``WorkerError`` if a worker died, raised, or is stuck in a collective
        rank 0 left (the ranks no longer agree); else ``error`` itself (rank 0's own, e.g. one request's)."""
        if self.failure is not None:
            return self.failure
        try:
            for conn in self._conns:
                conn.send(("ping", None))
        except OSError:
            pass  # a closed pipe: the worker died; _replies names it
        try:
            self._replies("pong", time.monotonic() + PING_TIMEOUT_S)
        except WorkerError as e:
            return e
        return error

    # ---- what the engine calls ---------------------------------------------------------------------------------
    def attach_kv(self, kv: PagedKVCache, kv_args: dict) -> None:
        """``kv`` is rank 0's cache of a new engine: have every worker (re)build its own with
        ``make_paged_kv_cache(rank config, **kv_args)``.  An earlier engine of this driver stops working."""
        self.check()
        for conn in self._conns:
            conn.send(("kv", kv_args))
        self._replies("ok", time.monotonic() + max(self.timeout_s, 60.0))
        self._kv = kv

    def run_step(self, kv: PagedKVCache, step: StepInputs) -> Tensor | None:
        """Send the step to every worker, then run rank 0's part over ``kv`` (``run``) -> logits [R + pad, V] (model
        dtype), None for a copies-only step.  Raises ``WorkerError`` when a rank died or failed."""
        if kv is not self._kv:
            raise RuntimeError(f"a newer engine of this {type(self).__name__} replaced this one's K/V cache on the "
                               "workers")
        self._send(step)
        try:
            return self._run(self.model, kv, step, self.ctx)
        except WorkerError:
            raise
        except Exception as e:  # noqa: BLE001 — rank 0's own error, or a peer's death seen by a collective
            self.reraise(e)

    def _send(self, step: StepInputs) -> None:
        """Give every worker this step (header down its pipe, the packed tensor by broadcast); they run it while
        rank 0 runs its part."""
        self.check()
        header, payload = pack_step(step, self.ctx.device)
        try:
            for conn in self._conns:
                conn.send(("step", header))
            broadcast(payload, self.ctx)
        except Exception as e:  # noqa: BLE001 — a dead worker: broken pipe or a reset connection
            self.reraise(e)

    def reraise(self, error: Exception):
        """Raise what ``diagnose(error)`` finds: the ``WorkerError`` (caused by ``error``) or ``error`` itself."""
        failure = self.diagnose(error)
        if failure is error:
            raise error
        raise failure from error

    # ---- the end -------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (each leaves its loop and exits; a stuck one is terminated) and refuse later calls."""
        if self.failure is None:
            self.failure = RuntimeError(f"the {self.kind} workers were shut down (LLM.shutdown()): create a "
                                        "new LLM to generate again")
        self._finalizer()
        if self._stop_watch is not None:
            self._stop_watch.close()

    @property
    def alive(self) -> bool:
        """Whether the workers are running and no failure or shutdown has happened."""
        return self.failure is None and all(p.is_alive() for p in self._procs)


class TPDriver(StepDriver):
    """Rank 0 of a tensor-parallel group and the worker processes of ranks 1..N−1, started once (``StepDriver``).

    ``model``: the loaded whole model (its weights reach the workers through shared memory, each keeps its shard).
    ValueError (before any process starts) for a size that does not divide the heads, naming the valid sizes, or a
    weight-quantized model (``check_shardable``).
    """

    kind, prefix = "tensor-parallel", "minillm-tp"

    def __init__(self, model: Transformer, tensor_parallel_size: int, *, threads_per_worker: int | None = None,
                 timeout_s: float = 60.0, start_timeout_s: float = 300.0):
        check_shardable(model, tensor_parallel_size)  # before any process starts
        super().__init__(model, tensor_parallel_size, shard_model, shard_step, threads_per_worker=threads_per_worker,
                         timeout_s=timeout_s, start_timeout_s=start_timeout_s)

    @torch.inference_mode()
    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """The whole model's causal forward, sharded: input_ids, positions [B, L] -> logits [B, L, V] (model dtype,
        on rank 0's device), every rank running its shard; no KV cache is touched."""
        self.check()
        ids = torch.stack([input_ids, positions]).to(self.ctx.device, torch.long)  # (2, B, L): one broadcast
        try:
            for conn in self._conns:
                conn.send(("forward", tuple(ids.shape)))
            broadcast(ids, self.ctx)
            return self.model(ids[0], ids[1])
        except Exception as e:  # noqa: BLE001
            self.reraise(e)


def shard_step(shard: Transformer, kv: PagedKVCache, step: StepInputs, ctx: ParallelContext) -> Tensor | None:
    """A tensor-parallel rank's part of a step: the whole packed forward on its shard (``forward_step``), whose
    collectives meet the other ranks' -> logits [R + pad, V], identical on every rank after the gather."""
    return forward_step(shard, kv, step)


def check_engine_config(config: EngineConfig) -> EngineConfig:
    """``config`` as multi-process (tensor / pipeline parallel) engines run it (``enforce_eager=True``), or
    ValueError for what they cannot: a speculative config (its drafting and verifying forwards are not steps the
    driver sends) or ``enforce_eager=False`` (the static decode path does not pack a step to send)."""
    size = config.parallel_config.tensor_parallel_size, config.parallel_config.pipeline_parallel_size
    name = "pipeline_parallel_size" if size[1] > 1 else "tensor_parallel_size"
    if config.speculative_config is not None:
        raise ValueError(f"speculative_config is not supported with {name} > 1: the drafting and verifying "
                         "forwards run outside the step the driver sends to the workers")
    if config.enforce_eager is False:
        raise ValueError(f"enforce_eager=False is not supported with {name} > 1: multi-process steps run eagerly "
                         "(pass enforce_eager=None or True)")
    return dataclasses.replace(config, enforce_eager=True)


def _watchdog(procs: list, stop_reader, group) -> None:
    """Abort ``group`` when any worker exits before ``stop_reader`` closes: an NCCL collective waiting on a dead
    peer never returns on its own, an aborted one raises in rank 0."""
    ready = wait([p.sentinel for p in procs] + [stop_reader])
    if stop_reader not in ready:
        group.abort()


def _stop_workers(procs: list, conns: list, grace_s: float = 5.0) -> None:
    """Ask every worker to stop, wait up to ``grace_s`` for them together, then terminate (and kill) the rest.
    A ``weakref.finalize`` callback: it runs once, at ``shutdown``, on garbage collection or at interpreter exit."""
    for conn in conns:
        try:
            conn.send(("stop", None))
        except OSError:
            pass  # already dead
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
