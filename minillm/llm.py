"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``.

``LLM`` is thin: a model, its tokenizer and chat template over one ``LLMEngine``.  ``generate`` and ``stream`` are
the engine's (same checks, same limits, same outputs); prompts are checked in ``engine/inputs.py``.  The naive
and cached teaching loops of notebooks 01–02 live in ``engine/simple.py`` and are called directly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from minillm.config import EngineConfig, ParallelConfig
from minillm.engine.inputs import Prompt, chat_prompt_ids, merge_eos_token_ids, to_token_ids
from minillm.engine.llm_engine import LLMEngine
from minillm.engine.runners import check_parallel
from minillm.models.loader import load_model, load_tokenizer
from minillm.outputs import RequestOutput, StepOutput
from minillm.sampling.params import SamplingParams


class LLM:
    """A model and its tokenizer, ready to generate.

    ``model``: None (the embedded SmolLM2-135M-Instruct, offline), a hub id, a local directory or a ``.gguf``.
    ``dtype``: "float32" | "float16" | "bfloat16" | None; ``device``: "cpu" | "cuda" | None (CUDA when present);
    ``kernels``: "auto" | "torch" | "native" | "triton" | "compiled" (``kernels.select``); ``quantization``: None |
    "int8" | "int4" | "awq" | "gptq" (weight-only, see ``load_model``: "int4" on the default model runs its own Q4_1
    blocks) | "w8a8" | "w8a8-static" | "w8a8-smooth" | "fp8" (weights and activations, ``quant.smooth``;
    ``quantization_config={"alpha": α}`` sets SmoothQuant's α for "w8a8-smooth").
    Other keyword arguments are ``EngineConfig`` options (``policy``, ``block_size``, ``num_kv_blocks``,
    ``max_num_seqs``, ``max_model_len``, ``kv_cache_dtype`` = "auto" | "int8" | "fp8" (K/V stored as 1-byte codes
    with a scale per token and head: ~2×/4× the tokens of bf16/fp32 in the same memory), ...) for the
    ``LLMEngine`` that ``generate`` and ``stream`` run on —
    ``speculative_config={"method": "ngram" | "early_exit" | "draft" | "quantized", "num_speculative_tokens": γ,
    ...}`` (vLLM's shape, ``SpeculativeConfig``) turns on speculative decoding; ``enforce_eager=True`` turns off
    decode through static buffers (CUDA graphs on a GPU; ``engine.cuda_graph``).

    Thread model: ``generate``, ``stream`` and ``chat`` may be called from several threads at once; the engine's
    lock serialises each step and each call gets exactly its own requests' outputs (see ``LLMEngine``).
    """

    def __init__(self, model: str | os.PathLike | None = None, *, dtype=None, device=None, kernels: str = "auto",
                 quantization: str | None = None, quantization_config: dict | None = None,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 **engine_options):
        if (tensor_parallel_size, pipeline_parallel_size) != (1, 1):
            if engine_options.get("parallel_config") is not None:
                raise ValueError("give either parallel_config or tensor_parallel_size / pipeline_parallel_size")
            engine_options["parallel_config"] = ParallelConfig(tensor_parallel_size, pipeline_parallel_size)
        self.engine_config = EngineConfig(**engine_options)  # validated before the model loads
        self.model = load_model(model, dtype=dtype, device=device, kernels=kernels, quantization=quantization,
                                quantization_config=quantization_config)
        check_parallel(self.model, self.engine_config)  # ValueError naming the valid sizes, before any process starts
        parallel = self.engine_config.parallel_config
        self.tensor_parallel_size = parallel.tensor_parallel_size
        self.pipeline_parallel_size = parallel.pipeline_parallel_size
        self.tokenizer = load_tokenizer(model)
        self._engine: LLMEngine | None = None  # built on first use: the KV cache (and any worker process) then
        self._closed = False

    @property
    def engine(self) -> LLMEngine:
        """The ``LLMEngine`` behind ``generate`` and ``stream`` (built on first use with this ``EngineConfig``).
        With ``tensor_parallel_size`` > 1 it runs here on rank 0's shard, with ``pipeline_parallel_size`` > 1 on
        stage 0's layers, and the worker processes start with it (``distributed.driver``, ``distributed.pp_driver``):
        once per ``LLM``, reused by every call until ``shutdown``."""
        if self._closed:
            raise RuntimeError("this LLM was shut down (LLM.shutdown()): create a new LLM to generate again")
        if self._engine is None:
            self._engine = LLMEngine(self.model, self.tokenizer, self.engine_config)
        self._engine.check()
        return self._engine

    def _check_workers(self) -> None:
        """Raise the worker processes' failure (``WorkerError`` naming the rank), if any."""
        if self._engine is not None:
            self._engine.check()

    def shutdown(self) -> None:
        """Free the engine and stop its worker processes (tensor / pipeline parallel); later calls raise
        ``RuntimeError``.  Also runs on ``with LLM(...) as llm:`` exit; an LLM that is garbage collected, or alive
        at interpreter exit, stops its workers too (a ``weakref.finalize`` in the driver)."""
        self._closed = True
        if self._engine is not None:
            self._engine.shutdown()
        self._engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a reply: the model config's and the tokenizer's EOS (as the engine merges them)."""
        return merge_eos_token_ids(self.model.config.eos_token_ids, self.tokenizer)

    # --- prompts -----------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """A string (tokenized with special tokens) or 1-d token ids -> a list of ids (no KV cache allocated)."""
        return to_token_ids(prompt, self.tokenizer)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Messages [{"role": str, "content": str}] -> prompt ids ending with the assistant's turn; ``tools``
        (OpenAI's function list) are rendered by templates that support them."""
        return chat_prompt_ids(self.tokenizer, messages, tools)

    # --- generation ----------------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string or token ids, or a list of those) on the engine (continuous batching,
        paged KV, prefix caching); outputs in prompt order.  See ``LLMEngine.generate``.  With
        ``tensor_parallel_size`` or ``pipeline_parallel_size`` > 1 the engine schedules here and every step runs on
        all ranks (each holds a shard of every layer, or a stage of the layers; the workers start on the first call,
        seconds, and are reused); a worker that dies raises ``WorkerError`` (a RuntimeError) naming its rank, and
        every later call raises it too.

        Logprobs, as vLLM returns them: with ``SamplingParams(logprobs=k)`` each sample's ``outputs[j].logprobs``
        holds per generated token ``{token_id: Logprob(logprob, rank, decoded_token)}`` (the sampled token, then the
        top k); with ``prompt_logprobs=k``, ``prompt_logprobs`` holds the same per prompt token (None for the
        first)."""
        outputs = self.engine.generate(prompts, sampling_params)
        self._check_workers()  # a worker lost mid-call ends the requests with errors in the engine: raise it
        return outputs

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[StepOutput]:
        """Yield ``StepOutput`` updates (request_id, sample index, new token ids, text delta, finish_reason; the
        last update of a sample carries its metrics) as the engine produces them.  The concatenated deltas of a
        request equal ``generate``'s text.  Closing the generator early aborts the unfinished requests."""
        yield from self.engine.stream(prompts, sampling_params)
        self._check_workers()

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the reply is generated with the chat template.
        ``tools`` (``[{"type": "function", "function": {"name", "description", "parameters"}}]``, as vLLM's
        ``LLM.chat``) go into the template for models whose template renders them; to force a call's shape,
        constrain the reply with ``SamplingParams(guided_decoding=GuidedDecodingParams(json=parameters_schema))``."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c, tools) for c in convs], sampling_params)
