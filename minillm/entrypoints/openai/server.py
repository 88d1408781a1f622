"""An OpenAI-compatible HTTP server over ``LLMEngine``: FastAPI + uvicorn, as vLLM and ``transformers serve``.

    POST /v1/completions        POST /v1/chat/completions   (JSON, or SSE with "stream": true)
    GET  /v1/models             GET  /health                GET /metrics (Prometheus text, minillm_* and vllm:*)
    POST /tokenize              POST /detokenize            GET /tokenizer_info     GET /version  (tokenization.py)

Handlers validate a request (pydantic models in ``protocol.py``; ``SamplingParams`` checks the values), hand it to
the ``EngineLoop`` thread and stream back what it produces.  Requests follow vLLM's semantics (``compat.py``):
unknown fields are ignored (logged once per name, listed in the ``X-Ignored-Fields`` response header), OpenAI's
"off" values of unimplemented fields are accepted, ``max_tokens`` null (or omitted, in chat) means the rest of the
context.  Every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400 bad values, malformed
JSON, undecodable text, fields the engine cannot honour (code ``unsupported_parameter``), a prompt, or prompt +
``max_tokens``, over the context (code ``context_length_exceeded``), more sequences than ``max_num_seqs`` or a
``Host`` not allowed; 401 wrong API key (checked before the body is read); 404 unknown model; 413 body over
``max_body_bytes`` (counted as it arrives: ``guard.py``); 429 admission queue full or (with a TTFT budget,
``admission.py``) overloaded, both with ``Retry-After``; 503 shutting down (and ``/health`` while the engine step
is stuck).  Slow and idle connections are dropped (``connections.py``).  A client that disconnects aborts its
request, which frees its KV blocks; the server logs one line for it.  Structured output (``response_format``,
vLLM's ``guided_*``) and tool calls (``tools``, ``tool_choice``) become a grammar on the reply (``structured.py``,
``tools.py``), compiled before the request is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.entrypoints.openai import protocol as p
from minillm.entrypoints.openai.compat import FieldWarnings, StopReasonTap, UsageEveryChunk
from minillm.entrypoints.openai.connections import ConnectionLimits, yielding
from minillm.entrypoints.openai.engine_loop import (
    ChatPrompt,
    EngineFailed,
    EngineLoop,
    Overloaded,
    PromptTooLong,
    QueueFull,
    RequestStream,
    ShuttingDown,
    TooManySequences,
)
from minillm.entrypoints.openai.guard import error_response, guard, host_set
from minillm.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_STALL_TIMEOUT_S
from minillm.entrypoints.openai.logprobs import (
    LogprobTap,
    chat_logprobs,
    completion_choice,
    sampling_extras,
)
from minillm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from minillm.entrypoints.openai.openapi import use_declared_errors
from minillm.entrypoints.openai.sse import StreamMeta, sse_stream
from minillm.entrypoints.openai.sse import event as sse
from minillm.entrypoints.openai.structured import FieldError, guided_decoding
from minillm.entrypoints.openai.tokenization import add_tokenization_routes
from minillm.entrypoints.openai.tools import ToolPlan, tool_call_stream, tool_plan
from minillm.entrypoints.openai.tools import finish_reason as tool_finish_reason
from minillm.outputs import StepOutput
from minillm.sampling.guided import GuidedDecodingParams
from minillm.sampling.params import SamplingParams

log = logging.getLogger("uvicorn.error.minillm")  # a child of uvicorn's logger: shown at its --log-level (info)
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize",
         "/tokenizer_info", "/version")


class APIError(Exception):
    """An error answered with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.info = status, p.ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.info, self.headers)


def _param_of(message: str) -> str | None:
    """minillm's ValueErrors start with the parameter's name ("temperature must be ..."): use it as ``param``."""
    m = re.match(r"(\w+) must\b", message)
    return m.group(1) if m else None


