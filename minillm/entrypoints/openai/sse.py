"""Server-sent events: one response's ``StepOutput``s as OpenAI's streamed chunks (pure: no I/O, no clock).

    data: {"id": "chatcmpl-…", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": …}}]}
    data: {… "choices": [{"index": 0, "delta": {"content": " Paris"}, "finish_reason": null}]}
    data: {… "choices": [{"index": 0, "delta": {"content": "."}, "finish_reason": "stop"}]}
    data: {… "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}
    data: [DONE]

SSE (the ``text/event-stream`` format) is plain text over one long HTTP response: every event is a ``data:`` line
and a blank line, so any client that reads lines can follow it, through proxies that know nothing about it.
``sse_stream`` is what the server (``server.py``) sends for a streamed request; the handler around it does the
I/O: it merges the engine's per-request queues into one async stream of updates, turns an engine failure into an
error event, and closes the requests when the client leaves.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel

from minillm.entrypoints.openai import protocol as p
from minillm.outputs import StepOutput


@dataclass(frozen=True)
class StreamMeta:
    """What every chunk of one streamed response repeats (``id``, ``model``, ``created``: one Unix time for the
    whole response, as OpenAI sends it) and what the stream must carry: ``chat`` (chat-completion chunks, which
    open each choice with the assistant role) or completion chunks; ``num_choices`` choices (prompts × ``n``,
    numbered 0 … num_choices − 1); a last usage chunk when ``include_usage``, counting ``prompt_tokens`` and the
    tokens the updates carried."""

    id: str
    model: str
    created: int
    chat: bool
    num_choices: int = 1
    include_usage: bool = False
    prompt_tokens: int = 0

    def __post_init__(self):
        if not isinstance(self.num_choices, int) or self.num_choices < 1:
            raise ValueError(f"num_choices must be an int >= 1, got {self.num_choices!r}")
        if not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an int >= 0, got {self.prompt_tokens!r}")


def event(item: BaseModel | str) -> str:
    """One server-sent event: ``data: <JSON of item, or the string itself>`` and the blank line that ends it."""
    data = item if isinstance(item, str) else item.model_dump_json()
    return f"data: {data}\n\n"


def chunk(meta: StreamMeta, choices: list[dict], usage: dict | None = None) -> str:
    """The event of one chunk: ``choices`` (dicts with OpenAI's fields — chat: ``index``, ``delta``,
    ``finish_reason``; completions: ``index``, ``text``, ``finish_reason``) and ``usage`` (``prompt_tokens``,
    ``completion_tokens``, ``total_tokens``) inside the envelope ``meta`` gives (id, object, created, model).
    Fields left out take OpenAI's defaults (null); a wrong field name or type raises pydantic's error."""
    model = p.ChatCompletionChunk if meta.chat else p.CompletionResponse
    return event(model(id=meta.id, model=meta.model, created=meta.created, choices=choices, usage=usage))


async def sse_stream(updates: AsyncIterable[StepOutput], meta: StreamMeta) -> AsyncIterator[str]:
    """The events of one streamed response, in order (each a string from ``chunk`` or ``event``):

    1. chat only: for each choice i, a role chunk ``{"index": i, "delta": {"role": "assistant", "content": ""}}``;
    2. for each update ``u`` (a ``StepOutput``: ``u.index`` is its choice, ``u.text`` the *new* text, already
       cut before a stop string, ``u.token_ids`` the new tokens, ``u.finish_reason`` None until its last update)
       that has text or finishes: one chunk with that choice — chat ``{"index", "delta": {"content": u.text},
       "finish_reason"}``, completions ``{"index", "text": u.text, "finish_reason"}``; an update with neither
       (bytes of a character, or a possible stop string, held back) sends nothing;
    3. with ``meta.include_usage``: a chunk with no choices and the usage — ``meta.prompt_tokens``, the tokens
       of every update, their sum;
    4. ``data: [DONE]`` (``event("[DONE]")``): the end, which a client cannot tell from a dropped connection
       otherwise.

    ``updates`` is an async iterable (the server's live stream); an exception it raises passes through.
    """
    if meta.chat:  # the role first, once per choice: clients build the message from the deltas that follow
        for i in range(meta.num_choices):
            yield chunk(meta, [{"index": i, "delta": {"role": "assistant", "content": ""}}])
    ### BEGIN SOLUTION
    completion_tokens = 0
    async for u in updates:
        completion_tokens += len(u.token_ids)  # a step may hold several tokens (speculation) or text none
        if not u.text and u.finish_reason is None:
            continue
        piece = {"delta": {"content": u.text}} if meta.chat else {"text": u.text}
        yield chunk(meta, [{"index": u.index, **piece, "finish_reason": u.finish_reason}])
    if meta.include_usage:
        yield chunk(meta, [], {"prompt_tokens": meta.prompt_tokens, "completion_tokens": completion_tokens,
                               "total_tokens": meta.prompt_tokens + completion_tokens})
    yield event("[DONE]")
    ### END SOLUTION
