"""LLMEngine: requests in, tokens out, one scheduling step at a time.

    step() = scheduler.schedule()  →  runner.run() (one packed forward + sampling)  →  scheduler.postprocess()

``add_request`` queues a prompt; each ``step`` returns what it produced as ``StepOutput`` updates (the new token,
its text delta, whether that sample finished) so callers can stream; ``generate`` runs prompts to completion.
The scheduler (``scheduler.py``) decides which tokens run under the token, sequence and KV-block budgets; the
runner (``model_runner.py``) owns the paged K/V tensors.  This file only joins them and turns ids into text.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from minillm.config import EngineConfig
from minillm.engine.detokenizer import IncrementalDetokenizer
from minillm.engine.model_runner import ModelRunner
from minillm.engine.scheduler import Scheduler, SchedulerStats
from minillm.engine.sequence import Request, SequenceStatus
from minillm.engine.sequence import Sequence as Seq
from minillm.engine.simple import validate_prompts
from minillm.kv.paged_cache import PagedKVCache, kv_bytes_per_block
from minillm.models.llama import Transformer
from minillm.outputs import CompletionOutput, RequestOutput, StepOutput
from minillm.sampling.params import SamplingParams
from minillm.sampling.sampler import make_generator

Prompt = str | Sequence[int]


class LLMEngine:
    """A Transformer, its paged KV cache and a scheduler.  ``tokenizer`` is optional (then prompts are id lists).

    ``config`` is an ``EngineConfig``; ``eos_token_ids`` default to the model's and the tokenizer's EOS.
    """

    def __init__(self, model: Transformer, tokenizer=None, config: EngineConfig | None = None, *,
                 eos_token_ids: Sequence[int] | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config if config is not None else EngineConfig()
        mc = model.config
        self.max_model_len = min(mc.max_position_embeddings, config.max_model_len or mc.max_position_embeddings)
        if mc.sliding_window is not None:  # the paged cache attends to everything: within the window that is exact
            self.max_model_len = min(self.max_model_len, mc.sliding_window)
        if eos_token_ids is None:
            eos = set(mc.eos_token_ids)
            if tokenizer is not None and tokenizer.eos_token_id is not None:
                eos.add(tokenizer.eos_token_id)
            eos_token_ids = sorted(eos)
        self.eos_token_ids = tuple(eos_token_ids)
        num_blocks = config.resolve_num_blocks(kv_bytes_per_block(mc, config.block_size, model.dtype),
                                               self.max_model_len)
        num_host = config.resolve_host_blocks(num_blocks)
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len, num_host_blocks=num_host,
                                   eos_token_ids=self.eos_token_ids)
        self.kv_cache = PagedKVCache(mc, num_blocks, config.block_size, dtype=model.dtype, device=model.device,
                                     num_host_blocks=num_host)
        self.runner = ModelRunner(model, self.kv_cache, self.scheduler.block_manager)
        self._detoks: dict[Seq, IncrementalDetokenizer] = {}
        self._finished: dict[str, RequestOutput] = {}
        self._live: dict[str, Request] = {}
        self._ids = itertools.count()

    @property
    def block_manager(self):
        return self.scheduler.block_manager

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    # ---- requests ----------------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """A string (needs the tokenizer) or a sequence of ids -> list of ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: LLMEngine(model, tokenizer) or pass token ids")
            return self.tokenizer(prompt, add_special_tokens=True).input_ids
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("a prompt must be a string or a list of int token ids")
        return ids

    def _make_request(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                      arrival_time: float | None) -> Request:
        params = params if params is not None else SamplingParams()
        ids = self.encode(prompt)
        validate_prompts([ids], self.max_model_len, self.model.config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: LLMEngine(model, tokenizer), or stop on token ids")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use; pass a new one or let the engine pick")
        self.scheduler.check(request_id, len(ids), params)
        seeds = [None if params.seed is None else (params.seed + i) % 2**63 for i in range(params.n)]
        generators = [make_generator(dataclasses.replace(params, seed=s), self.model.device) for s in seeds]
        return Request(request_id, ids, params, time.perf_counter() if arrival_time is None else arrival_time,
                       generators, prompt=prompt if isinstance(prompt, str) else None)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a prompt; returns its request id.  Raises ``ValueError`` (and queues nothing) for a request that
        could never run: empty or too long for the context, or needing more KV blocks than the whole cache."""
        request = self._make_request(prompt, params, request_id, arrival_time)
        self.scheduler.add(request)
        self._live[request.request_id] = request
        return request.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; its partial output is kept with finish_reason "abort"."""
        self.scheduler.abort(request_id)
        self._retire(self._live[request_id])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def pop_output(self, request_id: str) -> RequestOutput:
        """The result of a finished (or aborted) request, handed over once."""
        if request_id not in self._finished:
            raise KeyError(f"request {request_id!r} has not finished (or its output was already taken)")
        return self._finished.pop(request_id)

    # ---- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule → run the model → postprocess.  Returns one update per token produced this step."""
        out = self.scheduler.schedule(time.perf_counter())
        result = self.runner.run(out, self.config.return_logits)  # also runs swap copies when nothing is scheduled
        if out.is_empty:
            return []
        rows = [i for i, s in enumerate(s for s in out.scheduled if s.samples) for _ in range(s.num_samples)]
        new = self.scheduler.postprocess(out, result.tokens, time.perf_counter())
        updates = []
        for (seq, token), row in zip(new, rows, strict=True):
            updates.append(self._emit(seq, token, None if result.logits is None else result.logits[row]))
        for request in {seq.request for seq, _ in new}:
            if request.finished:
                self._retire(request)
        return updates

    def _emit(self, seq: Seq, token: int, logits: Tensor | None) -> StepOutput:
        """Detokenize the new token; a completed stop string finishes the sequence here."""
        delta = ""
        if self.tokenizer is not None:
            detok = self._detoks.setdefault(seq, IncrementalDetokenizer(self.tokenizer, seq.request.params.stop))
            eos = (seq.status is SequenceStatus.FINISHED_STOPPED and token in self.eos_token_ids
                   and not seq.request.params.ignore_eos)
            if not eos:  # EOS is not part of the text
                delta = detok.push(token)
            if detok.stopped:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED, time.perf_counter())
            if seq.status.finished:
                delta += detok.flush()  # no token follows: release held-back bytes
        return StepOutput(seq.request.request_id, seq.index, [token], delta, seq.finish_reason, logits)

    def _retire(self, request: Request) -> None:
        samples = []
        for seq in request.seqs:
            detok = self._detoks.pop(seq, None)
            samples.append(CompletionOutput(seq.index, detok.text if detok else "", seq.output,
                                            seq.finish_reason or "abort", seq.metrics))
        first = samples[0]
        self._finished[request.request_id] = RequestOutput(
            prompt=request.prompt, prompt_token_ids=request.prompt_token_ids, text=first.text,
            token_ids=first.token_ids, finish_reason=first.finish_reason, metrics=first.metrics, outputs=samples)
        self._live.pop(request.request_id, None)

    # ---- offline convenience -----------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (together with anything already queued); outputs in prompt order.

        Every prompt is checked before any is queued, so a bad one raises without starting the others.
        """
        prompt_list = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        if not prompt_list:
            raise ValueError("no prompts given")
        params = params if params is not None else SamplingParams()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(param_list)} SamplingParams")
        requests = [self._make_request(p, sp, None, None)
                    for p, sp in zip(prompt_list, param_list, strict=True)]
        for r in requests:
            self.scheduler.add(r)
            self._live[r.request_id] = r
        pending = {r.request_id for r in requests}
        while pending & self._live.keys():
            if not self.step() and not self.scheduler.running:
                time.sleep(1e-3)  # dynamic batching: waiting for the window to close
        return [self.pop_output(r.request_id) for r in requests]


def _is_ids(x) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, (list, tuple)) and len(x) > 0 and isinstance(x[0], int))
