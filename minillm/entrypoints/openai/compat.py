"""vLLM's request semantics, where they differ from a strict reading of OpenAI's API.

- **Unknown fields are ignored** (``FieldWarnings``): logged once per field name, listed per response in the
  ``X-Ignored-Fields`` header.
- **The context is checked up front** (``context_error``): a prompt that leaves no room for an output token, or a
  prompt plus an explicit ``max_tokens`` over the context, is a 400 with code ``context_length_exceeded`` and
  vLLM's message, instead of a request cut short with ``finish_reason: "length"``.  ``max_tokens`` omitted (chat)
  or null (both endpoints) means the rest of the context, as in vLLM; completions default to 16, OpenAI's and
  vLLM's default.  The Python API (``LLM.generate``) keeps the engine's cut at the context, as vLLM's offline
  ``LLM`` does: there a too-long prompt raises ``ValueError`` and prompt + ``max_tokens`` ends at the context
  with ``finish_reason "length"``.
- **``stream_options.continuous_usage_stats``** (``UsageEveryChunk``): every streamed chunk carries its choice's
  usage so far (the prompt tokens of the choice's prompt, the tokens that choice has generated), as vLLM counts
  with ``n`` > 1 or several prompts; the last usage chunk counts every choice.
- **``stop_reason``** (``StopReasonTap`` in streams): the stop string or stop token id that ended a choice, on its
  last chunk too; null at EOS or the length limit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterable, AsyncIterator, Sequence

from minillm.outputs import StepOutput

log = logging.getLogger("minillm.serve")

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
MAX_LISTED_FIELDS = 16  # names in one header; the rest are counted ("+N more")
MAX_NAME_CHARS = 64  # a field name is shown up to this many characters


def printable_name(name: str) -> str:
    """A field name as a header value may carry it: ASCII with backslash escapes (a JSON key may hold any
    character, CR/LF and non-Latin-1 included, and HTTP headers cannot), cut to ``MAX_NAME_CHARS``."""
    shown = name.encode("unicode_escape").decode("ascii")
    return shown if len(shown) <= MAX_NAME_CHARS else shown[: MAX_NAME_CHARS - 3] + "..."


class FieldWarnings:
    """Logs each unknown request field name once (not once per request: a client that always sends ``store``
    would flood the log); at most ``max_names`` names are remembered, so hostile clients cannot grow it."""

    def __init__(self, max_names: int = 1024):
        self.max_names = max_names
        self.seen: set[str] = set()

    def headers(self, fields: Sequence[str]) -> dict[str, str]:
        """Warn about the names not seen before; the response headers that list ``fields`` (none if empty)."""
        shown = [printable_name(name) for name in fields]
        for name in shown:
            if name not in self.seen and len(self.seen) < self.max_names:
                self.seen.add(name)
                log.warning("ignoring the unknown request field '%s' (listed in the %s response header; logged "
                            "once)", name, IGNORED_FIELDS_HEADER)
        if not shown:
            return {}
        more = len(shown) - MAX_LISTED_FIELDS
        return {IGNORED_FIELDS_HEADER: ", ".join(shown[:MAX_LISTED_FIELDS]) + (f", +{more} more" if more > 0 else "")}


def context_error(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> str | None:
    """vLLM's message when a request does not fit the context, else None.  ``max_tokens`` None: the rest of the
    context (then only the prompt is checked; it must leave room for one output token)."""
    if prompt_tokens >= max_model_len:
        return (f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{prompt_tokens} input tokens (at least one output token must fit). Please reduce the length of "
                "the input messages.")
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.")
    return None


def reparse(text: str) -> dict | None:
    """The JSON body of a ``data: {...}`` chunk event, else None (``[DONE]``)."""
    return json.loads(text[len("data: "):]) if text.startswith("data: {") else None


class UsageEveryChunk:
    """``continuous_usage_stats``: ``count`` passes the engine's updates through, counting each choice's tokens;
    ``add_usage`` then writes the usage so far of a chunk's choice into every chunk event that has none.
    ``prompt_tokens[i]``: the prompt tokens of choice i's prompt.  (A wrapper around the SSE events rather than a
    change to ``sse_stream``: one JSON re-encode per chunk, only for clients that ask.)"""

    def __init__(self, prompt_tokens: Sequence[int]):
        self.prompt_tokens = list(prompt_tokens)
        self.completion_tokens = [0] * len(self.prompt_tokens)

    async def count(self, updates: AsyncIterable[StepOutput]) -> AsyncIterator[StepOutput]:
        async for u in updates:
            self.completion_tokens[u.index] += len(u.token_ids)
            yield u

    async def add_usage(self, events: AsyncIterable[str]) -> AsyncIterator[str]:
        async for text in events:
            chunk = reparse(text)
            if chunk is None or not chunk.get("choices") or chunk.get("usage") is not None:
                yield text  # [DONE], an error event, or the final usage chunk
                continue
            i = chunk["choices"][0]["index"]  # one choice per chunk
            prompt, done = self.prompt_tokens[i], self.completion_tokens[i]
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
            yield f"data: {json.dumps(chunk)}\n\n"


class StopReasonTap:
    """vLLM's ``stop_reason`` in a stream: ``updates`` passes the engine's updates through and keeps each choice's
    (the last update of a choice carries it); ``events`` writes it into that choice's finishing chunk.  Only a
    chunk that finishes a choice with a reason is re-encoded."""

    def __init__(self):
        self.reasons: dict[int, int | str] = {}

    async def updates(self, updates: AsyncIterable[StepOutput]) -> AsyncIterator[StepOutput]:
        async for u in updates:
            if u.stop_reason is not None:
                self.reasons[u.index] = u.stop_reason
            yield u

    async def events(self, events: AsyncIterable[str]) -> AsyncIterator[str]:
        async for text in events:
            if self.reasons and '"finish_reason":null' not in text.replace(" ", ""):
                chunk = reparse(text)
                for choice in (chunk or {}).get("choices") or ():
                    if choice.get("finish_reason") is not None and choice["index"] in self.reasons:
                        choice["stop_reason"] = self.reasons.pop(choice["index"])
                        text = f"data: {json.dumps(chunk)}\n\n"
            yield text
