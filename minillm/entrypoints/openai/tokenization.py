"""vLLM's tokenizer endpoints and ``/version``: what clients use to count tokens and fit prompts before sending them.

    POST /tokenize        {"prompt": str} or {"messages": [...]}  -> {"count", "max_model_len", "tokens"}
                          (+ "token_strs" with "return_token_strs": true)
    POST /detokenize      {"tokens": [int, ...]}                  -> {"prompt": str}
    GET  /tokenizer_info                                          -> {"tokenizer_class", ...tokenizer_config}
    GET  /version                                                 -> {"version": minillm.__version__}

The same tokenizer as the engine, but a private copy used on worker threads: the engine's own is touched only by
the engine loop thread (a fast tokenizer refuses concurrent use), and a tokenize call must not wait for an engine
step.  The copy is made when the app is built, before the loop thread starts (copying while the loop tokenizes
would be concurrent use too); it costs about as much as loading the tokenizer.  Bad input (token ids outside the
vocabulary, a chat the template rejects, no tokenizer) is a 400 with OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Response
from pydantic import model_validator

from minillm.engine.inputs import chat_prompt_ids
from minillm.entrypoints.openai import protocol as p


class TokenizeRequest(p.OpenAIBaseModel):
    """``POST /tokenize``: a ``prompt`` (tokenized as the completions endpoint does) or ``messages`` (rendered by
    the chat template as the chat endpoint does), not both.  ``add_special_tokens`` defaults as each endpoint
    tokenizes: True for a prompt, False for messages (the template writes its own special tokens)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = None
    add_generation_prompt: bool = True  # messages only: end with the assistant's opening
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('pass either "prompt" (a string) or "messages" (a conversation), not both or neither')
        return self


class TokenizeResponse(p.BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(p.OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(p.BaseModel):
    prompt: str


class Tokenization:
    """The endpoints' tokenizer: a copy of ``tokenizer`` (None: the model has none), used under a lock on worker
    threads.  Build it before anything else uses ``tokenizer`` concurrently."""

    def __init__(self, tokenizer, max_model_len: int):
        self.max_model_len = max_model_len
        self._copy = None if tokenizer is None else copy.deepcopy(tokenizer)
        self._lock = threading.Lock()

    def _tokenizer(self):
        if self._copy is None:
            raise ValueError("this model has no tokenizer: the server takes and returns token ids only")
        return self._copy

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """The prompt's ids as the generation endpoints would see them (raises ``ValueError`` for bad input)."""
        with self._lock:
            tok = self._tokenizer()
            if body.messages is not None:
                messages = [m.model_dump(exclude_none=True) for m in body.messages]
                ids = chat_prompt_ids(tok, messages, add_generation_prompt=body.add_generation_prompt,
                                      add_special_tokens=bool(body.add_special_tokens))
            else:
                special = body.add_special_tokens is None or body.add_special_tokens
                ids = list(tok(body.prompt, add_special_tokens=special)["input_ids"])
            strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of ``body.tokens`` (special tokens kept, so that it round-trips); ids outside
        ``[0, len(tokenizer))`` are a ``ValueError`` naming them."""
        with self._lock:
            tok = self._tokenizer()
            bad = [t for t in body.tokens if not 0 <= t < len(tok)]
            if bad:
                raise ValueError(f"tokens must be ids in [0, {len(tok)}) (this tokenizer's vocabulary); got "
                                 f"{bad[:5]}{' ...' if len(bad) > 5 else ''}")
            return DetokenizeResponse(prompt=tok.decode(body.tokens))

    def info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: the tokenizer's class and its ``tokenizer_config.json`` settings (special
        tokens as strings), plus the chat template; file paths are left out (they are the server's business)."""
        with self._lock:
            tok = self._tokenizer()
            info = {k: _json_safe(v) for k, v in tok.init_kwargs.items()
                    if not k.endswith("_file") and k != "name_or_path"}
            info.update(tokenizer_class=type(tok).__name__, model_max_length=self.max_model_len,
                        chat_template=getattr(tok, "chat_template", None))
        return {k: v for k, v in info.items() if v is not _UNSAFE}


_UNSAFE = object()


def _json_safe(value):
    """A JSON value for ``value``: AddedToken -> its text, containers recursively, other objects dropped."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "content") and isinstance(value.content, str):  # tokenizers.AddedToken
        return value.content
    if isinstance(value, (list, tuple)):
        return [v for v in map(_json_safe, value) if v is not _UNSAFE]
    if isinstance(value, dict):
        return {str(k): v for k, v in ((k, _json_safe(v)) for k, v in value.items()) if v is not _UNSAFE}
    return _UNSAFE


def add_tokenization_routes(app: FastAPI, server, tokenizer, api_error: Callable[..., Exception]) -> None:
    """Register the endpoints on ``app``.  ``server`` (a ``server.Server``) checks ``model`` and logs ignored
    fields; ``tokenizer``: the engine's (copied now); ``api_error(status, message, param=...)``: the
    server's error (answered with OpenAI's body), passed in so that this module does not import the server."""
    from minillm import __version__

    tk = Tokenization(tokenizer, server.loop.max_model_len)

    async def run(fn, body, param: str):
        server.check_model(body.model)
        try:
            return await asyncio.to_thread(fn, body)
        except ValueError as e:
            raise api_error(400, str(e), param=param) from e

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, response: Response):
        response.headers.update(server.field_warnings.headers(p.ignored_fields(body)))
        return await run(tk.tokenize, body, "prompt" if body.messages is None else "messages")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, response: Response):
        response.headers.update(server.field_warnings.headers(p.ignored_fields(body)))
        return await run(tk.detokenize, body, "tokens")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        try:
            return await asyncio.to_thread(tk.info)
        except ValueError as e:
            raise api_error(400, str(e)) from e

    @app.get("/version")
    async def version():
        return {"version": __version__}
