"""An OpenAI-compatible HTTP server over ``LLMEngine``: FastAPI + uvicorn, as vLLM and ``transformers serve``.

    POST /v1/completions        POST /v1/chat/completions   (JSON, or SSE with "stream": true)
    GET  /v1/models             GET  /health                 GET /metrics (Prometheus text)

Handlers validate a request (pydantic models in ``protocol.py``; ``SamplingParams`` checks the values), hand it to
the ``EngineLoop`` thread and stream back what it produces.  Structured output (``response_format``, vLLM's
``guided_*``) and tool calls (``tools``, ``tool_choice``) become a grammar on the reply (``structured.py``,
``tools.py``), compiled before the request is queued.  Every error is OpenAI's
``{"error": {"message", "type", "param", "code"}}``: 400 bad values and malformed JSON, 401 wrong API key,
404 unknown model, 413 prompt over the context (or body over ``max_body_bytes``), 429 admission queue full or
(with a TTFT budget, ``admission.py``) overloaded, both with ``Retry-After``, 503 shutting down.  A client that
disconnects aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.entrypoints.openai import protocol as p
from minillm.entrypoints.openai.engine_loop import (
    ChatPrompt,
    EngineFailed,
    EngineLoop,
    Overloaded,
    PromptTooLong,
    QueueFull,
    RequestStream,
    ShuttingDown,
)
from minillm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from minillm.entrypoints.openai.sse import StreamMeta, sse_stream
from minillm.entrypoints.openai.sse import event as sse
from minillm.entrypoints.openai.structured import FieldError, guided_decoding
from minillm.entrypoints.openai.tools import ToolPlan, tool_call_stream, tool_plan
from minillm.entrypoints.openai.tools import finish_reason as tool_finish_reason
from minillm.outputs import StepOutput
from minillm.sampling.guided import GuidedDecodingParams
from minillm.sampling.params import SamplingParams

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class APIError(Exception):
    """An error answered with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.info = status, p.ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.info, self.headers)


