"""LLMEngine: requests in, tokens out, one scheduling step at a time.

    step() = scheduler.schedule()  →  [speculator.propose(): drafts as scheduled tokens]
             →  runner.run() (one packed forward + sampling)  →  scheduler.postprocess() (commit, stop rules)

``add_request`` queues a prompt; each ``step`` returns what it produced as ``StepOutput`` updates (the new token,
its text delta, whether that sample finished) so callers can stream; ``generate`` runs prompts to completion and
``stream`` yields their updates.  The scheduler (``scheduler.py``) decides which tokens run under the token,
sequence and KV-block budgets; the runner (``model_runner.py``, picked once by ``runners.make_runner``) owns the
paged K/V tensors; with ``EngineConfig.parallel_config`` above one process, an executor (``runners.make_executor``)
runs each step on every rank while this engine schedules, samples and detokenizes.  This file joins them,
turns ids into text, and keeps faults contained: a request whose forward, sampling or detokenization raises ends
alone with ``finish_reason="error"``, its blocks freed, while the others run on.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from minillm.config import EngineConfig
from minillm.engine.detokenizer import IncrementalDetokenizer
from minillm.engine.inputs import (
    Prompt,
    merge_eos_token_ids,
    params_list,
    prompt_list,
    request_id_str,
    to_token_ids,
    validate_prompts,
)
from minillm.engine.logprobs import as_dict, stop_reason, stop_token_text_dropped
from minillm.engine.model_runner import Executor, StepResult, sampling_chunks
from minillm.engine.runners import check_parallel, make_executor, make_runner
from minillm.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput, SchedulerStats
from minillm.engine.sequence import Request, SequenceStatus
from minillm.engine.sequence import Sequence as Seq
from minillm.engine.spec_decode import SpecDecoder
from minillm.kv.eviction import make_eviction_policy
from minillm.kv.memory import device_memory, full_sequences, profile_forward, size_kv_pool
from minillm.kv.paged_cache import kv_bytes_per_block
from minillm.models.llama import Transformer
from minillm.outputs import CompletionOutput, EngineState, RequestOutput, StepOutput
from minillm.sampling.guided import GrammarCompiler, GuidedDecodingParams
from minillm.sampling.params import SamplingParams, check_vocab
from minillm.sampling.regex import RegexCompiler
from minillm.sampling.sampler import make_generator, sample_seed
from minillm.spec.proposer import SpecStats

# Ids the engine picks start with this; user ids may not, so the two never collide.
AUTO_ID_PREFIX = "auto-"


class LLMEngine:
    """A Transformer, its paged KV cache and a scheduler.  ``tokenizer`` is optional (then prompts are id lists).

    ``config`` is an ``EngineConfig``; ``eos_token_ids`` default to the model's and the tokenizer's EOS.

    Thread model: every public method takes one re-entrant lock, so ``add_request``, ``abort``, ``pop_output`` and
    ``has_unfinished_requests`` may be called from any thread while another thread runs ``step`` (they wait for
    the step in flight to end).  ``generate`` and ``stream`` may run in several threads at once: each steps the
    engine in turn and every step batches all live requests, whoever added them; each caller gets only its own
    requests' outputs.  Request ids are strings (an int becomes its decimal string); ids the engine picks start
    with ``AUTO_ID_PREFIX``, which user ids may not; an id stays busy until its output is popped.
    """

    def __init__(self, model: Transformer, tokenizer=None, config: EngineConfig | None = None, *,
                 eos_token_ids: Sequence[int] | None = None, executor: Executor | None = None):
        self.config = config = config if config is not None else EngineConfig()
        # tensor / pipeline parallel: the executor runs the other ranks; this process keeps its own piece of the model
        self.executor, self._owns_executor = executor, executor is None
        if executor is None:
            check_parallel(model, config)  # ValueError before any process starts
            self.executor = executor = make_executor(model, config.parallel_config)
        self.model, self.tokenizer = (model if executor is None else executor.model), tokenizer
        mc = self.model.config
        self.max_model_len = min(mc.max_position_embeddings, config.max_model_len or mc.max_position_embeddings)
        # windowed models and kv_eviction free old blocks
        eviction = make_eviction_policy(mc.sliding_window, config.kv_eviction, config.window_tokens,
                                        config.sink_tokens, config.heavy_tokens,
                                        global_layers=mc.sliding_layers is not None)
        self.eos_token_ids = (merge_eos_token_ids(mc.eos_token_ids, tokenizer) if eos_token_ids is None
                              else tuple(eos_token_ids))
        block_bytes = kv_bytes_per_block(mc, config.block_size, self.model.dtype, config.kv_cache_dtype)
        # one CUDA process profiles its model and sizes the pool to the device; an executor's model is this rank's
        # piece only (the other ranks' memory is theirs), so a tensor/pipeline-parallel engine keeps today's budget
        memory = device_memory(self.model.device) if executor is None else None
        # the pool's floor is one sequence's blocks at once: with eviction, its window's (as the old window cap),
        # not the whole context's; a longer prompt (allocated whole at admission) needs a larger explicit budget
        held = (self.max_model_len if eviction is None
                else min(self.max_model_len, eviction.max_blocks(config.block_size) * config.block_size))
        num_blocks = size_kv_pool(config, block_bytes, held, memory,  # int8/fp8 KV: more blocks
                                  lambda: profile_forward(self.model, config, self.max_model_len)).num_blocks
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len,
                                   num_host_blocks=config.resolve_host_blocks(num_blocks),
                                   eos_token_ids=self.eos_token_ids, eviction=eviction)
        self.runner = make_runner(self.model, config, self.scheduler.block_manager, self.max_model_len, executor)
        self.runner.eos_token_ids = self.eos_token_ids  # min_tokens masks them
        self.kv_cache = self.runner.kv
        spec = config.speculative_config
        self.speculator = SpecDecoder(spec, self.model, self.max_model_len) if spec is not None else None
        self._detoks: dict[Seq, IncrementalDetokenizer] = {}
        self._finished: dict[str, RequestOutput] = {}  # finished, not yet popped: their ids are still busy
        self._live: dict[str, Request] = {}
        self._inboxes: dict[str, deque[StepOutput]] = {}  # request id -> the queue of the stream() that owns it
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}  # logprobs' decoded tokens
        self._lock = threading.RLock()
        self._grammars: GrammarCompiler | None = None  # built by the first guided request (reads the vocabulary)
        self._regexes: RegexCompiler | None = None  # likewise, for backend="minillm"

    def check(self) -> None:
        """Raise the executor's failure (a worker that died or raised: ``WorkerError`` naming its rank), if any."""
        if self.executor is not None:
            self.executor.check()

    def shutdown(self) -> None:
        """Stop the worker processes this engine started (tensor / pipeline parallel); a no-op for one process or
        an executor passed in (its owner stops it)."""
        if self.executor is not None and self._owns_executor:
            self.executor.shutdown()

    @property
    def block_manager(self):
        """The scheduler's ``BlockManager`` (device and host KV blocks)."""
        return self.scheduler.block_manager

    @property
    def stats(self) -> SchedulerStats:
        """Counters over the engine's life (steps, tokens, preemptions, peak blocks, ...)."""
        return self.scheduler.stats

    @property
    def spec_stats(self) -> SpecStats | None:
        """Speculative decoding counters over the engine's life (None without a ``speculative_config``)."""
        return None if self.speculator is None else self.speculator.stats

    def state(self) -> EngineState:
        """The engine's load now (batch, queue, KV blocks, prefix hits, speculation): a frozen copy, safe to hand
        to another thread (the OpenAI server's ``/metrics`` reads it while the loop thread steps)."""
        s, bm, spec = self.scheduler, self.block_manager, self.spec_stats
        return EngineState(
            running=len(s.running), waiting=len(s.waiting), swapped=len(s.swapped),
            kv_blocks_used=bm.device.num_used, kv_blocks_total=bm.device.num_blocks,
            kv_tokens_total=bm.device.num_blocks * self.config.block_size,
            kv_max_full_sequences=full_sequences(bm.device.num_blocks, self.config.block_size, self.max_model_len),
            prefix_hit_rate=bm.prefix_stats.hit_rate, prefix_query_tokens=bm.prefix_stats.query_tokens,
            prefix_hit_tokens=bm.prefix_stats.hit_tokens, steps=s.stats.steps, preemptions=s.stats.preemptions,
            spec_verify_steps=spec.verify_steps if spec else 0, spec_draft_tokens=spec.draft_tokens if spec else 0,
            spec_accepted_tokens=spec.accepted_tokens if spec else 0)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles guided decoding constraints for this engine's tokenizer and LM head (built on first use; its
        compiled grammars are cached per constraint).  Raises ``ValueError`` without a tokenizer or xgrammar.
        Thread-safe (xgrammar's compiler is), so a server may compile a request's grammar before queueing it."""
        if self._grammars is None:
            with self._lock:  # built once, even when a server thread and the step ask at the same time
                if self.tokenizer is None:
                    raise ValueError("guided_decoding needs a tokenizer: LLMEngine(model, tokenizer)")
                if self._grammars is None:
                    self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size,
                                                     list(self.eos_token_ids))
        return self._grammars

    @property
    def regex_compiler(self) -> RegexCompiler:
        """Compiles ``backend="minillm"`` regexes (``sampling.regex``) for this engine's tokenizer and LM head (built
        on first use: reads the vocabulary's bytes once; masks are cached per regex and DFA state).  Its
        ``mask_fn`` is the per-state mask function the engine runs (``sampling.regex.token_mask`` by default)."""
        if self._regexes is None:
            with self._lock:
                if self.tokenizer is None:
                    raise ValueError("guided_decoding needs a tokenizer: LLMEngine(model, tokenizer)")
                if self._regexes is None:
                    self._regexes = RegexCompiler(self.tokenizer, self.model.config.vocab_size,
                                                  list(self.eos_token_ids))
        return self._regexes

    def _backend(self, guided: GuidedDecodingParams) -> tuple[GrammarCompiler | RegexCompiler, object]:
        """The compiler of the backend the constraint names (xgrammar unless "minillm") and the spec it takes: the
        one place a constraint's backend is picked."""
        if guided.backend == "minillm":
            return self.regex_compiler, guided.regex
        return self.grammar_compiler, guided

    def compile_guided(self, guided: GuidedDecodingParams) -> None:
        """Compile a constraint into its backend's cache (xgrammar's grammar or minillm's regex DFA), from any
        thread: a server compiles a request's constraint before queueing it, so one that cannot be compiled is
        refused up front.  Raises ``ValueError`` naming what cannot be compiled."""
        compiler, spec = self._backend(guided)
        compiler.compile(spec)

    def _matchers(self, guided: GuidedDecodingParams, n: int) -> list:
        """One matcher per sample, from the backend the constraint names."""
        compiler, spec = self._backend(guided)
        return compiler.matchers(spec, n)

    @property
    def num_live_requests(self) -> int:
        """Requests added and not yet finished (their outputs are not counted)."""
        return len(self._live)

    # ---- requests ----------------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """A string (needs the tokenizer) or 1-d ids (list, numpy array, tensor) -> list of ids."""
        return to_token_ids(prompt, self.tokenizer)

    def _make_request(self, prompt: Prompt, params: SamplingParams | None, request_id, arrival_time: float | None,
                      reserved: Iterable[str] = ()) -> Request:
        """Check everything about one request (raises ``ValueError``, changes nothing); ``reserved``: ids about
        to be taken by the same call."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt)
        validate_prompts([ids], self.max_model_len, self.model.config.vocab_size)
        check_vocab(params, self.model.config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: LLMEngine(model, tokenizer), or stop on token ids")
        if request_id is None:
            request_id = self._next_auto_id(reserved)
        else:
            request_id = request_id_str(request_id)
            if request_id.startswith(AUTO_ID_PREFIX):
                raise ValueError(f"request id {request_id!r}: ids starting with {AUTO_ID_PREFIX!r} are the engine's "
                                 "own; pick another or pass None to let the engine pick")
        if request_id in self._live or request_id in self._finished or request_id in reserved:
            raise ValueError(f"request id {request_id!r} is already in use (an id stays busy until its output is "
                             "popped); pass a new one or let the engine pick")
        self.scheduler.check(request_id, len(ids), params)
        seeds = [None if params.seed is None else sample_seed(params.seed, i) for i in range(params.n)]
        generators = [make_generator(dataclasses.replace(params, seed=s), self.model.device) for s in seeds]
        matchers = (None if params.guided_decoding is None  # compiled here: a bad constraint never reaches a step
                    else self._matchers(params.guided_decoding, params.n))
        return Request(request_id, ids, params, time.perf_counter() if arrival_time is None else arrival_time,
                       generators, prompt=prompt if isinstance(prompt, str) else None,
                       prompt_logprobs=None if params.prompt_logprobs is None else [None], matchers=matchers)

    def _next_auto_id(self, reserved: Iterable[str]) -> str:
        while True:
            rid = f"{AUTO_ID_PREFIX}{next(self._ids)}"
            if rid not in self._live and rid not in self._finished and rid not in reserved:
                return rid

    def _queue(self, request: Request) -> str:
        self.scheduler.add(request)
        self._live[request.request_id] = request
        return request.request_id

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | int | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a prompt; returns its request id (a string).  Raises ``ValueError`` (and queues nothing) for a
        request that could never run: a bad prompt or id, too long for the context, or needing more KV blocks than
        the whole cache.  Thread-safe."""
        with self._lock:
            return self._queue(self._make_request(prompt, params, request_id, arrival_time))

    def abort(self, request_id: str | int) -> None:
        """Stop a request now and free its KV blocks; its partial output is kept with finish_reason "abort".
        Raises ``KeyError`` for an id that is not running.  Thread-safe."""
        with self._lock:
            rid = request_id_str(request_id)
            self.scheduler.abort(rid)
            self._retire(self._live[rid])

    def has_unfinished_requests(self) -> bool:
        """Whether any request is still queued or running."""
        with self._lock:
            return self.scheduler.has_unfinished()

    def pop_output(self, request_id: str | int) -> RequestOutput:
        """The result of a finished (or aborted, or failed) request, handed over once; the id is then free."""
        with self._lock:
            rid = request_id_str(request_id)
            if rid not in self._finished:
                raise KeyError(f"request {rid!r} has not finished (or its output was already taken)")
            return self._finished.pop(rid)

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule (with drafts, when speculating) → run the model → commit.  Returns one update per token
        produced this step (and one "error" update per sample of a request that failed in it).  Thread-safe."""
        with self._lock:
            out = self.scheduler.schedule(time.perf_counter())
            start, draft_s = time.perf_counter(), 0.0
            if self.speculator is not None:  # some decodes become draft chunks [last, x_1..x_k] (spec_decode.py)
                budget = self.config.max_num_batched_tokens - out.num_tokens
                out, draft_s = self.speculator.propose(out, self.kv_cache, self.block_manager, budget)
            speculating = any(s.drafts for s in out.scheduled)
            updates, run_s = self._run(out)
            if speculating:
                self.speculator.record_step(draft_s, run_s, time.perf_counter() - start)
            for u in updates:
                if u.request_id in self._inboxes:
                    self._inboxes[u.request_id].append(u)
            return updates

    def _run(self, out: SchedulerOutput) -> tuple[list[StepOutput], float]:
        """Run the step and commit it -> (updates, seconds in the runner: forward and sampling).  A failing request
        ends alone (``_run_isolated``); a failing speculative step is rerun without its drafts."""
        t = time.perf_counter()
        # Seeded generators' states before sampling advances them: a failed step reruns its survivors from these
        # (one small CPU copy per seeded sequence per step).
        rng_states = self._rng_states(out)
        try:
            if self.speculator is None:
                result = self.runner.run(out, self.config.return_logits)
            else:  # the runner applies the speculator's rejection rule to every draft chunk
                result = self.runner.run(out, self.config.return_logits, self.speculator.verify)
            failed: dict[Request, BaseException] = {}
        except Exception as e:  # noqa: BLE001 — a bad request must not take the engine down
            if any(s.drafts for s in out.scheduled):  # drop the drafts: the plain rerun isolates the culprit
                for g, state in rng_states:
                    g.set_state(state)
                return self._run(self.speculator.without_drafts(out, self.block_manager))
            out, result, failed = self._run_isolated(out, e, rng_states)
        run_s = time.perf_counter() - t
        updates = [u for request, exc in failed.items() for u in self._fail(request, exc)]
        if not out.is_empty:
            updates += self._postprocess(out, result)
        return updates, run_s

    def _run_isolated(self, out: SchedulerOutput, error: Exception, rng_states: list):
        """The step's forward or sampling raised: rerun each request's chunks alone to find which one fails.

        The block copies already ran (they must not run twice: a swapped-out block may be reused this step);
        writing the same K/V to the same slots again is harmless; seeded generators are rewound to ``rng_states``
        (taken before the step ran) so the survivors sample exactly what they would have.
        -> (the survivors' SchedulerOutput, their StepResult, the failed).
        """
        if out.is_empty:
            raise error  # the block copies themselves failed: no request to blame
        for g, state in rng_states:
            g.set_state(state)
        by_request: dict[Request, list] = {}
        for s in out.scheduled:
            by_request.setdefault(s.seq.request, []).append(s)
        kept, tokens, logits, failed, logprobs = [], [], [], {}, {}
        for request, chunks in by_request.items():
            solo = SchedulerOutput(scheduled=chunks)
            try:
                r = self.runner.run(solo, self.config.return_logits) if len(by_request) > 1 else None
            except Exception as e:  # noqa: BLE001
                r = e
            if r is None or isinstance(r, Exception):
                failed[request] = error if r is None else r
                continue
            kept += chunks
            tokens += r.tokens
            logprobs.update(r.logprobs)
            if r.logits is not None:
                logits.append(r.logits)
        survivors = SchedulerOutput(scheduled=kept, num_padding=0)
        return survivors, StepResult(tokens, torch.cat(logits) if logits else None, logprobs), failed

    @staticmethod
    def _rng_states(out: SchedulerOutput) -> list:
        return [(g, g.get_state()) for s in out.scheduled for g in s.seq.request.generators if g is not None]

    def _postprocess(self, out: SchedulerOutput, result: StepResult) -> list[StepOutput]:
        """Commit the step: plain chunks through the scheduler at once, then each draft chunk's verified tokens one
        at a time (after its rejected drafts' slots are freed), so every stop rule applies per token."""
        chunks = sampling_chunks(out)  # (chunk, its first sampling row in result.logits)
        for seq, (prompt, _) in result.logprobs.items():  # before any commit: a request may end at its first token
            if prompt:
                seq.request.prompt_logprobs += [as_dict(e, self._token_text) for e in prompt]
        plain = SchedulerOutput([s for s in out.scheduled if not s.drafts], num_padding=0)
        plain_tokens = [t for (s, _), t in zip(chunks, result.tokens, strict=True) if not s.drafts]
        rows = [row for s, row in chunks if not s.drafts for _ in range(s.num_samples)]
        entries = [e for s, _ in chunks if not s.drafts for e in self._sampled(result, s)]
        updates = self._commit(plain, plain_tokens, rows, result.logits, entries)
        for (s, row), tokens in zip(chunks, result.tokens, strict=True):
            if s.drafts:
                self.speculator.rollback(self.block_manager, s, tokens)
                updates += self._commit_verified(s, tokens, row, result.logits, self._sampled(result, s))
        return updates

    @staticmethod
    def _sampled(result: StepResult, chunk: ScheduledSeq) -> list:
        """The logprobs of the tokens ``chunk`` sampled (``TokenLogprobs`` each, or None each when not asked)."""
        sampled = result.logprobs.get(chunk.seq, ((), ()))[1]
        return list(sampled) if sampled else [None] * (len(chunk.drafts) + chunk.num_samples)

    def _token_text(self, token: int) -> str | None:
        """One token's text, as a logprob's ``decoded_token`` (None without a tokenizer); cached per id."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text

    def _commit_verified(self, chunk: ScheduledSeq, tokens: list[int], row: int,
                         logits: Tensor | None, entries: list) -> list[StepOutput]:
        """Commit a draft chunk's verified tokens one at a time (nothing after a stop is emitted); count them."""
        seq, updates, emitted = chunk.seq, [], 0
        for j, token in enumerate(tokens):
            if seq.status is not SequenceStatus.RUNNING:
                break  # EOS, max_tokens or a stop string ended it: the rest is never emitted
            one = SchedulerOutput([ScheduledSeq(seq, seq.num_tokens - 1, 1)], num_padding=0)
            updates += self._commit(one, [[token]], [row + j], logits, [entries[j]])
            emitted += 1
        self.speculator.record(seq, len(chunk.drafts), tokens, emitted)
        return updates

    def _commit(self, out: SchedulerOutput, tokens: list[list[int]], rows: list[int],
                logits: Tensor | None, entries: list) -> list[StepOutput]:
        """The scheduler's postprocess of ``out`` with ``tokens``, then each new token emitted (``rows[i]``: the
        logits row of the i-th new token, ``entries[i]``: its ``TokenLogprobs`` or None)."""
        new = self.scheduler.postprocess(out, tokens, time.perf_counter())
        updates = []
        for (seq, token), row, entry in zip(new, rows, entries, strict=True):
            if seq.status is SequenceStatus.FINISHED_ERROR:
                continue  # a sibling's detokenization failed earlier in this loop: the request has ended
            try:
                self._advance_grammar(seq, token)
                lp = None if entry is None else as_dict(entry, self._token_text)
                if lp is not None:
                    seq.logprobs = [] if seq.logprobs is None else seq.logprobs
                    seq.logprobs.append(lp)
                updates.append(self._emit(seq, token, None if logits is None else logits[row], lp))
            except Exception as e:  # noqa: BLE001 — e.g. a token id the tokenizer cannot decode
                updates += self._fail(seq.request, e, seq)
        for request in {seq.request for seq, _ in new}:
            if request.finished and request.request_id in self._live:
                self._retire(request)
        return updates

    def _advance_grammar(self, seq: Seq, token: int) -> None:
        """Feed a committed token to the sample's grammar matcher (guided decoding); a grammar that has accepted its
        stop token ends the sample with "stop" (also under ``ignore_eos``)."""
        matcher = seq.matcher
        if matcher is None:
            return
        if not matcher.accept_token(token):
            raise RuntimeError(f"token {token} is not allowed by the request's guided_decoding grammar")
        if matcher.is_terminated() and not seq.status.finished:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, time.perf_counter())

    def _emit(self, seq: Seq, token: int, logits: Tensor | None, logprobs: dict | None = None) -> StepOutput:
        """Detokenize the new token; a completed stop string finishes the sequence here."""
        delta = ""
        if self.tokenizer is not None:
            params = seq.request.params
            detok = self._detoks.get(seq) or self._detoks.setdefault(
                seq, IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                            params.min_tokens))
            eos = seq.status is SequenceStatus.FINISHED_STOPPED and stop_token_text_dropped(params, token,
                                                                                             self.eos_token_ids)
            if not eos:  # EOS is not part of the text
                delta = detok.push(token)
            if detok.stopped:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, time.perf_counter())
            if seq.status.finished:
                delta += detok.flush()  # no token follows: release held-back bytes
        finished = seq.status.finished
        return StepOutput(seq.request.request_id, seq.index, [token], delta, seq.finish_reason, logits,
                          metrics=seq.metrics if finished else None,
                          logprobs=None if logprobs is None else [logprobs],
                          stop_reason=self._stop_reason(seq) if finished else None,
                          prompt_logprobs=seq.request.prompt_logprobs if len(seq.output) == 1 else None)

    def _stop_reason(self, seq: Seq) -> int | str | None:
        """vLLM's ``stop_reason``: the stop token id or the stop string that ended ``seq``; None at EOS or length."""
        token = stop_reason(seq)
        detok = self._detoks.get(seq)
        return token if token is not None or detok is None else detok.stop_reason

    def _fail(self, request: Request, error: BaseException, culprit: Seq | None = None) -> list[StepOutput]:
        """End a request with ``finish_reason="error"`` and free its blocks; one update per sample it ends
        (its unfinished ones, and ``culprit``, the sample whose token could not be emitted)."""
        message = f"{type(error).__name__}: {error}"
        ending = [seq for seq in request.seqs if not seq.status.finished or seq is culprit]
        now = time.perf_counter()
        for seq in ending:  # an unforked parent's end ends the request: its siblings are never made
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, now)
        self._retire(request, message)
        return [StepOutput(request.request_id, seq.index, [], "", "error", metrics=seq.metrics, error=message)
                for seq in ending]

    def _retire(self, request: Request, error: str | None = None) -> None:
        samples = []
        for seq in request.seqs:
            reason = self._stop_reason(seq)
            detok = self._detoks.pop(seq, None)
            asked = request.params.logprobs is not None
            samples.append(CompletionOutput(seq.index, detok.text if detok else "", seq.output,
                                            seq.finish_reason or "abort", seq.metrics,
                                            error if seq.status is SequenceStatus.FINISHED_ERROR else None,
                                            logprobs=(seq.logprobs or []) if asked else None,
                                            stop_reason=reason))
        first = samples[0]
        self._finished[request.request_id] = RequestOutput(
            prompt=request.prompt, prompt_token_ids=request.prompt_token_ids, text=first.text,
            token_ids=first.token_ids, finish_reason=first.finish_reason, metrics=first.metrics, outputs=samples,
            error=error, prompt_logprobs=request.prompt_logprobs, logprobs=first.logprobs)
        self._live.pop(request.request_id, None)

    # ---- offline convenience -----------------------------------------------------------------------------------
    def _add_all(self, prompts, params) -> list[str]:
        """Check every prompt, then queue them all (a bad one raises before any is queued)."""
        prompts = prompt_list(prompts)
        param_list = params_list(params, len(prompts))
        with self._lock:
            requests: list[Request] = []
            for p, sp in zip(prompts, param_list, strict=True):
                requests.append(self._make_request(p, sp, None, None, reserved={r.request_id for r in requests}))
            return [self._queue(r) for r in requests]

    def _release(self, request_ids: list[str]) -> None:
        """Abort the caller's unfinished requests and drop outputs it did not take (interrupt, error, early close)."""
        with self._lock:
            for rid in request_ids:
                self._inboxes.pop(rid, None)
                if rid in self._live:
                    self.abort(rid)
                self._finished.pop(rid, None)

    def _advance(self) -> None:
        """One step by this caller (any caller's step serves everyone's requests)."""
        if not self.step() and not self.scheduler.running:
            time.sleep(1e-3)  # dynamic batching waiting for its window, or another thread holds the work

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (together with anything already queued); outputs in prompt order.

        Every prompt is checked before any is queued, so a bad one raises without starting the others.  A request
        that fails while running comes back with ``finish_reason="error"`` and its ``error``; the others complete.
        On any exception or interrupt (Ctrl-C) the call's unfinished requests are aborted and their blocks freed.
        """
        rids = self._add_all(prompts, params)
        try:
            while any(r in self._live for r in rids):
                self._advance()
            with self._lock:
                return [self._finished.pop(r) for r in rids]
        finally:
            self._release(rids)

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[StepOutput]:
        """Yield the ``StepOutput`` updates of these prompts (all decode together, with anything else queued) until
        all have finished.  Same checks and limits as ``generate``.  When the generator is closed early, or the
        consumer raises or is interrupted, the unfinished requests are aborted and their blocks freed."""
        rids = self._add_all(prompts, params)
        inbox: deque[StepOutput] = deque()
        with self._lock:
            for r in rids:
                self._inboxes[r] = inbox  # every step, whoever runs it, delivers these requests' updates here
        try:
            while True:
                with self._lock:
                    ready = list(inbox)
                    inbox.clear()
                    done = not any(r in self._live for r in rids)
                if ready:
                    yield from ready
                elif done:
                    return
                else:
                    self._advance()
        finally:
            self._release(rids)
