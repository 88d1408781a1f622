"""OpenAI's request and response bodies as pydantic models, with OpenAI's field names.

Requests ignore unknown fields, as vLLM does (api.openai.com refuses them): clients written for newer SDKs or
for other servers send fields minillm does not know (``store``, ``metadata``, ``service_tier``, ...), and refusing
them breaks those clients.  The cost is that a typo such as ``temprature`` is silently ignored too: the server
logs one warning per unknown field name and lists the request's ignored fields in its ``X-Ignored-Fields``
response header (``ignored_fields``), so a client can still see them.  Fields OpenAI defines but minillm cannot
honour (``suffix``, the deprecated ``functions``, ...) are declared: their "off" values (in ``OFF_VALUES``) are
accepted, anything else is a 400 naming the field (``unsupported_fields``); so are vLLM's extensions minillm does
not implement (``use_beam_search``, ``bad_words``, ... in ``VLLM_EXTRA_OFF_VALUES``), which are known, not
ignored.  ``top_k``, ``ignore_eos``, ``repetition_penalty``, ``min_p``, ``min_tokens``, ``stop_token_ids``,
``include_stop_str_in_output``, ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
``guided_decoding_backend`` and ``structured_outputs`` are vLLM's extensions, accepted with vLLM's meanings.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# OpenAI fields the engine has no implementation for, with the values that mean "not used" (compared with their
# type: False is not 0).  ``best_of`` is off when it equals ``n`` (see unsupported_fields).
OFF_VALUES: dict[str, tuple] = {"suffix": (None,), "functions": (None, []), "function_call": (None, "none")}
# vLLM's extensions (sent as extra fields) that minillm does not implement yet, with their "off" values (null is
# off too).  Known, so a value that asks for them is a 400 naming the field rather than silently ignored like an
# unknown field; a field that the request models declare is never looked up here.
VLLM_EXTRA_OFF_VALUES: dict[str, tuple] = {
    "prompt_logprobs": (), "use_beam_search": (False,), "length_penalty": (1.0, 1),
    "bad_words": ([],), "allowed_token_ids": (), "truncate_prompt_tokens": (),
}


class OpenAIBaseModel(BaseModel):
    """Base of the request models: unknown fields are kept in ``model_extra`` and ignored (``ignored_fields``)."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with no choices and the request's usage;
    ``continuous_usage_stats`` (vLLM's extension, with ``include_usage``) puts the usage so far in every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(OpenAIBaseModel):
    """The fields completions and chat completions share (types only; values are checked by SamplingParams)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; 0 or -1 disable it
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as a label for the caller's own logs
    logit_bias: dict[str, float] | None = None  # token id (as a string: JSON keys) -> bias in [-100, 100]
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    # vLLM's sampling extensions, with vLLM's meanings (SamplingParams documents each)
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    response_format: Any = None  # {"type": "text" | "json_object" | "json_schema", ...}: structured.py
    # vLLM's structured-output extras (structured.py): a JSON schema, a regex, a list of strings, an EBNF grammar
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # who computes the masks, per request (vLLM's field until it made the backend server-wide): "xgrammar" (the
    # default) or "minillm" (the engine's own regex DFA, guided_regex only)
    guided_decoding_backend: str | None = None
    # vLLM's current form of the same: {"json" | "regex" | "choice" | "grammar" | "json_object": ..., options}
    structured_outputs: Any = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt, a string or a list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # 0-5: the sampled token's logprob + this many alternatives per token
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's, the first null)
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """One message of a conversation; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="allow")  # e.g. "name": passed through to the chat template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``; ``max_tokens`` (or ``max_completion_tokens``) None = up to the context."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False  # the sampled tokens' logprobs
    top_logprobs: int | None = None  # 0-20 alternatives per token (with logprobs)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None


def _is_off(value: Any, offs: tuple) -> bool:
    return any(type(value) is type(off) and value == off for off in offs)


def unsupported_fields(request: BaseModel) -> list[str]:
    """Names of the fields set to something other than a "not used" value (the engine cannot honour them)."""
    bad = [name for name, offs in OFF_VALUES.items()
           if name in request.model_fields_set and not _is_off(getattr(request, name, None), offs)]
    extra = request.model_extra or {}
    bad += [name for name, offs in VLLM_EXTRA_OFF_VALUES.items()
            if name in extra and not _is_off(extra[name], (None, *offs))]
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of != request.n:
        bad.append("best_of")
    return bad


def ignored_fields(request: BaseModel, prefix: str = "") -> list[str]:
    """The request's unknown fields (dotted paths, e.g. ``store``, ``stream_options.foo``), which the server
    ignores; nested request models are searched too.  vLLM's known extensions are not listed (an "off" one asks
    for nothing; any other value is refused by ``unsupported_fields``)."""
    out = [prefix + name for name in (request.model_extra or {}) if name not in VLLM_EXTRA_OFF_VALUES]
    for name in request.model_fields_set:
        value = getattr(request, name)
        if isinstance(value, OpenAIBaseModel):
            out += ignored_fields(value, f"{prefix}{name}.")
    return sorted(out)


# ---- responses ---------------------------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions ``logprobs``: per token its text, logprob (null for an echoed prompt's first
    token), {text: logprob} of the sampled token and the top alternatives, and its offset in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    """One alternative of a chat token: its text, logprob and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """One sampled chat token and its ``top_logprobs`` alternatives, most likely first."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs``: one entry per content token."""

    content: list[ChatTokenLogprob] | None = None


def random_id(prefix: str) -> str:
    """An OpenAI-looking id such as ``chatcmpl-3f2a...``; also the engine's request id."""
    return f"{prefix}-{uuid.uuid4().hex}"


class UsageInfo(BaseModel):
    """Token counts of a request: the prompt once, the completion summed over its ``n`` choices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    """One choice of a completion (or a streamed piece of one)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop token id or stop string that ended it


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed completion (same object type, as in OpenAI's API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCall(BaseModel):
    """The function a tool call calls and its arguments (a JSON string, as OpenAI sends them)."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One call the assistant makes (``tools.py``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The reply of a chat completion: text, or (``content`` None) the tool calls it makes."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM: the stop token id or stop string that ended it


class ChatCompletionResponse(BaseModel):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """What one streamed chunk adds to a choice: the role (first chunk) and/or a piece of content."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # pieces of calls (tools.tool_call_stream)

    @model_serializer(mode="wrap")
    def _without_absent_tool_calls(self, handler):
        """A delta without tool calls leaves the key out: plain text streams stay as they were."""
        data = handler(self)
        if self.tool_calls is None:
            data.pop("tool_calls", None)
        return data


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: on the last chunk, the stop token id or stop string that ended it


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (``choices`` is empty in the usage chunk)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "minillm"
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """The body of every error: ``{"error": {"message", "type", "param", "code"}}``."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorInfo
