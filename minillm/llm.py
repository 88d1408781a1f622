"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch

from minillm.config import EngineConfig
from minillm.engine.detokenizer import IncrementalDetokenizer
from minillm.engine.simple import SequenceState, stream_cached, stream_naive
from minillm.models.loader import load_model, load_tokenizer
from minillm.outputs import RequestOutput, StreamEvent
from minillm.sampling.params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """A model and its tokenizer, ready to generate.

    ``model``: None (the embedded SmolLM2-135M-Instruct, offline), a hub id, a local directory or a ``.gguf``.
    ``dtype``: "float32" | "float16" | "bfloat16" | None; ``device``: "cpu" | "cuda" | None (CUDA when present);
    ``kernels``: "auto" | "torch" | "native"; ``cached=False`` uses the naive recompute loop (for teaching).
    Other keyword arguments are ``EngineConfig`` options (``policy``, ``block_size``, ``num_kv_blocks``,
    ``max_num_seqs``, ...) for the ``LLMEngine`` that ``generate`` runs on; ``stream`` uses the simple cached loop.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, dtype=None, device=None, kernels: str = "auto",
                 cached: bool = True, **engine_options):
        self.engine_config = EngineConfig(**engine_options)  # validated before the model loads
        self.model = load_model(model, dtype=dtype, device=device, kernels=kernels)
        self.tokenizer = load_tokenizer(model)
        self.cached = cached
        self._engine = None  # built on the first generate(): the KV cache is allocated then
        eos = set(self.model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))

    # --- prompts -----------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: pass a non-empty string or a list of token ids")
            return self.tokenizer(prompt, add_special_tokens=True).input_ids
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("a prompt must be a string or a list of int token ids")
        return ids

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Messages [{"role": ..., "content": ...}] -> prompt ids ending with the assistant's turn."""
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError('messages must be a non-empty list of {"role": ..., "content": ...} dicts')
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: use generate() with a plain prompt")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    # --- generation ----------------------------------------------------------------------------------------
    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None,
               _states: list | None = None) -> Iterator[StreamEvent]:
        """Yield text deltas as tokens are produced (all prompts decode together)."""
        prompt_list = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        if not prompt_list:
            raise ValueError("no prompts given")
        params = params or SamplingParams()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"got {len(prompt_list)} prompts but {len(param_list)} SamplingParams")
        if any(p.n != 1 for p in param_list):
            raise ValueError("SamplingParams.n > 1 (parallel samples) needs the engine; use n=1 here")
        ids = [self.encode(p) for p in prompt_list]
        detoks = [IncrementalDetokenizer(self.tokenizer, p.stop) for p in param_list]
        pushed: dict[int, str] = {}

        def stop_checker(i: int, output: list[int]) -> bool:  # runs for every non-EOS token, before yielding it
            pushed[i] = detoks[i].push(output[-1])
            return detoks[i].stopped

        loop = stream_cached if self.cached else stream_naive
        states: list[SequenceState] = [] if _states is None else _states
        for ev in loop(self.model, ids, param_list, self.eos_token_ids, stop_checker, states):
            delta = pushed.pop(ev.index, "")  # EOS is never pushed: it is not part of the text
            if ev.finish_reason is not None:
                delta += detoks[ev.index].flush()
            yield StreamEvent(ev.index, ev.token_id, delta, ev.finish_reason)
        self._last = (prompt_list, ids, detoks, states)

    @property
    def engine(self):
        """The ``LLMEngine`` behind ``generate`` (built on first use with this LLM's ``EngineConfig``)."""
        if self._engine is None:
            from minillm.engine.llm_engine import LLMEngine  # engine.py imports this module's RequestOutput

            self._engine = LLMEngine(self.model, self.tokenizer, self.engine_config, eos_token_ids=self.eos_token_ids)
        return self._engine

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (strings or token-id lists) on the engine (continuous batching, paged KV,
        prefix caching); outputs in prompt order.  ``cached=False`` runs the naive loop instead."""
        if self.cached:
            return self.engine.generate(prompts, sampling_params)
        states: list[SequenceState] = []
        for _ in self.stream(prompts, sampling_params, states):
            pass
        prompt_list, ids, detoks, _ = self._last
        return [RequestOutput(prompt=p if isinstance(p, str) else None, prompt_token_ids=i, text=d.text,
                              token_ids=s.output, finish_reason=s.finish_reason or "length", metrics=s.metrics)
                for p, i, d, s in zip(prompt_list, ids, detoks, states, strict=True)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the reply is generated with the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in convs], sampling_params)


def _is_ids(x) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, (list, tuple)) and len(x) > 0 and isinstance(x[0], int))
