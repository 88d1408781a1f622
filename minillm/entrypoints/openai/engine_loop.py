"""One thread owns the ``LLMEngine``; asyncio request handlers talk to it through queues.

    handler ──submit()──▶ commands (queue.SimpleQueue) ──▶ loop thread: add / abort / stop, then engine.step()
    handler ◀──RequestStream (asyncio.Queue per request)◀── loop.call_soon_threadsafe(queue.put_nowait, StepOutput)

The engine is plain, single-threaded Python: only the loop thread ever calls it.  Prompts are tokenized (the chat
template applied) before they reach it, on one tokenizer thread, after a byte-count check that refuses a text too
long for the context without tokenizing it: the loop thread receives token ids, so a long prompt never stalls the
other requests' steps.  A handler never blocks the event loop on the model: it awaits its own queue.  Admission is
bounded and counts sequences (prompts × ``n``): at most ``max_num_seqs + max_queue`` are in flight, the next
request is refused at once (``QueueFull``) instead of waiting without limit, and one request may ask for at most
``max_num_seqs`` (``TooManySequences``), so it cannot take the slots the queue keeps for everyone else.  With a
TTFT budget (``ttft_slo_s``) the loop also sheds load: it times every step, estimates a newcomer's TTFT from the
prefill work queued ahead of it (``admission.TTFTEstimator``) and refuses it (``Overloaded``) when that estimate is
over the budget — first on the event loop from the last published queue (no wait at all when the queue alone is
over), then on the loop thread with the request's own prompt length.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from minillm.engine.inputs import chat_prompt_ids, max_token_bytes, prompt_text_bytes
from minillm.entrypoints.openai.admission import AdmissionState, TTFTEstimator, queued_prefill_tokens, steps_to_seat
from minillm.entrypoints.openai.compat import context_error
from minillm.entrypoints.openai.limits import DEFAULT_STALL_TIMEOUT_S
from minillm.openmp import release_thread_pool
from minillm.outputs import EngineState, RequestOutput, StepOutput
from minillm.sampling.params import SamplingParams

log = logging.getLogger("minillm.serve")


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages with the tools the chat template renders beside them (OpenAI's ``tools`` list)."""

    messages: list[dict]
    tools: list[dict]


# A prompt as a handler submits it: text, token ids, chat messages ([{"role", "content"}, ...]) or those with tools
# (tokenized on the one tokenizer thread, ``EngineLoop.tokenize``: a fast tokenizer must not be used by two threads
# at once, and the engine thread only ever sees token ids).
Prompt = str | Sequence[int] | Sequence[dict] | ChatPrompt


class QueueFull(Exception):
    """Every in-flight slot is taken (running and waiting): answer 429 now rather than queue without bound."""


class TooManySequences(ValueError):
    """One request asks for more sequences (prompts × n) than ``max_num_seqs``, a full batch (400)."""


class Overloaded(QueueFull):
    """Shed: the request's estimated TTFT is over the budget (429 with ``Retry-After: retry_after_s``)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    """The loop is stopping and takes no new requests (503)."""


class PromptTooLong(ValueError):
    """The request does not fit the context: the prompt leaves no room for an output token, or prompt + an explicit
    ``max_tokens`` is over it (400 ``context_length_exceeded``; the rule is ``compat.context_error``)."""


class EngineFailed(RuntimeError):
    """The engine raised inside ``step()``; every request in flight at that moment ends with this error."""


@dataclass(frozen=True)
class _Add:
    prompt: list[int]  # tokenized on the handler's side
    params: SamplingParams
    request_id: str
    arrival_time: float
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    reply: concurrent.futures.Future  # -> the prompt's token ids, or the exception that refused it
    max_tokens_given: bool = True  # False: params.max_tokens stands for "the rest of the context" (not checked)


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Stop:
    drain_s: float


@dataclass(frozen=True)
class _Finished:
    output: RequestOutput


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class RequestStream:
    """A request's updates, in order: iterate for ``StepOutput``s; afterwards ``output`` is its ``RequestOutput``.

    ``close()`` (always call it, e.g. in ``finally``) aborts the request if it has not finished — that is what a
    client disconnect does — and frees its admission slot.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], updates: asyncio.Queue,
                 on_close: Callable[[str, bool], None]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output: RequestOutput | None = None
        self._updates = updates
        self._on_close = on_close
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while self.output is None:
            item = await self._updates.get()
            if isinstance(item, _Finished):
                self.output = item.output
            elif isinstance(item, _Failed):
                raise EngineFailed(f"the engine failed: {item.error!r}") from item.error
            else:
                yield item

    async def result(self) -> RequestOutput:
        """Wait for the end and return the ``RequestOutput`` (all ``n`` samples)."""
        async for _ in self:
            pass
        return self.output

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close(self.request_id, self.output is not None)