# ---- the gate: runs before routing, for every request -----------------------------------------------------------
class Gate:
    """Pure ASGI middleware: ``guard.guard`` (the API key, 401, then the body read to at most ``max_body_bytes``,
    413) before the app sees a request; counts every response by path and status.  (Pure ASGI, not
    ``BaseHTTPMiddleware``, so that streaming responses and client disconnects pass through untouched.)"""

    def __init__(self, app, *, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int,
                 allowed_hosts: frozenset[str] | None = None):
        self.app, self.metrics, self.api_key, self.max_body_bytes = app, metrics, api_key, max_body_bytes
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # what is counted if the app dies before answering

        async def send_and_record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            checked = await guard(scope, receive, api_key=self.api_key, max_body_bytes=self.max_body_bytes,
                                  allowed_hosts=self.allowed_hosts)
            app = checked.rejection if checked.rejection is not None else self.app
            await app(scope, checked.receive, send_and_record)
        finally:
            path = scope["path"] if scope["path"] in PATHS else "other"  # bounded label values
            self.metrics.count_response(path, status)


# ---- requests -> engine inputs ----------------------------------------------------------------------------------
def sampling_params(body: p.ChatCompletionRequest | p.CompletionRequest, max_tokens: int,
                    guided: GuidedDecodingParams | None = None) -> SamplingParams:
    """The request's ``SamplingParams``; unset fields keep minillm's defaults.  A bad value is a 400 naming it."""
    kw = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k") if getattr(body, name) is not None}
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return SamplingParams(max_tokens=max_tokens, n=body.n, seed=body.seed, stop=stop,
                              ignore_eos=body.ignore_eos, guided_decoding=guided, **kw, **sampling_extras(body))
    except ValueError as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from e


def requested_max_tokens(body: p.ChatCompletionRequest | p.CompletionRequest) -> int | None:
    """The output budget the client asked for; None: the rest of the context (vLLM's meaning of an omitted chat
    ``max_tokens`` and of an explicit null; the engine stops at the context, ``finish_reason "length"``).  Chat's
    ``max_completion_tokens`` wins over its deprecated ``max_tokens``."""
    return next((m for m in (getattr(body, "max_completion_tokens", None), body.max_tokens) if m is not None), None)


def continuous_usage(body: p.ChatCompletionRequest | p.CompletionRequest) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats``: usage in every chunk; as in vLLM, only with
    ``include_usage``."""
    o = body.stream_options
    return o is not None and o.include_usage and o.continuous_usage_stats


def structured(body, plan: ToolPlan | None = None) -> tuple[GuidedDecodingParams | None, str | None]:
    """The request's output constraint and the field it came from (``structured.guided_decoding``); a 400 naming
    the field when it is malformed."""
    try:
        return guided_decoding(body, plan)
    except FieldError as e:
        raise APIError(400, str(e), param=e.param) from e


def chat_tools(body: p.ChatCompletionRequest) -> ToolPlan | None:
    """The chat request's ``ToolPlan`` (``tools.tool_plan``); a 400 naming the field when it is malformed."""
    try:
        return tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ValueError as e:
        raise APIError(400, str(e), param=re.match(r"\w+", str(e)).group(0)) from e


def completion_prompts(prompt) -> list[str | list[int]]:
    """A completion's prompts: one string or token-id list, or a batch of those (OpenAI's ``prompt`` takes all four
    shapes).  Each prompt of a batch becomes its own engine request; choice ``i * n + j`` is prompt i's sample j."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def chat_messages(messages: Sequence[p.ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them; content parts must be text."""
    if not messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    out = []
    for m in messages:
        content = m.content or ""
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise APIError(400, "messages: only text content parts are supported", param="messages")
            content = "".join(str(part.get("text", "")) for part in content)
        out.append({**m.model_dump(exclude_none=True), "content": content})
    return out


def chat_choice(sample, plan: ToolPlan | None, top_logprobs: int | None,
                token_text: Callable[[int], str]) -> p.ChatChoice:
    """One finished sample as a chat choice: its text, or (with a ``plan``) the tool calls it makes; with
    ``top_logprobs`` (``SamplingParams.logprobs``) its tokens' logprobs in the chat shape."""
    calls = [] if plan is None else plan.parse(sample.text)
    message = p.AssistantMessage(content=None if calls else sample.text, tool_calls=calls)
    logprobs = (None if sample.logprobs is None else
                chat_logprobs(sample.token_ids, sample.logprobs, top_logprobs, token_text))
    return p.ChatChoice(index=sample.index, message=message, stop_reason=sample.stop_reason, logprobs=logprobs,
                        finish_reason=tool_finish_reason(calls, sample.finish_reason))


