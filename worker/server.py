"""The worker's HTTP server: the OpenAI endpoints, health, models and metrics over any engine.

Owns the app factory `create_app`, the one middleware that turns every failure into
OpenAI error JSON, the handlers that turn an engine's outputs into JSON responses or
SSE streams, the worker's Prometheus registry (one per app, so several workers can
share a process), and `start_server`. It drives any `worker.engine.Engine` (the
simulated one in `worker/sim.py`, the torch one later), parses and formats with
`worker/api.py` and detokenizes with `worker/text.py`.
`kvgate worker` (worker/worker_cmd.py) and the tests are its callers.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE), `GET
/v1/models`, `GET /health` (503 once the engine is dead or the server is stopping) and
`GET /metrics`.

Invariants:
- the app owns the engine's run: started in a `cleanup_ctx`, stopped after the last
  handler returns; from `on_shutdown` on, new requests get 503 (the router retries
  them elsewhere) while those in flight finish within the runner's shutdown timeout.
- every submitted request is aborted in the engine when its handler ends for any
  reason (finished, stop string, error, client gone): abort is a no-op once done, so
  a client that disconnects frees its KV blocks.
- a stream's headers go out with its first tokens: a request that fails before then
  gets a plain JSON error status (which the router may retry); one that fails after
  gets an SSE error event, then `[DONE]`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.api import (
    SSE_DONE,
    ApiError,
    EngineUnavailable,
    GenerateRequest,
    InvalidRequest,
    PayloadTooLarge,
    ServedModel,
    Usage,
    chunk_body,
    error_body,
    parse_chat,
    parse_completion,
    response_body,
    sse_event,
    to_json,
    usage_chunk_body,
)
from worker.engine import Engine, EngineOutput
from worker.text import TextStream

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


@dataclass(frozen=True, slots=True)
class ServerConfig:
    max_body_bytes: int = 16 * 1024 * 1024
    owned_by: str = "kvgate"


@dataclass(slots=True)
class ServerState:
    stopping: bool = False
    started_at: int = field(default_factory=lambda: int(time.time()))
    status: Callable[[], dict[str, Any]] | None = None


class WorkerMetrics:
    """The app's own Prometheus registry: request metrics plus the engine's stats at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvgate_worker_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.ttft = Histogram(
            "kvgate_worker_time_to_first_token_seconds", "Time from request to its first output token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.latency = Histogram(
            "kvgate_worker_request_latency_seconds", "Time from request to its last output token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))


class _EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> list[Metric]:
        stats = self._engine.stats()
        gauges = {
            "num_requests_running": ("Requests in the running batch", stats.num_running),
            "num_requests_waiting": ("Requests queued for admission", stats.num_waiting),
            "kv_cache_usage_ratio": ("Fraction of KV blocks held by requests", stats.kv_usage),
            "kv_blocks_total": ("KV blocks in the pool", stats.num_kv_blocks_total),
            "kv_blocks_cached": ("KV blocks in the prefix cache", stats.num_cached_blocks),
            "prefix_cache_hit_rate": ("Prompt tokens found cached / prompt tokens", stats.prefix_hit_rate),
            "generation_tokens_per_second": ("Output tokens per second, recent window", stats.generation_tokens_per_s),
            "engine_alive": ("1 while the engine runs", int(self._engine.is_alive)),
        }
        counters = {
            "prompt_tokens": ("Prompt tokens admitted", stats.num_prompt_tokens),
            "cached_prompt_tokens": ("Prompt tokens found in the prefix cache", stats.num_cached_prompt_tokens),
            "generation_tokens": ("Output tokens generated", stats.num_generation_tokens),
            "preemptions": ("Requests preempted for lack of KV blocks", stats.num_preemptions),
            "engine_steps": ("Engine steps run", stats.num_steps),
        }
        metrics: list[Metric] = [
            GaugeMetricFamily(f"kvgate_worker_{name}", doc, value=value) for name, (doc, value) in gauges.items()
        ]
        metrics += [
            CounterMetricFamily(f"kvgate_worker_{name}", doc, value=value) for name, (doc, value) in counters.items()
        ]
        return metrics


ENGINE = web.AppKey("engine", Engine)
CONFIG = web.AppKey("config", ServerConfig)
STATE = web.AppKey("state", ServerState)
METRICS = web.AppKey("metrics", WorkerMetrics)


def create_app(
    engine: Engine, config: ServerConfig | None = None, *,
    status: Callable[[], dict[str, Any]] | None = None, collectors: Sequence[Collector] = (),
) -> web.Application:
    """The worker app; running it starts `engine`, cleaning it up stops it.

    `status` adds its keys to `/health`'s body; `collectors` add to `/metrics`.
    """
    config = config or ServerConfig()
    app = web.Application(middlewares=[error_middleware], client_max_size=config.max_body_bytes)
    app[ENGINE] = engine
    app[CONFIG] = config
    app[STATE] = ServerState(status=status)
    app[METRICS] = WorkerMetrics(engine)
    for collector in collectors:
        app[METRICS].registry.register(collector)
    app.cleanup_ctx.append(_engine_ctx)
    app.on_shutdown.append(_mark_stopping)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    await app[ENGINE].start()
    yield
    await app[ENGINE].stop()


async def _mark_stopping(app: web.Application) -> None:
    app[STATE].stopping = True


async def start_server(
    app: web.Application, host: str, port: int, *, shutdown_timeout: float = 5.0
) -> tuple[web.AppRunner, str]:
    """Runs `app` on host:port (0: any free port); returns the runner and the base URL.

    Handlers are cancelled when their client disconnects, so its request is aborted.
    aiohttp sets TCP_NODELAY on every accepted connection.
    """
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, f"http://{bound_host}:{bound_port}"


# -- middleware ----------------------------------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure -> OpenAI error JSON with its status; counts every answer by route."""
    try:
        response = await handler(request)
    except ApiError as exc:
        response = _json(exc.body(), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error_type = _ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "internal_error")
        response = _json(error_body(exc.reason, error_type), exc.status)
    except Exception:
        logger.exception("unexpected error in %s %s", request.method, request.path)
        response = _json(error_body("internal error", "internal_error"), 500)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    request.app[METRICS].requests.labels(route, str(response.status)).inc()
    return response


def _json(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=to_json(body), status=status, content_type="application/json")


# -- handlers ------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat)


async def models(request: web.Request) -> web.Response:
    served = request.app[ENGINE].served
    entry = {
        "id": served.name,
        "object": "model",
        "created": request.app[STATE].started_at,
        "owned_by": request.app[CONFIG].owned_by,
        "max_model_len": served.max_model_len,
    }
    return _json({"object": "list", "data": [entry]})


async def health(request: web.Request) -> web.Response:
    if request.app[STATE].stopping:
        return _json({"status": "stopping"}, 503)
    if not request.app[ENGINE].is_alive:
        return _json({"status": "unavailable"}, 503)
    status = request.app[STATE].status
    return _json({"status": "ok", **status()} if status is not None else {"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[CONFIG].max_body_bytes
        raise PayloadTooLarge(f"the request body exceeds {limit} bytes") from None
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        # msgspec checks UTF-8 in object keys lazily and raises UnicodeDecodeError there.
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


async def _generate(request: web.Request, parse: Callable[[Any, ServedModel], GenerateRequest]) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _read_json(request)
    generate = parse(body, engine.served)
    if request.app[STATE].stopping:
        raise EngineUnavailable("the worker is shutting down")
    started_at = time.perf_counter()
    try:
        async with aclosing(engine.submit(generate)) as outputs:
            run = _Run(request, generate, outputs, started_at)
            return await (run.stream() if generate.stream else run.complete())
    finally:
        engine.abort(generate.request_id)


class _Run:
    """One request's outputs turned into a JSON response or an SSE stream."""

    def __init__(
        self,
        request: web.Request,
        generate: GenerateRequest,
        outputs: AsyncGenerator[EngineOutput, None],
        started_at: float,
    ) -> None:
        self.request = request
        self.generate = generate
        self.outputs = outputs
        self.started_at = started_at
        self.metrics = request.app[METRICS]
        self.text = TextStream(request.app[ENGINE].served.tokenizer, generate.stop)
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None

    async def _next(self) -> str | None:
        """The text of the next output, or None at the end."""
        if self.finish_reason is not None:
            return None
        output = await anext(self.outputs, None)
        if output is None:
            raise EngineUnavailable("the engine ended the request without finishing it")
        if self.text.num_tokens == 0:
            self.metrics.ttft.observe(time.perf_counter() - self.started_at)
        self.num_cached_tokens = output.num_cached_tokens
        delta = self.text.add(output.token_ids)
        self.finish_reason = "stop" if self.text.stopped else output.finish_reason
        if self.finish_reason is not None:
            delta += self.text.flush()
            self.metrics.latency.observe(time.perf_counter() - self.started_at)
        return delta

    def _usage(self) -> Usage:
        return Usage(self.generate.num_prompt_tokens, self.text.num_tokens, self.num_cached_tokens)

    async def complete(self) -> web.Response:
        while await self._next() is not None:
            pass
        assert self.finish_reason is not None
        return _json(response_body(self.generate, self.text.text, self.finish_reason, self._usage()))

    async def stream(self) -> web.StreamResponse:
        delta = await self._next()  # errors up to here are plain JSON errors
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(self.request)
        try:
            await self._write_events(response, delta)
            await response.write(SSE_DONE)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left; the caller aborts the request
        return response

    async def _write_events(self, response: web.StreamResponse, delta: str | None) -> None:
        generate = self.generate
        try:
            if generate.kind == "chat":
                await response.write(sse_event(chunk_body(generate, "", None, role=True)))
            while delta is not None:
                if delta or self.finish_reason is not None:
                    await response.write(sse_event(chunk_body(generate, delta, self.finish_reason)))
                delta = await self._next()
            if generate.include_usage:
                await response.write(sse_event(usage_chunk_body(generate, self._usage())))
        except ApiError as exc:
            await response.write(sse_event(exc.body()))
        except ConnectionResetError:
            raise
        except Exception:
            # Headers are out: the middleware can no longer answer, so the stream says it.
            logger.exception("stream of %s failed", generate.request_id)
            await response.write(sse_event(error_body("internal error", "internal_error")))