class EngineLoop:
    """Owns ``engine`` (an ``LLMEngine``) on one background thread; ``submit`` and ``abort`` from the event loop.

    ``max_queue``: sequences (prompts × n) allowed to wait beyond the ``max_num_seqs`` that can run.
    ``ttft_slo_s``: shed load — refuse (``Overloaded``) a request whose estimated TTFT exceeds this many seconds; None
    (default) admits by count only.  ``admission`` (an ``AdmissionState``) is the loop's latest estimate, whether or
    not it sheds.
    ``stall_timeout_s``: ``stalled()`` reports the loop once its current iteration (a step and the commands before
    it) has run this long — the liveness probe's signal that the engine is stuck.
    """

    def __init__(self, engine, *, max_queue: int = 64, ttft_slo_s: float | None = None,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        if ttft_slo_s is not None and (not isinstance(ttft_slo_s, (int, float)) or not ttft_slo_s > 0):
            raise ValueError(f"ttft_slo_s must be None (no shedding) or a number of seconds > 0, got {ttft_slo_s!r}")
        if not isinstance(stall_timeout_s, (int, float)) or not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be a number of seconds > 0, got {stall_timeout_s!r}")
        self.ttft_slo_s, self.stall_timeout_s = ttft_slo_s, stall_timeout_s
        self._busy_since: float | None = None  # loop thread writes: when its current iteration began; None: idle
        self.engine = engine  # touched only by the loop thread once start() has run
        self.max_model_len: int = engine.max_model_len  # constants, read once here
        self.max_num_seqs: int = engine.config.max_num_seqs
        self.capacity = self.max_num_seqs + max_queue  # sequences
        tokenizer = engine.tokenizer
        self.max_prompt_bytes = None if tokenizer is None else self.max_model_len * max_token_bytes(tokenizer)
        # One thread: a tokenizer is not promised to be safe under concurrent encodes (the loop thread only decodes)
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minillm-tokenize")
        # The engine's load after the loop's latest iteration, for /metrics: read without a lock — the loop thread
        # replaces the whole frozen object, and rebinding an attribute is atomic in CPython.
        self.snapshot: EngineState = engine.state()
        self.admission = AdmissionState()  # rebound by the loop thread, read by handlers and /metrics (same reason)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # loop thread only
        self._modelled: dict[str, tuple[float, float]] = {}  # loop thread only: id -> (arrival, model's TTFT)
        self._in_flight = 0  # requests; event-loop thread only
        self._seqs_in_flight = 0  # their sequences (prompt × n each): what admission counts
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="minillm-engine-loop", daemon=True)

    # ---- event-loop side ---------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return self._in_flight

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def step_age_s(self) -> float:
        """Seconds the loop thread has spent in its current iteration (commands, then a step); 0 while it waits
        idle for a request.  A healthy loop keeps this near one step's time."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def stalled(self) -> str | None:
        """Why the loop is unhealthy — not running, or its step stuck past ``stall_timeout_s`` — or None."""
        if not self.is_alive():
            return "the engine loop is not running"
        age = self.step_age_s()
        if age > self.stall_timeout_s:
            return (f"the engine step has not advanced for {age:.1f} s (the limit is {self.stall_timeout_s:g} s) "
                    f"with {self._in_flight} requests in flight: the engine is stuck")
        return None

    def start(self) -> None:
        """Start the loop thread, which runs every engine step from now on.  The calling thread, which built the
        engine, frees its OpenMP worker pool (``minillm.openmp.release_thread_pool``: two pools on a small host
        throttle every worker's spin)."""
        release_thread_pool()
        self._thread.start()

    def compile_grammar(self, guided) -> None:
        """Compile a request's structured-output constraint (``GuidedDecodingParams``) into the engine's cache of
        its backend, from any thread: the one engine part a handler may touch (xgrammar's compiler is thread-safe;
        minillm's regex cache at worst computes a state's mask twice).  Raises ``ValueError`` naming what cannot be
        compiled."""
        self.engine.compile_guided(guided)

    def stop(self, drain_s: float = 0.0, join_s: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for up to ``drain_s`` seconds, abort the rest, and join."""
        self._stopping = True
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            self._commands.put(_Stop(drain_s))
            self._thread.join(join_s)

    def admit(self, num_seqs: int) -> None:
        """Raise if a request of ``num_seqs`` sequences (prompts × n) cannot be admitted: ``TooManySequences``
        over ``max_num_seqs`` (never), ``QueueFull`` over the free slots (not now)."""
        if num_seqs > self.max_num_seqs:
            raise TooManySequences(f"this request asks for {num_seqs} sequences (prompts × n) but one request may "
                                   f"run at most max_num_seqs = {self.max_num_seqs}: split it into smaller requests")
        if self._seqs_in_flight + num_seqs > self.capacity:
            raise QueueFull(f"the server is at capacity ({self._seqs_in_flight} sequences in flight, this request "
                            f"adds {num_seqs}, the limit is {self.capacity}: max_num_seqs + max_queue); retry later")

    async def submit(self, prompt: Prompt, params: SamplingParams, request_id: str,
                     arrival_time: float | None = None, *, max_tokens_given: bool = True) -> RequestStream:
        """Queue a request; returns its stream once the engine has accepted it.  Raises ``QueueFull``,
        ``ShuttingDown``, ``PromptTooLong`` or the engine's ``ValueError`` (then nothing is queued).
        ``max_tokens_given`` False: the client left ``max_tokens`` out, so ``params.max_tokens`` only caps the
        output at the context and prompt + ``max_tokens`` is not checked against it."""
        if self._stopping or not self._thread.is_alive():
            raise ShuttingDown("the server is shutting down")
        self.admit(params.n)
        self._shed(self.admission, 0)  # the queue alone is over the budget: refuse without waiting for a step
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        updates: asyncio.Queue = asyncio.Queue()
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._count(params.n, +1)
        try:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._tokenizer_thread, self.tokenize, prompt)
        except BaseException:
            self._count(params.n, -1)
            raise
        self._commands.put(_Add(ids, params, request_id, arrival_time, loop, updates, reply, max_tokens_given))
        try:
            ids = await asyncio.wrap_future(reply)
        except asyncio.CancelledError:  # the client left while we waited: the add may still happen, so undo it
            self._release(request_id, False, params.n)
            raise
        except BaseException:
            self._count(params.n, -1)
            raise
        return RequestStream(request_id, ids, updates, lambda rid, done: self._release(rid, done, params.n))

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids (text tokenized, chat messages through the template, ids as they are); a text over
        ``max_prompt_bytes`` — more bytes than the context's tokens can cover — raises ``PromptTooLong`` without
        being tokenized.  Runs on the tokenizer thread."""
        messages, tools = (prompt.messages, prompt.tools) if isinstance(prompt, ChatPrompt) else (None, None)
        size = prompt_text_bytes(prompt if messages is None else messages)
        if self.max_prompt_bytes is not None and size > self.max_prompt_bytes:
            raise PromptTooLong(f"the prompt has {size} bytes of text; a token of this model's vocabulary covers at "
                                f"most {self.max_prompt_bytes // self.max_model_len} bytes, so that is more than the "
                                f"model's context of {self.max_model_len} tokens: shorten the prompt")
        if messages is not None:
            return chat_prompt_ids(self.engine.tokenizer, messages, tools)
        if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], dict):
            return self.engine.encode(prompt)
        return chat_prompt_ids(self.engine.tokenizer, prompt)

    def _count(self, num_seqs: int, sign: int) -> None:
        self._in_flight += sign
        self._seqs_in_flight += sign * num_seqs

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); its KV blocks are freed before the next step."""
        self._commands.put(_Abort(request_id))

    def _release(self, request_id: str, finished: bool, num_seqs: int) -> None:
        self._count(num_seqs, -1)
        if not finished:
            self.abort(request_id)

    def _shed(self, admission: AdmissionState, prompt_tokens: int, waited_s: float = 0.0) -> None:
        """Raise ``Overloaded`` if shedding is on and a ``prompt_tokens`` prompt that arrived ``waited_s`` ago would
        miss the TTFT budget."""
        budget, est, ahead, seat = self.ttft_slo_s, admission.estimator, admission.tokens_ahead, admission.steps_to_seat
        if budget is None or est.admits(budget, ahead, prompt_tokens, waited_s, seat):
            return
        estimate = est.estimate_s(ahead, prompt_tokens, waited_s, seat)
        raise Overloaded(f"the server is overloaded: {ahead} prompt tokens are queued ahead of this request and a "
                         f"seat in the batch frees in ~{seat} steps: an estimated time to first token of "
                         f"{estimate:.2f} s (at {est.tokens_per_s:.0f} prefill tokens/s, {est.step_s:.2f} s per "
                         f"step), over the {budget:g} s budget; retry later",
                         est.retry_after_s(budget, ahead, prompt_tokens, seat))

    def _queue_state(self, estimator: TTFTEstimator) -> AdmissionState:
        """``estimator`` with the engine's queue now (loop thread only)."""
        scheduler = self.engine.scheduler
        return AdmissionState(estimator, queued_prefill_tokens(scheduler),
                              steps_to_seat(scheduler, self.engine.config.max_num_seqs, self.max_model_len))

    # ---- loop thread ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        wait: float | None = None  # how long to wait for the first command: forever when idle
        while True:
            self._busy_since = None
            commands = self._drain(wait)
            self._busy_since = time.monotonic()
            for command in commands:
                if isinstance(command, _Stop):
                    self._shutdown(command.drain_s)
                    return
                self._handle(command)
            wait = None
            if engine.has_unfinished_requests():
                updates = self._step()
                # Nothing ran (e.g. a dynamic batch still collecting): nap 1 ms instead of spinning on step().
                wait = 0.0 if updates else 1e-3
            self._publish()

    def _step(self) -> list[StepOutput]:
        """One engine step, timed: the prefill tokens it cleared and its duration feed the TTFT estimator."""
        before = queued_prefill_tokens(self.engine.scheduler)  # recounted: aborts since the last step freed some
        t0 = time.perf_counter()
        try:
            updates = self.engine.step()
        except Exception as e:  # keep serving: end what was in flight, start clean
            log.exception("engine step failed; aborting %d requests", len(self._streams))
            self._fail_all(e)
            return []
        elapsed = time.perf_counter() - t0
        after = queued_prefill_tokens(self.engine.scheduler)
        est = self.admission.estimator
        if updates:  # an empty step (a batch still collecting) measured nothing
            # A recompute preemption puts a sequence's tokens back in the queue (after > before): no prefill rate
            est = est.observe(max(before - after, 0), elapsed)
        self.admission = AdmissionState(est, after, self.admission.steps_to_seat)  # the seats: at _publish
        self._dispatch(updates)
        return updates

    def _drain(self, wait: float | None) -> list:
        """Every queued command, after waiting up to ``wait`` seconds for the first (None: until one comes —
        an idle loop sleeps here at no cost)."""
        commands = []
        if wait != 0.0:
            try:
                commands.append(self._commands.get(timeout=wait))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, command) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self._abort(command.request_id)

    def _abort(self, request_id: str) -> None:
        """Abort in the engine (frees its KV blocks) and end the stream with the partial output."""
        if request_id not in self._streams:
            return  # finished already, or never admitted
        try:
            self.engine.abort(request_id)
        except KeyError:  # unknown to the engine: should not happen, but never leave a stream waiting
            pass
        self._finish(request_id)
        if request_id in self._streams:
            self._post(request_id, _Failed(RuntimeError(f"request {request_id!r} was aborted")))
            self._streams.pop(request_id)

    def _add(self, c: _Add) -> None:
        try:
            ids = c.prompt
            too_long = context_error(len(ids), c.params.max_tokens if c.max_tokens_given else None,
                                     self.max_model_len)
            if too_long:
                raise PromptTooLong(too_long)
            state, waited = self._queue_state(self.admission.estimator), time.perf_counter() - c.arrival_time
            self._shed(state, len(ids), waited)
            self.engine.add_request(ids, c.params, c.request_id, c.arrival_time)
        except Exception as e:
            c.reply.set_exception(e)
            return
        model = state.estimator.model_s(state.tokens_ahead, len(ids), waited, state.steps_to_seat)
        if model is not None:  # checked against the real TTFT when its first token comes (_dispatch)
            self._modelled[c.request_id] = (c.arrival_time, model)
        self._streams[c.request_id] = (c.loop, c.queue)
        c.reply.set_result(ids)

    def _dispatch(self, updates: list[StepOutput]) -> None:
        """Post a step's updates to their streams, then end the requests that finished: samples of one request
        (``n`` > 1) that finish in the same step each get their last update before the request's output."""
        finished: dict[str, None] = {}  # request ids in order, once each
        for u in updates:
            modelled = self._modelled.pop(u.request_id, None)
            if modelled is not None and u.finish_reason != "error":  # its first token: how far off was the model?
                arrival, model = modelled
                est = self.admission.estimator.calibrate(model, time.perf_counter() - arrival)
                self.admission = replace(self.admission, estimator=est)
            self._post(u.request_id, u)
            if u.finished:
                finished[u.request_id] = None
        for request_id in finished:
            self._finish(request_id)

    def _finish(self, request_id: str) -> None:
        """Hand a retired request's output to its stream (no-op while other samples of it still run)."""
        self._modelled.pop(request_id, None)
        try:
            output = self.engine.pop_output(request_id)
        except KeyError:
            return
        self._post(request_id, _Finished(output))
        self._streams.pop(request_id, None)

    def _post(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, updates = target
        try:
            loop.call_soon_threadsafe(updates.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def _fail_all(self, error: BaseException) -> None:
        self._modelled.clear()
        for request_id in list(self._streams):
            try:
                self.engine.abort(request_id)
                self.engine.pop_output(request_id)
            except Exception:  # already retired, or the engine is broken: the stream still gets the error
                pass
            self._post(request_id, _Failed(error))
            self._streams.pop(request_id, None)

    def _shutdown(self, drain_s: float) -> None:
        """Step until nothing is in flight or ``drain_s`` has passed, then abort what is left."""
        deadline = time.monotonic() + drain_s
        while self._streams and self.engine.has_unfinished_requests() and time.monotonic() < deadline:
            for command in self._drain(0.0):
                if isinstance(command, _Add):
                    command.reply.set_exception(ShuttingDown("the server is shutting down"))
                else:
                    self._handle(command)
            try:
                self._dispatch(self.engine.step())
            except Exception:  # a broken engine cannot drain: abort below
                log.exception("engine step failed while draining")
                break
        for request_id in list(self._streams):
            self._abort(request_id)
        for command in self._drain(0.0):  # adds that raced with the stop
            if isinstance(command, _Add):
                command.reply.set_exception(ShuttingDown("the server is shutting down"))
        self._publish()

    def _publish(self) -> None:
        self.snapshot = self.engine.state()
        self.admission = self._queue_state(self.admission.estimator)