def usage(streams: Sequence[RequestStream]) -> p.UsageInfo:
    """Token counts summed over a request's prompts (a completion may carry several) and all their samples."""
    prompt = sum(len(st.prompt_token_ids) for st in streams)
    completion = sum(len(s.token_ids) for st in streams if st.output is not None for s in st.output.outputs)
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def stream_meta(body: p.ChatCompletionRequest | p.CompletionRequest, request_id: str,
                streams: Sequence[RequestStream], n: int, chat: bool) -> StreamMeta:
    """What ``sse_stream`` needs to know about a streamed request: its id, model, creation time, kind, choices
    (prompts × n), whether to end with usage and its prompt tokens."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamMeta(id=request_id, model=body.model, created=int(time.time()), chat=chat,
                      num_choices=len(streams) * n, include_usage=include_usage,
                      prompt_tokens=sum(len(st.prompt_token_ids) for st in streams))


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, object]]:
    """``(k, update)`` from several streams as they arrive (k: the stream's position).  One task per stream feeds
    a shared queue; an engine failure in any stream is raised here, and leaving early cancels the tasks."""
    if len(streams) == 1:  # the common case: no tasks
        async for u in streams[0]:
            yield 0, u
        return
    out: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, stream: RequestStream):
        try:
            async for u in stream:
                await out.put((k, u))
            await out.put((k, done))
        except BaseException as e:  # EngineFailed (or cancellation): hand it to the consumer
            await out.put((k, e))

    tasks = [asyncio.ensure_future(pump(k, st)) for k, st in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            k, item = await out.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()


# ---- the app -------------------------------------------------------------------------------------------------------
class Server:
    """The handlers' shared state: the engine loop, metrics, the served model's names."""

    def __init__(self, engine_loop: EngineLoop, metrics: ServerMetrics, model_names: Sequence[str]):
        self.loop, self.metrics, self.model_names = engine_loop, metrics, tuple(model_names)
        self.field_warnings = FieldWarnings()

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is one of the served names (None: not given, where the field is optional)."""
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}", param="model",
                           code="model_not_found")

    def check(self, body) -> dict[str, str]:
        """Refuse what cannot be served (unknown model, fields the engine cannot honour); returns the response
        headers that list the request's ignored (unknown) fields, after logging new ones."""
        self.check_model(body.model)
        bad = p.unsupported_fields(body)
        if bad:
            raise APIError(400, f"{bad[0]} is not supported by minillm (unsupported: {', '.join(bad)})",
                           param=bad[0], code="unsupported_parameter")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        return self.field_warnings.headers(p.ignored_fields(body))

    async def compile_grammar(self, guided: GuidedDecodingParams | None, field: str | None) -> None:
        """Compile the request's grammar off the engine thread (a large schema compiles for a while; the engine
        then finds it cached), so a constraint that cannot be compiled is a 400 naming ``field`` before queueing."""
        if guided is None:
            return
        try:
            await asyncio.to_thread(self.loop.compile_grammar, guided)
        except ValueError as e:
            raise APIError(400, str(e).replace(f"guided_decoding.{guided.kind}", field), param=field) from e

    async def submit(self, prompt, params: SamplingParams, request_id: str, param: str,
                     max_tokens_given: bool = True) -> RequestStream:
        """Hand the request to the engine loop; map its refusals to HTTP errors.  ``max_tokens_given`` False:
        ``params.max_tokens`` is the server's "rest of the context" (see ``EngineLoop.submit``)."""
        with self.refusals(param):
            return await self.loop.submit(prompt, params, request_id, max_tokens_given=max_tokens_given)

    @contextlib.contextmanager
    def refusals(self, param: str):
        """The engine loop's refusals as HTTP errors (``param``: the prompt's name in the request)."""
        try:
            yield
        except TooManySequences as e:
            raise APIError(400, str(e), param="n", code="too_many_sequences") from e
        except Overloaded as e:  # shed: its estimated TTFT is over the budget
            self.metrics.count_shed("overloaded")
            raise APIError(429, str(e), type="rate_limit_error", code="overloaded",
                           headers={"Retry-After": str(e.retry_after_s)}) from e
        except QueueFull as e:
            self.metrics.count_shed("queue_full")
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from e
        except ShuttingDown as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from e
        except PromptTooLong as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from e
        except ValueError as e:  # the engine's checks: "prompt 0 is empty", "n=3 ... exceed max_num_seqs", ...
            msg = str(e)
            named = msg.startswith(("prompt", "messages", "this model's tokenizer"))
            raise APIError(400, msg, param=_param_of(msg) or (param if named else None)) from e

    async def submit_all(self, prompts: Sequence, params: SamplingParams, request_id: str,
                         param: str, max_tokens_given: bool = True) -> list[RequestStream]:
        """``submit`` each prompt (ids ``request_id``, or ``request_id-k`` for a batch); if one is refused, the
        ones already admitted are aborted, so a bad batch leaves nothing running."""
        if len(prompts) == 1:
            return [await self.submit(prompts[0], params, request_id, param, max_tokens_given)]
        with self.refusals(param):  # the whole batch counts against the slots, before any of it is queued
            self.loop.admit(len(prompts) * params.n)
        streams: list[RequestStream] = []
        try:
            for k, prompt in enumerate(prompts):
                streams.append(await self.submit(prompt, params, f"{request_id}-{k}", f"{param}[{k}]",
                                                 max_tokens_given))
        except BaseException:
            for st in streams:
                st.close()
            raise
        return streams

    async def collect(self, streams: Sequence[RequestStream], request: Request) -> bool:
        """Wait for non-streamed requests to finish; False if the client disconnected first (then abort)."""
        done = asyncio.ensure_future(asyncio.gather(*(st.result() for st in streams)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not done.done():
            done.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # retrieved, so asyncio logs no traceback for it
                await done
            log_hang_up(request, streams)
            return False
        done.result()  # raises EngineFailed
        for st in streams:
            self.metrics.observe(st.output)
        return True

    async def events(self, streams: Sequence[RequestStream], meta: StreamMeta, n: int,
                     continuous_usage: bool = False, tap: LogprobTap | None = None,
                     plan: ToolPlan | None = None) -> AsyncIterator[str]:
        """SSE: ``sse_stream`` (with a tool ``plan``: ``tool_call_stream``) over the requests' merged updates
        (``updates``); an engine failure becomes an error event and ``[DONE]``.  ``continuous_usage``: the usage so
        far of a chunk's choice in that chunk (``UsageEveryChunk``); ``tap``: adds logprobs or an echoed prompt;
        every choice's last chunk carries its ``stop_reason`` (``StopReasonTap``).  Closing the stream
        early (disconnect) aborts the requests."""
        reasons = StopReasonTap()
        updates = reasons.updates(self.updates(streams, n))
        if tap is not None:
            updates = tap.updates(updates)
        if continuous_usage:
            usage_so_far = UsageEveryChunk([len(st.prompt_token_ids) for st in streams for _ in range(n)])
            updates = usage_so_far.count(updates)
        events = sse_stream(updates, meta) if plan is None else tool_call_stream(updates, meta, plan)
        if continuous_usage:
            events = usage_so_far.add_usage(events)
        if tap is not None:
            events = tap.events(events)
        events = reasons.events(events)
        try:
            async for text in events:
                yield text
        except (GeneratorExit, asyncio.CancelledError):  # the client left mid-stream
            log.info("client hung up: stream %s aborted", meta.id)
            raise
        except EngineFailed as e:
            yield sse(p.ErrorResponse(error=p.ErrorInfo(message=str(e), type="server_error")))
            yield sse("[DONE]")
        finally:
            for st in streams:
                st.close()

    async def updates(self, streams: Sequence[RequestStream], n: int) -> AsyncIterator[StepOutput]:
        """The requests' updates as they arrive, sample i of prompt k numbered as choice ``k * n + i``; then a last
        update for each sample the server aborted (shutdown), which ended without one.  Records each request's
        metrics once it has ended."""
        async for k, u in merged(streams):
            yield u if k == 0 else replace(u, index=k * n + u.index)
        for k, st in enumerate(streams):
            for sample in st.output.outputs:  # aborted by the server (shutdown): say so, then end cleanly
                if sample.finish_reason == "abort":
                    yield StepOutput(st.request_id, k * n + sample.index, [], "", "abort")
            self.metrics.observe(st.output)


class EventStream(StreamingResponse):
    """An SSE response that closes its ``RequestStream``s however the response ends — also when the client left
    before the body generator ever started (then the generator's own ``finally`` never runs)."""

    def __init__(self, events: AsyncIterator[str], streams: Sequence[RequestStream],
                 headers: dict[str, str] | None = None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **(headers or {})})
        self.request_streams = tuple(streams)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, yielding(send))
        finally:
            for st in self.request_streams:
                st.close()


