"""Replicas behind one endpoint: ``python -m minillm serve MODEL --replicas N [--routing least_loaded|round_robin]``.

Data parallelism for serving, the simplest way to scale out: N copies of the whole server (``replicas.py``), each a
process with its own model, engine and KV cache, and a router in front that speaks the same OpenAI API::

    client ──► router (public port: FastAPI + httpx) ──► replica 0 (127.0.0.1:P0, python -m minillm serve)
                                                    └──► replica 1 (127.0.0.1:P1) ...

The router does no model work.  Each ``/v1/completions`` or ``/v1/chat/completions`` goes to one replica —
``least_loaded`` (default: fewest requests in flight through the router, ties taken in turn) or ``round_robin`` —
with its body and headers unchanged; the replica's status code, headers and body come back byte for byte, an SSE
stream chunk by chunk as the replica writes it.  ``/v1/models`` is one replica's answer; ``/health`` is ok while
at least one replica is; ``/metrics`` is the router's own counters (``minillm_router_*``: requests, in flight and
failures per replica, health) followed by every live replica's metrics with a ``replica`` label.

Failures: a replica that cannot be reached is taken out of the rotation and the request tries the next one (it was
never delivered, so that is safe); a replica that dies with requests in flight answers them 502 (OpenAI's error
body) — or, for a stream already under way, an SSE error event and ``[DONE]``, as the server does when its engine
fails — and its process is watched, so it stays out once it exits.  No replica left: 503.  A client that hangs up
closes the upstream connection, and the replica aborts the request as it does for a direct client.  SIGTERM or
SIGINT on the front is forwarded to the replicas, which drain (``--shutdown-timeout``) and end their streams;
the front waits for them (bounded, then SIGKILL) and exits.

What it buys: on a machine with cores to spare, N replicas with ``cores / N`` threads each serve more requests per
second than one engine with all the cores when the work does not scale across threads (a 135M model's matmuls are
small; the engine's Python step loop is serial).  It costs N copies of the weights and KV cache, and a second hop
(~a millisecond on loopback) per request.  On a 2-core host expect little or no gain.  Measure it with the load
generator, the same trace against each::

    python -m minillm serve --replicas 2 --port 8000 &      # then, and again with --replicas 1:
    python -m minillm bench serve --base-url http://127.0.0.1:8000 --request-rate 4 --num-prompts 64
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minillm.entrypoints.openai import protocol as p
from minillm.entrypoints.openai.connections import yielding
from minillm.entrypoints.openai.guard import Guard, host_set
from minillm.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES
from minillm.entrypoints.openai.metrics import CONTENT_TYPE
from minillm.entrypoints.openai.replicas import ReplicaProcess
from minillm.entrypoints.openai.server import APIError
from minillm.entrypoints.openai.sse import event as sse

ROUTING = ("least_loaded", "round_robin")
HEALTH_PERIOD_S = 0.5  # how often dead processes are noticed and unreachable replicas re-probed
# Connection-level headers belong to one hop (RFC 9110 §7.6.1); length and framing are redone by each hop.
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                         "transfer-encoding", "upgrade", "host", "content-length", "date", "server"})


@dataclass(eq=False)  # identity: two replicas are never "equal"
class Replica:
    """The router's view of one replica: where it is, and its load and health as the router sees them."""

    index: int
    url: str
    process: ReplicaProcess | None = None  # None: a server the router did not start (tests)
    in_flight: int = 0
    healthy: bool = True
    exited: bool = False

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.proc.poll()


class ReplicaPool:
    """Picks a replica per request and keeps the health flags: the routing policy in one place."""

    def __init__(self, replicas: Sequence[Replica], routing: str = "least_loaded"):
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {', '.join(ROUTING)}, got {routing!r}")
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas, self.routing = list(replicas), routing
        self.draining = False  # set when the front stops: replicas exiting is expected then
        self._turn = itertools.count()

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and not r.exited]

    def pick(self, exclude: Sequence[Replica] = ()) -> Replica | None:
        """The next replica for a request (None: none is healthy).  Candidates are rotated by one each call, so
        round robin takes them in turn and least-loaded breaks ties in turn (not always replica 0 when idle)."""
        candidates = [r for r in self.live() if r not in exclude]
        if not candidates:
            return None
        k = next(self._turn) % len(candidates)
        rotated = candidates[k:] + candidates[:k]
        if self.routing == "round_robin":
            return rotated[0]
        return min(rotated, key=lambda r: r.in_flight)  # min keeps the first of equals: the rotation's


