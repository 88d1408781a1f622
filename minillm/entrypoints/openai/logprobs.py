"""Logprobs, echo and the sampling extras on the OpenAI API: request fields -> ``SamplingParams`` keywords, and the
engine's logprobs (``{token_id: Logprob}`` per token) -> OpenAI's two response shapes.

    completions  "logprobs": {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: lp}], "text_offset"}
    chat         "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", ...}]}]}

The engine computes every number (raw logprobs, prompt logprobs for ``echo``); this module only reshapes them.
Streams: ``LogprobTap`` passes a response's updates through, keeps their logprobs, and adds them to the chunk
events ``sse_stream`` renders for those updates (a token whose text is held back sends its logprobs with the next
chunk of its choice).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import replace

from minillm.entrypoints.openai import protocol as p
from minillm.outputs import CompletionOutput, Logprob, RequestOutput, StepOutput

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's legacy completions limit
MAX_TOP_LOGPROBS = 20  # chat's


def sampling_extras(body: p.CompletionRequest | p.ChatCompletionRequest) -> dict:
    """The ``SamplingParams`` keywords a request's logprobs and vLLM extras ask for (unset fields: none).  Raises
    ``ValueError`` naming the field for OpenAI's own limits (completions ``logprobs`` 0-5, chat ``top_logprobs``
    0-20, ``top_logprobs`` without ``logprobs``); ``SamplingParams`` checks the rest."""
    kw: dict = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                 "stop_token_ids", "logit_bias"):
        if getattr(body, name) is not None:
            kw[name] = getattr(body, name)
    kw["include_stop_str_in_output"] = body.include_stop_str_in_output
    if isinstance(body, p.ChatCompletionRequest):
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top}")
        if top and not body.logprobs:
            raise ValueError(f"top_logprobs must come with logprobs=true (got top_logprobs={top}, logprobs="
                             f"{body.logprobs}); set logprobs=true or drop top_logprobs")
        if body.logprobs:
            kw["logprobs"] = top or 0
    elif body.logprobs is not None:
        if not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise ValueError(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] for completions, got "
                             f"{body.logprobs}")
        kw["logprobs"] = body.logprobs
        if body.echo:
            kw["prompt_logprobs"] = body.logprobs
    return kw


def _text(token: int, entry: dict[int, Logprob] | None, token_text: Callable[[int], str]) -> str:
    lp = entry.get(token) if entry else None
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else token_text(token)


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None],
                        token_text: Callable[[int], str], offset: int = 0) -> p.CompletionLogprobs:
    """OpenAI's completions shape for ``token_ids`` and their engine logprobs (``entries[i]`` for ``token_ids[i]``;
    None: no logprob, an echoed prompt's first token); ``offset``: where the first token's text starts in the
    choice's text.  ``token_text``: id -> text for tokens the engine did not decode."""
    out = p.CompletionLogprobs()
    for token, entry in zip(token_ids, entries, strict=True):
        text = _text(token, entry, token_text)
        out.tokens.append(text)
        out.token_logprobs.append(None if entry is None else entry[token].logprob)
        out.top_logprobs.append(None if entry is None else
                                {_text(t, entry, token_text): lp.logprob for t, lp in entry.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], top: int,
                  token_text: Callable[[int], str]) -> p.ChatLogprobs:
    """OpenAI's chat shape: per token its text, logprob and UTF-8 bytes, and its ``top`` most likely alternatives
    (the engine's entry holds the sampled token first, then the top k by rank)."""
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        alternatives = list(entry.items())
        if len(alternatives) > top:  # the sampled token is not among the top k: it was added in front
            alternatives = alternatives[1:]
        alternatives.sort(key=lambda kv: -kv[1].logprob)
        tops = [p.TopLogprob(token=(s := _text(t, entry, token_text)), logprob=lp.logprob,
                             bytes=list(s.encode("utf-8"))) for t, lp in alternatives[:top]]
        text = _text(token, entry, token_text)
        content.append(p.ChatTokenLogprob(token=text, logprob=entry[token].logprob, bytes=list(text.encode("utf-8")),
                                          top_logprobs=tops))
    return p.ChatLogprobs(content=content)