def log_hang_up(request: Request, streams: Sequence[RequestStream]) -> None:
    """One quiet line per client that left before its answer (no traceback: hanging up is the client's right)."""
    client = request.client
    log.info("client %s hung up: request %s aborted", f"{client.host}:{client.port}" if client else "?",
             streams[0].request_id if streams else "?")


async def _disconnected(request: Request) -> None:
    """Return when the client goes away (the body has been read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(llm_or_engine, *, served_model_name: str | Sequence[str] | None = None, api_key: str | None = None,
              max_queue: int = 64, ttft_slo_s: float | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, allowed_hosts: Sequence[str] | None = None) -> FastAPI:
    """The FastAPI app serving ``llm_or_engine`` (an ``LLM`` or an ``LLMEngine``).

    ``served_model_name``: the name(s) clients must pass as ``model`` (default "SmolLM2-135M-Instruct");
    ``api_key``: require ``Authorization: Bearer <key>`` on ``/v1`` and every body; ``max_queue``: sequences that
    may wait beyond the engine's ``max_num_seqs`` before new ones get 429; ``ttft_slo_s``: shed load — a request
    whose estimated time to first token exceeds this many seconds gets 429 "overloaded" at once (None: off;
    ``admission.py``); ``max_body_bytes``: larger bodies get 413 (counted as they arrive); ``stall_timeout_s``:
    ``/health`` answers 503 once the engine's current step has run this long (``EngineLoop.stalled``);
    ``allowed_hosts``: the host names a request's ``Host`` header may carry (None: any; a guard against DNS
    rebinding).
    The engine loop thread starts with the app (lifespan) and stops with it, aborting what is still running.
    ``app.state.server.loop`` is the ``EngineLoop``.
    """
    from contextlib import asynccontextmanager

    engine = getattr(llm_or_engine, "engine", llm_or_engine)  # an LLM builds its engine here, before the thread
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [DEFAULT_MODEL_NAME]
    loop = EngineLoop(engine, max_queue=max_queue, ttft_slo_s=ttft_slo_s, stall_timeout_s=stall_timeout_s)
    server = Server(loop, ServerMetrics(names[0]), names)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        try:
            yield
        finally:  # connections are closed by now (uvicorn waited up to its graceful-shutdown timeout)
            await asyncio.to_thread(server.loop.stop)

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Gate, metrics=server.metrics, api_key=api_key, max_body_bytes=max_body_bytes,
                       allowed_hosts=host_set(allowed_hosts))
    _add_error_handlers(app)
    _add_routes(app, server)
    add_tokenization_routes(app, server, engine.tokenizer, APIError)
    use_declared_errors(app, api_key=api_key is not None)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return APIError(400, f"malformed JSON body: {err.get('msg')}", code="invalid_json").response()
        param = ".".join(loc) or None
        return APIError(400, f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail), code=str(e.status_code)).response()

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()


def _add_routes(app: FastAPI, server: Server) -> None:
    tokenizer = server.loop.engine.tokenizer

    def token_text(token: int) -> str:  # an engine without a tokenizer: vLLM's "token_id:N" form
        return f"token_id:{token}" if tokenizer is None else tokenizer.decode([token])

    def prompt_text(prompt, ids: list[int]) -> str:
        return prompt if isinstance(prompt, str) else "" if tokenizer is None else tokenizer.decode(ids)

    @app.get("/health")
    async def health():
        why = server.loop.stalled()
        if why is not None:
            raise APIError(503, why, type="server_error", code="engine_unhealthy")
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        loop = server.loop
        server.metrics.step_age.set(loop.step_age_s())
        return Response(server.metrics.render(loop.snapshot, loop.in_flight, loop.admission), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=n, max_model_len=server.loop.max_model_len)
                                 for n in server.model_names])

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request, response: Response):
        headers = server.check(body)
        echo_only = body.echo and body.max_tokens == 0  # the prompt alone: one token runs and is dropped (vLLM)
        max_tokens = 1 if echo_only else requested_max_tokens(body)  # omitted: 16 (the model's default); null: the rest
        guided, field = structured(body)
        params = sampling_params(body, server.loop.max_model_len if max_tokens is None else max_tokens, guided)
        await server.compile_grammar(guided, field)
        rid, model = p.random_id("cmpl"), body.model
        prompts = completion_prompts(body.prompt)
        streams = await server.submit_all(prompts, params, rid, "prompt", max_tokens is not None)
        if body.stream:
            meta = stream_meta(body, rid, streams, params.n, chat=False)
            choices = [(k * params.n + i, pr, st) for k, (pr, st) in enumerate(zip(prompts, streams, strict=True))
                       for i in range(params.n)]
            echo = {c: prompt_text(pr, st.prompt_token_ids) for c, pr, st in choices} if body.echo else None
            echo_ids = ({c: st.prompt_token_ids for c, _, st in choices}
                        if body.echo and body.logprobs is not None else None)
            tap = (LogprobTap(False, 0, token_text, echo, echo_ids, echo_only)
                   if body.logprobs is not None or echo else None)
            return EventStream(server.events(streams, meta, params.n, continuous_usage(body), tap), streams, headers)
        response.headers.update(headers)
        try:
            if not await server.collect(streams, request):
                return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        finally:
            for st in streams:
                st.close()
        choices = [completion_choice(k * params.n + s.index, s, st.output,
                                     prompt_text(pr, st.prompt_token_ids) if body.echo else None, echo_only, token_text)
                   for k, (pr, st) in enumerate(zip(prompts, streams, strict=True)) for s in st.output.outputs]
        used = usage(streams)
        if echo_only:  # the token that ran is not part of the answer
            used = p.UsageInfo(prompt_tokens=used.prompt_tokens, completion_tokens=0, total_tokens=used.prompt_tokens)
        return p.CompletionResponse(id=rid, model=model, choices=choices, usage=used)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request, response: Response):
        headers = server.check(body)
        max_tokens = requested_max_tokens(body)
        plan = chat_tools(body)
        guided, field = structured(body, plan)
        params = sampling_params(body, server.loop.max_model_len if max_tokens is None else max_tokens, guided)
        await server.compile_grammar(guided, field)
        rid, model = p.random_id("chatcmpl"), body.model
        prompt = chat_messages(body.messages)
        if body.tools:  # templates that support tools render them into the prompt
            prompt = ChatPrompt(prompt, body.tools)
        streams = [await server.submit(prompt, params, rid, "messages", max_tokens is not None)]
        if body.stream:
            meta = stream_meta(body, rid, streams, params.n, chat=True)
            tap = LogprobTap(True, params.logprobs, token_text) if params.logprobs is not None else None
            return EventStream(server.events(streams, meta, params.n, continuous_usage(body), tap, plan), streams,
                               headers)
        response.headers.update(headers)
        try:
            if not await server.collect(streams, request):
                return Response(status_code=499)
        finally:
            streams[0].close()
        choices = [chat_choice(s, plan, params.logprobs, token_text) for s in streams[0].output.outputs]
        return p.ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage(streams))


def run_server(llm_or_engine, *, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout_s: float = 10.0,
               log_level: str = "info", connection_limits: ConnectionLimits | None = None, **app_options) -> None:
    """Serve until SIGINT/SIGTERM.  On a signal new requests get 503, in-flight ones run on for up to
    ``shutdown_timeout_s`` seconds, the rest are aborted (their streams end with finish_reason "abort" and
    ``[DONE]``), then uvicorn closes the connections and the process exits.  ``connection_limits``: when slow or
    idle clients are dropped (default ``ConnectionLimits()``)."""
    import uvicorn

    app = build_app(llm_or_engine, **app_options)
    engine_loop = app.state.server.loop

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            await asyncio.to_thread(engine_loop.stop, shutdown_timeout_s)  # drain, then abort: streams end
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout_s,  # a backstop: streams have ended
                            **(connection_limits or ConnectionLimits()).uvicorn_options())
    DrainingServer(config).run()

