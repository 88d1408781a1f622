"""OpenAI's request and response bodies as pydantic models, with OpenAI's field names.

Requests forbid unknown fields (OpenAI answers "Unrecognized request argument" too), so a typo such as
``temprature`` is a 400, not a silently ignored setting.  Fields OpenAI defines but minillm cannot honour
(``tools``, ``response_format``, ...) are declared so that ``unsupported_fields`` can name them in a 400;
``top_k``, ``ignore_eos``, ``repetition_penalty``, ``min_p``, ``min_tokens``, ``stop_token_ids`` and
``include_stop_str_in_output`` are vLLM's extensions, accepted with vLLM's meanings.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI fields the engine has no implementation for, with the value that means "not used".
UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "best_of": None, "suffix": None, "tools": None, "tool_choice": None, "functions": None,
    "function_call": None, "response_format": None, "parallel_tool_calls": None,
}


class OpenAIBaseModel(BaseModel):
    """Base of the request models: unknown fields are an error, as on api.openai.com."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(OpenAIBaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with no choices and the request's usage."""

    include_usage: bool = False


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
    # Declared so that the error names them (see unsupported_fields).
    response_format: Any = None


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


def unsupported_fields(request: BaseModel) -> list[str]:
    """Names of the fields set to something other than their "not used" value (the engine cannot honour them)."""
    return [name for name, off in UNSUPPORTED_DEFAULTS.items()
            if name in request.model_fields_set and getattr(request, name, off) not in (off, None)]


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
    stop_reason: int | str | None = None  # vLLM: the stop token id that ended it


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed completion (same object type, as in OpenAI's API)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(BaseModel):
    """The reply of a chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM: the stop token id that ended it


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


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


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