class LogprobTap:
    """Adds logprobs (and an echoed prompt) to a streamed response's chunk events without changing how they are
    made: ``updates`` passes the engine's updates through and keeps their logprobs per choice; ``annotate`` adds
    what a choice has pending to the next chunk event of that choice.

    ``chat``: the chat shape with ``top`` alternatives, else the completions shape; ``echo``: choice -> prompt text
    put in front of that choice's first text chunk (completions ``echo``, vLLM's order: the prompt streams first);
    ``echo_ids``: choice -> prompt ids, whose logprobs (the engine's ``prompt_logprobs``, on a choice's first
    update) go first with the echoed text (``echo`` with ``logprobs``); ``echo_only`` (``max_tokens=0``): the
    generated token is dropped, so the choice is its prompt alone with ``finish_reason "length"``."""

    def __init__(self, chat: bool, top: int, token_text: Callable[[int], str], echo: dict[int, str] | None = None,
                 echo_ids: dict[int, list[int]] | None = None, echo_only: bool = False):
        self.chat, self.top, self.token_text, self.echo = chat, top, token_text, dict(echo or {})
        self.echo_ids, self.echo_only = dict(echo_ids or {}), echo_only
        self.pending: dict[int, list[tuple[int, dict[int, Logprob] | None]]] = {}
        # choice -> characters of its text sent so far, the echoed prompt included unless its tokens are (text_offset)
        self.offsets: dict[int, int] = {i: 0 if i in self.echo_ids else len(t) for i, t in self.echo.items()}

    async def updates(self, updates: AsyncIterable[StepOutput]) -> AsyncIterator[StepOutput]:
        async for u in updates:
            prompt_ids = self.echo_ids.pop(u.index, None)
            if prompt_ids is not None and u.prompt_logprobs is not None:
                self.pending.setdefault(u.index, []).extend(zip(prompt_ids, u.prompt_logprobs, strict=True))
            if self.echo_only:  # the prompt is the whole answer: the token that ran is not part of it
                u = replace(u, token_ids=[], text="", logprobs=None, stop_reason=None,
                            finish_reason=None if u.finish_reason is None else "length")
            if u.logprobs:
                self.pending.setdefault(u.index, []).extend(zip(u.token_ids, u.logprobs, strict=True))
            yield u

    def annotate(self, event: str) -> str:
        """One ``data: {...}`` event with its choices' pending logprobs (and echo) added; other events as they
        are (the role chunks at the start, the usage chunk, ``[DONE]``)."""
        if not event.startswith("data: {"):
            return event
        body = json.loads(event[len("data: "):])
        changed = False
        for choice in body.get("choices") or ():
            i = choice["index"]
            if "text" in choice and i in self.echo:
                choice["text"] = self.echo.pop(i) + (choice["text"] or "")
                changed = True
            pairs = self.pending.pop(i, None)
            if not pairs:
                continue
            ids, entries = [t for t, _ in pairs], [e for _, e in pairs]
            if self.chat:
                choice["logprobs"] = chat_logprobs(ids, entries, self.top, self.token_text).model_dump()
            else:
                lp = completion_logprobs(ids, entries, self.token_text, self.offsets.get(i, 0))
                self.offsets[i] = self.offsets.get(i, 0) + sum(len(t) for t in lp.tokens)
                choice["logprobs"] = lp.model_dump()
            changed = True
        return f"data: {json.dumps(body)}\n\n" if changed else event

    async def events(self, events: AsyncIterable[str]) -> AsyncIterator[str]:
        async for e in events:
            yield self.annotate(e)


def completion_choice(index: int, sample: CompletionOutput, output: RequestOutput, echo: str | None,
                      echo_only: bool, token_text: Callable[[int], str]) -> p.CompletionChoice:
    """One completions choice: ``echo`` (the prompt's text, or None) before the sample's text; with logprobs the
    prompt's (first null, when echoed) then the sample's.  ``echo_only`` (``max_tokens=0``): the prompt alone,
    the one token that ran dropped."""
    ids = [] if echo_only else sample.token_ids
    text = "" if echo_only else sample.text
    logprobs = None
    if sample.logprobs is not None:
        entries = list(sample.logprobs[: len(ids)])
        ids = ids[: len(entries)]
        if echo is not None and output.prompt_logprobs is not None:
            ids, entries = list(output.prompt_token_ids) + ids, list(output.prompt_logprobs) + entries
        logprobs = completion_logprobs(ids, entries, token_text)
    return p.CompletionChoice(index=index, text=(echo or "") + text, logprobs=logprobs,
                              finish_reason="length" if echo_only else sample.finish_reason,
                              stop_reason=None if echo_only else sample.stop_reason)