def error_response(status: int, info: p.ErrorInfo, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(p.ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


def _param_of(message: str) -> str | None:
    """minillm's ValueErrors start with the parameter's name ("temperature must be ..."): use it as ``param``."""
    m = re.match(r"(\w+) must\b", message)
    return m.group(1) if m else None


# ---- the gate: runs before routing, for every request -----------------------------------------------------------
class Gate:
    """Pure ASGI middleware: rejects oversized bodies (413) and, with an API key, unauthenticated ``/v1`` calls
    (401); counts every response by path and status.  (Pure ASGI, not ``BaseHTTPMiddleware``, so that
    streaming responses and client disconnects pass through untouched.)"""

    def __init__(self, app, *, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int):
        self.app, self.metrics, self.api_key, self.max_body_bytes = app, metrics, api_key, max_body_bytes

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
            rejection = self._reject(scope)
            app = rejection if rejection is not None else self.app
            await app(scope, receive, send_and_record)
        finally:
            path = scope["path"] if scope["path"] in PATHS else "other"  # bounded label values
            self.metrics.count_response(path, status)

    def _reject(self, scope) -> Response | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        length = headers.get("content-length", "0")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return APIError(413, f"the request body has {length} bytes; the limit is {self.max_body_bytes}",
                            code="request_too_large").response()
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return APIError(401, "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'",
                                code="invalid_api_key").response()
        return None


# ---- requests -> engine inputs ----------------------------------------------------------------------------------
def sampling_params(body: p.ChatCompletionRequest | p.CompletionRequest, max_tokens: int,
                    guided: GuidedDecodingParams | None = None) -> SamplingParams:
    """The request's ``SamplingParams``; unset fields keep minillm's defaults.  A bad value is a 400 naming it."""
    kw = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k") if getattr(body, name) is not None}
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return SamplingParams(max_tokens=max_tokens, n=body.n, seed=body.seed, stop=stop,
                              ignore_eos=body.ignore_eos, guided_decoding=guided, **kw)
    except ValueError as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from e


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


def chat_choice(sample, plan: ToolPlan | None) -> p.ChatChoice:
    """One finished sample as a chat choice: its text, or (with a ``plan``) the tool calls it makes."""
    calls = [] if plan is None else plan.parse(sample.text)
    message = p.AssistantMessage(content=None if calls else sample.text, tool_calls=calls)
    return p.ChatChoice(index=sample.index, message=message, finish_reason=tool_finish_reason(calls,
                                                                                             sample.finish_reason))


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

    def check(self, body) -> None:
        if body.model not in self.model_names:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}", param="model",
                           code="model_not_found")
        bad = p.unsupported_fields(body)
        if bad:
            raise APIError(400, f"{bad[0]} is not supported by minillm (unsupported: {', '.join(bad)})",
                           param=bad[0], code="unsupported_parameter")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")

    async def compile_grammar(self, guided: GuidedDecodingParams | None, field: str | None) -> None:
        """Compile the request's grammar off the engine thread (a large schema compiles for a while; the engine
        then finds it cached), so a constraint that cannot be compiled is a 400 naming ``field`` before queueing."""
        if guided is None:
            return
        try:
            await asyncio.to_thread(self.loop.compile_grammar, guided)
        except ValueError as e:
            raise APIError(400, str(e).replace(f"guided_decoding.{guided.kind}", field), param=field) from e

    async def submit(self, prompt, params: SamplingParams, request_id: str, param: str) -> RequestStream:
        """Hand the request to the engine loop; map its refusals to HTTP errors."""
        try:
            return await self.loop.submit(prompt, params, request_id)
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
            raise APIError(413, str(e), param=param, code="context_length_exceeded") from e
        except ValueError as e:  # the engine's checks: "prompt 0 is empty", "n=3 ... exceed max_num_seqs", ...
            msg = str(e)
            named = msg.startswith(("prompt", "messages", "this model's tokenizer"))
            raise APIError(400, msg, param=_param_of(msg) or (param if named else None)) from e

    async def submit_all(self, prompts: Sequence, params: SamplingParams, request_id: str,
                         param: str) -> list[RequestStream]:
        """``submit`` each prompt (ids ``request_id``, or ``request_id-k`` for a batch); if one is refused, the
        ones already admitted are aborted, so a bad batch leaves nothing running."""
        if len(prompts) == 1:
            return [await self.submit(prompts[0], params, request_id, param)]
        streams: list[RequestStream] = []
        try:
            for k, prompt in enumerate(prompts):
                streams.append(await self.submit(prompt, params, f"{request_id}-{k}", f"{param}[{k}]"))
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
            return False
        done.result()  # raises EngineFailed
        for st in streams:
            self.metrics.observe(st.output)
        return True

    async def events(self, streams: Sequence[RequestStream], meta: StreamMeta, n: int,
                     plan: ToolPlan | None = None) -> AsyncIterator[str]:
        """SSE: ``sse_stream`` (with a ``plan``: ``tool_call_stream``) over the requests' merged updates
        (``updates``); an engine failure becomes an error event and ``[DONE]``.  Closing the stream early
        (disconnect) aborts the requests."""
        events = sse_stream(self.updates(streams, n), meta) if plan is None else tool_call_stream(
            self.updates(streams, n), meta, plan)
        try:
            async for text in events:
                yield text
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

    def __init__(self, events: AsyncIterator[str], streams: Sequence[RequestStream]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.request_streams = tuple(streams)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for st in self.request_streams:
                st.close()


async def _disconnected(request: Request) -> None:
    """Return when the client goes away (the body has been read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(llm_or_engine, *, served_model_name: str | Sequence[str] | None = None, api_key: str | None = None,
              max_queue: int = 64, ttft_slo_s: float | None = None, max_body_bytes: int = 4 << 20) -> FastAPI:
    """The FastAPI app serving ``llm_or_engine`` (an ``LLM`` or an ``LLMEngine``).

    ``served_model_name``: the name(s) clients must pass as ``model`` (default "SmolLM2-135M-Instruct");
    ``api_key``: require ``Authorization: Bearer <key>`` on ``/v1``; ``max_queue``: requests that may wait beyond
    the engine's ``max_num_seqs`` before new ones get 429; ``ttft_slo_s``: shed load — a request whose estimated
    time to first token exceeds this many seconds gets 429 "overloaded" at once (None: off; ``admission.py``);
    ``max_body_bytes``: larger bodies get 413.
    The engine loop thread starts with the app (lifespan) and stops with it, aborting what is still running.
    ``app.state.server.loop`` is the ``EngineLoop``.
    """
    from contextlib import asynccontextmanager

    engine = getattr(llm_or_engine, "engine", llm_or_engine)  # an LLM builds its engine here, before the thread
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    server = Server(EngineLoop(engine, max_queue=max_queue, ttft_slo_s=ttft_slo_s), ServerMetrics(),
                    names or [DEFAULT_MODEL_NAME])

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        try:
            yield
        finally:  # connections are closed by now (uvicorn waited up to its graceful-shutdown timeout)
            await asyncio.to_thread(server.loop.stop)

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Gate, metrics=server.metrics, api_key=api_key, max_body_bytes=max_body_bytes)
    _add_error_handlers(app)
    _add_routes(app, server)
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
        if err.get("type") == "extra_forbidden":
            return APIError(400, f"Unrecognized request argument supplied: {'.'.join(loc)}",
                            param=".".join(loc)).response()
        param = ".".join(loc) or None
        return APIError(400, f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail), code=str(e.status_code)).response()

    @app.exception_handler(Exception)
    async def crash(request: Request, e: Exception):
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()


def _add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health():
        if not server.loop.is_alive():
            raise APIError(503, "the engine loop is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        loop = server.loop
        return Response(server.metrics.render(loop.snapshot, loop.in_flight, loop.admission), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=n, max_model_len=server.loop.max_model_len)
                                 for n in server.model_names])

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        server.check(body)
        guided, field = structured(body)
        params = sampling_params(body, 16 if body.max_tokens is None else body.max_tokens, guided)
        await server.compile_grammar(guided, field)
        rid, model = p.random_id("cmpl"), body.model
        streams = await server.submit_all(completion_prompts(body.prompt), params, rid, "prompt")
        if body.stream:
            meta = stream_meta(body, rid, streams, params.n, chat=False)
            return EventStream(server.events(streams, meta, params.n), streams)
        try:
            if not await server.collect(streams, request):
                return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        finally:
            for st in streams:
                st.close()
        choices = [p.CompletionChoice(index=k * params.n + s.index, text=s.text, finish_reason=s.finish_reason)
                   for k, st in enumerate(streams) for s in st.output.outputs]
        return p.CompletionResponse(id=rid, model=model, choices=choices, usage=usage(streams))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        server.check(body)
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                          server.loop.max_model_len)  # neither: up to the context (the engine stops there)
        plan = chat_tools(body)
        guided, field = structured(body, plan)
        params = sampling_params(body, max_tokens, guided)
        await server.compile_grammar(guided, field)
        rid, model = p.random_id("chatcmpl"), body.model
        prompt = chat_messages(body.messages)
        if body.tools:  # templates that support tools render them into the prompt
            prompt = ChatPrompt(prompt, body.tools)
        streams = [await server.submit(prompt, params, rid, "messages")]
        if body.stream:
            meta = stream_meta(body, rid, streams, params.n, chat=True)
            return EventStream(server.events(streams, meta, params.n, plan), streams)
        try:
            if not await server.collect(streams, request):
                return Response(status_code=499)
        finally:
            streams[0].close()
        choices = [chat_choice(s, plan) for s in streams[0].output.outputs]
        return p.ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage(streams))


def run_server(llm_or_engine, *, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout_s: float = 10.0,
               log_level: str = "info", **app_options) -> None:
    """Serve until SIGINT/SIGTERM.  On a signal new requests get 503, in-flight ones run on for up to
    ``shutdown_timeout_s`` seconds, the rest are aborted (their streams end with finish_reason "abort" and
    ``[DONE]``), then uvicorn closes the connections and the process exits."""
    import uvicorn

    app = build_app(llm_or_engine, **app_options)
    engine_loop = app.state.server.loop

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            await asyncio.to_thread(engine_loop.stop, shutdown_timeout_s)  # drain, then abort: streams end
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout_s)  # a backstop: streams have ended
    DrainingServer(config).run()