class RouterMetrics:
    """The router's Prometheus counters, one label value per replica."""

    def __init__(self, pool: ReplicaPool):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = r = CollectorRegistry()
        self.requests = Counter("minillm_router_requests", "Requests sent to each replica", ["replica"], registry=r)
        self.in_flight = Gauge("minillm_router_requests_in_flight", "Requests forwarded and not yet answered",
                               ["replica"], registry=r)
        self.failures = Counter("minillm_router_replica_failures", "Requests a replica failed (unreachable or "
                                "died mid-answer)", ["replica"], registry=r)
        self.healthy = Gauge("minillm_router_replica_healthy", "1 while the replica is in the rotation",
                             ["replica"], registry=r)
        info = Gauge("minillm_router_replica_info", "Where each replica listens and its process id",
                     ["replica", "url", "pid"], registry=r)
        for rep in pool.replicas:
            labels = str(rep.index)
            self.requests.labels(labels), self.failures.labels(labels)  # export zeros from the start
            self.in_flight.labels(labels).set(0)
            info.labels(labels, rep.url, str(rep.process.pid if rep.process else "")).set(1)
        self.pool = pool

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        for rep in self.pool.replicas:
            self.in_flight.labels(str(rep.index)).set(rep.in_flight)
            self.healthy.labels(str(rep.index)).set(int(rep.healthy and not rep.exited))
        return generate_latest(self.registry)


def relabel(texts: dict[int, str]) -> str:
    """Several replicas' ``/metrics`` as one exposition: each sample gains ``replica="i"``, each family keeps one
    HELP and TYPE line (the text format allows no repeats)."""
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.utils import floatToGoString

    families: dict[str, tuple[str, str, list]] = {}
    for index, text in texts.items():
        for fam in text_string_to_metric_families(text):
            entry = families.setdefault(fam.name, (fam.type, fam.documentation, []))
            entry[2].extend((s.name, {**s.labels, "replica": str(index)}, s.value) for s in fam.samples)
    lines = []
    for name, (kind, doc, samples) in families.items():
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for sample, labels, value in samples:
            pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{sample}{{{pairs}}} {floatToGoString(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


# ---- forwarding ---------------------------------------------------------------------------------------------------
class Upstream(StreamingResponse):
    """A replica's response relayed as it arrives.  ``release`` (closing the upstream connection, which aborts the
    request on the replica, and giving back the in-flight slot) runs however the response ends — also when the
    client left before the body was ever iterated, when the generator's own ``finally`` would not run."""

    def __init__(self, body: AsyncIterator[bytes], status: int, headers: dict, release):
        super().__init__(body, status_code=status, headers=headers)
        self.release = release

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, yielding(send))
        finally:
            await self.release()


def replica_failed(rep: Replica, e: Exception, metrics: RouterMetrics) -> APIError:
    """Count a transport failure against ``rep``, take it out of the rotation (the health task re-probes it),
    and return the 502 a client gets."""
    metrics.failures.labels(str(rep.index)).inc()
    rep.healthy = False
    return APIError(502, f"replica {rep.index} failed: {type(e).__name__}: {e}", type="server_error",
                    code="replica_failed")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def send_unless_gone(client, upstream_request, request: Request):
    """``client.send(upstream_request, stream=True)``: the replica's response once its headers are in, or None if
    the client hung up first.  A non-streamed answer's headers come only when it is done, so the hang-up must be
    watched here: it cancels the send, which closes the connection, which aborts the request on the replica."""
    sending = asyncio.ensure_future(client.send(upstream_request, stream=True))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
        return sending.result() if sending.done() else None
    finally:
        gone.cancel()
        sending.cancel()  # no-op once done; else (hang-up, or this handler cancelled) it closes the connection


async def forward(client, pool: ReplicaPool, metrics: RouterMetrics, request: Request, path: str) -> Response:
    """Send ``request`` to a replica and relay its answer (see the module docstring for the failure rules)."""
    import httpx

    body = await request.body()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    tried: list[Replica] = []
    while (rep := pool.pick(exclude=tried)) is not None:
        tried.append(rep)
        rep.in_flight += 1
        metrics.requests.labels(str(rep.index)).inc()
        try:
            upstream = await send_unless_gone(
                client, client.build_request(request.method, rep.url + path, content=body, headers=headers), request)
        except BaseException as e:
            rep.in_flight -= 1
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):  # never delivered: try the next one
                replica_failed(rep, e, metrics)
                continue
            if isinstance(e, httpx.TransportError):
                raise replica_failed(rep, e, metrics) from e
            raise
        if upstream is None:
            rep.in_flight -= 1
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        return relay(upstream, rep, metrics)
    raise APIError(503, f"no replica can take the request ({len(pool.live())} of {len(pool.replicas)} in "
                        f"rotation)", type="server_error", code="no_replica")


