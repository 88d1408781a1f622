"""OpenAI's request and response bodies as pydantic models, with OpenAI's field names.

Requests forbid unknown fields (OpenAI answers "Unrecognized request argument" too), so a typo such as
``temprature`` is a 400, not a silently ignored setting.  Fields OpenAI defines but minillm cannot honour
(``logprobs``, penalties, ...) are declared so that ``unsupported_fields`` can name them in a 400;
``top_k`` and ``ignore_eos`` are vLLM's extensions, accepted with vLLM's meanings.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# OpenAI fields the engine has no implementation for, with the value that means "not used".
UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "logprobs": None, "top_logprobs": None, "echo": False, "best_of": None, "suffix": None, "logit_bias": None,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "functions": None, "function_call": None,
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
    # Declared so that the error names them (see unsupported_fields).
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    response_format: Any = None  # {"type": "text" | "json_object" | "json_schema", ...}: structured.py
    # vLLM's structured-output extras (structured.py): a JSON schema, a regex, a list of strings, an EBNF grammar
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt, a string or a list of token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
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
    logprobs: None = None
    finish_reason: str | None = None


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
    logprobs: None = None
    finish_reason: str | None


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
    logprobs: None = None
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