def relay(upstream, rep: Replica, metrics: RouterMetrics) -> Upstream:
    """The replica's answer, passed through; a replica dying mid-stream ends an SSE stream with an error event."""
    import httpx

    released = False
    is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def release():
        nonlocal released
        if not released:
            released = True
            rep.in_flight -= 1
            await upstream.aclose()

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            err = replica_failed(rep, e, metrics)
            if is_sse:  # the 200 is sent already: say it in the stream, as the server does when its engine fails
                yield sse(p.ErrorResponse(error=err.info)).encode() + sse("[DONE]").encode()
        finally:
            await release()

    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
    headers["x-minillm-replica"] = str(rep.index)  # which replica answered: for logs and tests
    return Upstream(body(), upstream.status_code, headers, release)


# ---- the app ------------------------------------------------------------------------------------------------------
async def watch(pool: ReplicaPool, client, metrics: RouterMetrics) -> None:
    """Every ``HEALTH_PERIOD_S``: a replica whose process exited leaves the rotation for good; one whose
    ``/health`` answers 503 (its engine stuck) leaves it too; one marked unhealthy (a failed request, or that 503)
    comes back when its ``/health`` answers 200 again.  (An unreachable replica is noticed by the next request.)"""
    import httpx

    while True:
        await asyncio.sleep(HEALTH_PERIOD_S)
        for rep in pool.replicas:
            if rep.exited:
                continue
            code = rep.exit_code()
            if code is not None:
                rep.exited = True
                metrics.failures.labels(str(rep.index)).inc()
                if not pool.draining:
                    print(f"[replica {rep.index} (pid {rep.process.pid}) exited with code {code}; "
                          f"{len(pool.live())} of {len(pool.replicas)} replicas left]", file=sys.stderr)
            else:
                with contextlib.suppress(httpx.HTTPError):
                    status = (await client.get(rep.url + "/health", timeout=2)).status_code
                    rep.healthy = status == 200 if not rep.healthy else status != 503


async def replica_metrics(client, pool: ReplicaPool) -> str:
    """The live replicas' ``/metrics``, fetched together, relabelled; a replica that does not answer is left out."""
    live = pool.live()

    async def fetch(rep: Replica) -> str | None:
        with contextlib.suppress(Exception):
            r = await client.get(rep.url + "/metrics", timeout=5)
            return r.text if r.status_code == 200 else None
        return None

    texts = await asyncio.gather(*(fetch(rep) for rep in live))
    return relabel({rep.index: t for rep, t in zip(live, texts, strict=True) if t is not None})


def build_router_app(pool: ReplicaPool, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     allowed_hosts: Sequence[str] | None = None) -> FastAPI:
    """The router's FastAPI app over ``pool``.  Its lifespan owns the httpx client and the health-watching task;
    ``app.state.pool`` and ``app.state.metrics`` are the pool and the ``RouterMetrics``.  ``api_key`` and
    ``max_body_bytes`` are checked here, before a body is read or forwarded (``guard.py``), as each replica does;
    so is ``allowed_hosts`` (the replicas see the router's own loopback requests)."""
    import httpx

    metrics = RouterMetrics(pool)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # No read timeout: a long non-streamed answer sends nothing until it is done.  No connection cap: every
        # open stream holds one connection, and a cap would queue requests in the router instead of the engine.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=limits) as client:
            app.state.client = client
            watcher = asyncio.ensure_future(watch(pool, client, metrics))
            try:
                yield
            finally:
                watcher.cancel()

    app = FastAPI(title="minillm router", lifespan=lifespan)
    app.state.pool, app.state.metrics = pool, metrics
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, allowed_hosts=host_set(allowed_hosts))

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail), code=str(e.status_code)).response()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(app.state.client, pool, metrics, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward(app.state.client, pool, metrics, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        return await forward(app.state.client, pool, metrics, request, "/v1/models")

    @app.get("/health")
    async def health():
        live = len(pool.live())
        if not live:
            raise APIError(503, "no replica is healthy", type="server_error", code="no_replica")
        return JSONResponse({"status": "ok", "replicas_healthy": live, "replicas": len(pool.replicas)})

    @app.get("/metrics")
    async def prometheus():
        text = metrics.render() + (await replica_metrics(app.state.client, pool)).encode()
        return Response(text, media_type=CONTENT_TYPE)

    return app


def run_router(serve_args: Sequence[str], *, replicas: int, routing: str = "least_loaded", host: str = "127.0.0.1",
               port: int = 8000, shutdown_timeout_s: float = 10.0, ready_timeout_s: float = 600.0,
               log_level: str = "info", api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               uvicorn_options: dict | None = None, allowed_hosts: Sequence[str] | None = None) -> None:
    """Start ``replicas`` servers (``replicas.start_replicas(serve_args, ...)``), wait until all are ready, route
    ``host:port`` to them until SIGINT/SIGTERM, then stop them: SIGTERM, up to ``shutdown_timeout_s`` for them to
    drain plus 15 s to exit, then SIGKILL.  A replica that fails to start stops the others and raises.
    ``api_key`` reaches the replicas in their environment (``MINILLM_API_KEY``), never on a command line that
    ``ps`` shows; ``uvicorn_options``: the front's connection limits (``connections.uvicorn_options``)."""
    import signal

    import uvicorn

    from minillm.entrypoints.openai.replicas import start_replicas, stop_replicas, threads_per_replica, wait_ready

    if routing not in ROUTING:
        raise ValueError(f"routing must be one of {', '.join(ROUTING)}, got {routing!r}")
    threads = threads_per_replica(replicas)
    stop_s = shutdown_timeout_s + 15.0

    def interrupt(sig, frame):  # until uvicorn takes the signals over: SIGTERM while loading stops the replicas
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    procs: list[ReplicaProcess] = []
    try:
        procs = start_replicas(serve_args, replicas, threads=threads, api_key=api_key)
        print(f"[router: {replicas} replicas ({threads} torch threads each) loading: pids "
              f"{', '.join(str(p.pid) for p in procs)}]", file=sys.stderr, flush=True)
        wait_ready(procs, ready_timeout_s)
        signal.signal(signal.SIGTERM, previous)
        pool = ReplicaPool([Replica(p.index, p.url, p) for p in procs], routing)

        class RouterServer(uvicorn.Server):
            async def shutdown(self, sockets=None):
                pool.draining = True  # replicas now exit on purpose: no "replica exited" warnings
                await asyncio.to_thread(stop_replicas, procs, stop_s)  # they drain and end their streams
                await super().shutdown(sockets)

        print(f"[router: {routing} over {', '.join(p.url for p in procs)}; serving on http://{host}:{port}/v1]",
              file=sys.stderr, flush=True)
        app = build_router_app(pool, api_key=api_key, max_body_bytes=max_body_bytes, allowed_hosts=allowed_hosts)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=shutdown_timeout_s, **(uvicorn_options or {}))
        RouterServer(config).run()
    except KeyboardInterrupt:
        pass  # Ctrl-C (or SIGTERM while loading): stop the replicas below and return
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_replicas(procs, stop_s)
