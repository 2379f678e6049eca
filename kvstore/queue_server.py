"""The prefill queue over HTTP: any `PrefillQueue` served to other processes.

Owns the HTTP API of the prefill queue and its wire types. `kvgate up` without Redis
keeps one in-process `MemoryPrefillQueue`: its router uses it directly, its worker
processes reach it through this server with `kvstore.http_queue.HttpPrefillQueue`.
The server never starts or closes the queue: whoever made it owns it.

Wire format (base URL `http://host:port`, as `QueueServer.url` gives it):
- `POST /v1/prefill-queue/{enqueue,claim,ack,renew,depth,dead-letters}`: the request
  body and the 200 answer are msgpack maps, the structs below (`*Request` in, `*Reply`
  out; `ack` and `renew` send the claim's `WireClaim`). A job travels as a msgpack
  `bin` holding the bytes of `encode_job`, so the codec of `kvstore.prefill_job` is
  the only one for jobs.
- `GET /v1/prefill-queue/health`: JSON `HealthReply`, 200 while the queue is
  available, 503 when not.
- Errors are JSON `{"error": {"message", "type", "param", "code"}}`: 400 a body that
  does not decode or validate, 401 a missing or wrong bearer token (when the server
  has one; every route needs it then), 404, 413, 503 the queue is unavailable.

Invariants:
- `claim` long-polls for `min(timeout_s, MAX_CLAIM_WAIT_S)`; clients split longer waits.
- A claim whose client goes away while it waits is cancelled and takes nothing. A job
  the queue handed out whose answer cannot be delivered (the client left, the
  connection broke) stays pending in the queue, unacked, and the queue delivers it
  again once it is idle for `idle_timeout_s`, exactly as for a prefill worker that
  died holding it; the server keeps no state of its own for it.
- The retirements the queue counts while claiming (`num_reclaimed`, `num_expired`,
  `num_dead_lettered`) are reported to clients once each, with the first claim that
  answers after they happened: while this server's clients are the queue's only
  claimers, their sums equal the queue's own counts.
- `stop()` gives in-flight requests `STOP_GRACE_S`, then cancels them (long polls).

Called by `kvgate up` and by tests; the client is `kvstore.http_queue`.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

import msgspec
from aiohttp import web

from kvstore.prefill_job import ClaimedJob, DeadLetter, PrefillJob, decode_job, encode_job
from kvstore.prefill_queue import PrefillQueue, QueueUnavailable

log = logging.getLogger(__name__)

ROUTE_PREFIX = "/v1/prefill-queue"
MSGPACK = "application/vnd.msgpack"
MAX_CLAIM_WAIT_S = 30.0
STOP_GRACE_S = 0.25
# Room for a job of a few hundred thousand token ids.
MAX_BODY_BYTES = 64 * 1024 * 1024
RETIREMENTS = ("num_reclaimed", "num_expired", "num_dead_lettered")

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Name = Annotated[str, msgspec.Meta(min_length=1)]


class EnqueueRequest(msgspec.Struct):
    job: bytes


class EnqueueReply(msgspec.Struct):
    accepted: bool


class ClaimRequest(msgspec.Struct):
    model: Name
    consumer: Name
    timeout_s: Annotated[float, msgspec.Meta(ge=0)]


class WireClaim(msgspec.Struct):
    """A `ClaimedJob`: the claim's answer and the ack's request."""

    job: bytes
    entry_id: Name
    consumer: Name
    num_deliveries: Annotated[int, msgspec.Meta(ge=1)]


class ClaimReply(msgspec.Struct):
    claimed: WireClaim | None = None
    num_reclaimed: int = 0
    num_expired: int = 0
    num_dead_lettered: int = 0


class AckReply(msgspec.Struct):
    acked: bool


class RenewReply(msgspec.Struct):
    renewed: bool


class DepthRequest(msgspec.Struct):
    model: Name


class DepthReply(msgspec.Struct):
    depth: int


class DeadLettersRequest(msgspec.Struct):
    model: Name
    limit: Annotated[int, msgspec.Meta(ge=0)] = 100


class WireDeadLetter(msgspec.Struct):
    entry_id: str
    reason: str
    num_deliveries: int
    job: bytes | None = None


class DeadLettersReply(msgspec.Struct):
    dead_letters: list[WireDeadLetter]


class HealthReply(msgspec.Struct):
    status: str
    available: bool
    counters: dict[str, int]


def claim_to_wire(claimed: ClaimedJob) -> WireClaim:
    return WireClaim(encode_job(claimed.job), claimed.entry_id, claimed.consumer, claimed.num_deliveries)


def claim_from_wire(wire: WireClaim) -> ClaimedJob:
    """Raises `msgspec.DecodeError` / `ValidationError` when the job bytes are malformed."""
    return ClaimedJob(decode_job(wire.job), wire.entry_id, wire.consumer, wire.num_deliveries)


def dead_letter_to_wire(dead: DeadLetter) -> WireDeadLetter:
    job = None if dead.job is None else encode_job(dead.job)
    return WireDeadLetter(dead.entry_id, dead.reason, dead.num_deliveries, job)


def dead_letter_from_wire(wire: WireDeadLetter) -> DeadLetter:
    """`job` is None when it was None on the server or its bytes do not decode."""
    try:
        job = None if wire.job is None else decode_job(wire.job)
    except (msgspec.DecodeError, msgspec.ValidationError):
        job = None
    return DeadLetter(wire.entry_id, wire.reason, wire.num_deliveries, job)


# -- the app -------------------------------------------------------------------------


@dataclass(slots=True)
class ServerState:
    queue: PrefillQueue
    token: str | None
    # The queue's retirement counts already reported to a client.
    reported: dict[str, int] = field(default_factory=dict)

    def take_retirements(self) -> dict[str, int]:
        """The retirements counted since the last call, keyed like `ClaimReply`'s fields."""
        counts = {name: getattr(self.queue.counters, name) for name in RETIREMENTS}
        news = {name: counts[name] - self.reported.get(name, 0) for name in RETIREMENTS}
        self.reported = counts
        return news


STATE = web.AppKey("queue_server", ServerState)


class ApiError(Exception):
    """A request the server refuses; answered as OpenAI-style error JSON."""

    def __init__(self, status: int, message: str, error_type: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.code = code


def create_app(queue: PrefillQueue, token: str | None = None) -> web.Application:
    """The queue's HTTP app; `token` (when set) must come as `Authorization: Bearer ...`."""
    app = web.Application(middlewares=[_error_middleware, _auth_middleware], client_max_size=MAX_BODY_BYTES)
    state = ServerState(queue, token or None)
    state.take_retirements()  # retirements from before serving belong to no client
    app[STATE] = state
    routes: dict[str, Callable[[web.Request], Awaitable[web.Response]]] = {
        "enqueue": _enqueue,
        "claim": _claim,
        "ack": _ack,
        "renew": _renew,
        "depth": _depth,
        "dead-letters": _dead_letters,
    }
    for name, handler in routes.items():
        app.router.add_post(f"{ROUTE_PREFIX}/{name}", handler)
    app.router.add_get(f"{ROUTE_PREFIX}/health", _health)
    return app


async def _enqueue(request: web.Request) -> web.Response:
    body = await _decode(request, EnqueueRequest)
    job = _decode_job(body.job)
    accepted = await request.app[STATE].queue.enqueue(job)
    return _msgpack(EnqueueReply(accepted))


async def _claim(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _decode(request, ClaimRequest)
    claimed = await state.queue.claim(body.model, body.consumer, min(body.timeout_s, MAX_CLAIM_WAIT_S))
    if claimed is None and not state.queue.is_available:
        # A closed in-process queue answers None at once; say why instead.
        raise QueueUnavailable("the served prefill queue is closed or unavailable")
    wire = None if claimed is None else claim_to_wire(claimed)
    return _msgpack(ClaimReply(wire, **state.take_retirements()))


async def _ack(request: web.Request) -> web.Response:
    claimed = await _decode_claim(request)
    return _msgpack(AckReply(await request.app[STATE].queue.ack(claimed)))


async def _renew(request: web.Request) -> web.Response:
    claimed = await _decode_claim(request)
    return _msgpack(RenewReply(await request.app[STATE].queue.renew(claimed)))


async def _depth(request: web.Request) -> web.Response:
    body = await _decode(request, DepthRequest)
    return _msgpack(DepthReply(await request.app[STATE].queue.depth(body.model)))


async def _dead_letters(request: web.Request) -> web.Response:
    body = await _decode(request, DeadLettersRequest)
    dead = await request.app[STATE].queue.dead_letters(body.model, body.limit)
    return _msgpack(DeadLettersReply([dead_letter_to_wire(d) for d in dead]))


async def _health(request: web.Request) -> web.Response:
    queue = request.app[STATE].queue
    available = queue.is_available
    reply = HealthReply("ok" if available else "unavailable", available, queue.counters.snapshot())
    status = 200 if available else 503
    return web.Response(body=msgspec.json.encode(reply), status=status, content_type="application/json")


async def _decode(request: web.Request, kind: type[T]) -> T:
    payload = await request.read()
    try:
        return msgspec.msgpack.decode(payload, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        op = request.path.rsplit("/", 1)[-1]
        raise ApiError(400, f"bad {op} request (a msgpack {kind.__name__} is expected): {exc}", "invalid_request_error")


async def _decode_claim(request: web.Request) -> ClaimedJob:
    body = await _decode(request, WireClaim)
    return ClaimedJob(_decode_job(body.job), body.entry_id, body.consumer, body.num_deliveries)


def _decode_job(payload: bytes) -> PrefillJob:
    try:
        return decode_job(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ApiError(400, f"bad job (msgpack PrefillJob expected): {exc}", "invalid_request_error", "bad_job")


def _msgpack(reply: msgspec.Struct) -> web.Response:
    return web.Response(body=msgspec.msgpack.encode(reply), content_type=MSGPACK)


def error_json(status: int, message: str, error_type: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return web.Response(body=msgspec.json.encode(body), status=status, content_type="application/json")


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_json(exc.status, str(exc), exc.error_type, exc.code)
    except QueueUnavailable as exc:
        return error_json(503, f"prefill queue unavailable: {exc}", "queue_unavailable")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error_type = "invalid_request_error" if exc.status < 500 else "server_error"
        return error_json(exc.status, exc.text or exc.reason, error_type)
    except Exception as exc:
        log.exception("prefill queue server: %s %s failed", request.method, request.path)
        return error_json(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = request.app[STATE].token
    if token is not None:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {token}".encode()):
            message = "missing or wrong bearer token for the prefill queue"
            raise ApiError(401, message, "authentication_error", "invalid_api_key")
    return await handler(request)


# -- the server ----------------------------------------------------------------------


class QueueServer:
    """Serves `queue` on host:port (0: any free port) until `stop()`; see the module doc."""

    def __init__(self, queue: PrefillQueue, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"QueueServer port must be in 0..65535, got {port!r}")
        self.queue = queue
        self.host = host
        self.port = port
        self.url: str | None = None
        self._token = token or None
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        """Bind and serve; returns (and sets) `url`, with the real port when 0 was asked."""
        if self._runner is not None:
            raise RuntimeError(f"QueueServer already serves at {self.url}")
        runner = web.AppRunner(
            create_app(self.queue, self._token),
            handler_cancellation=True,
            shutdown_timeout=STOP_GRACE_S,
            access_log=None,
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        host, port = runner.addresses[0][:2]
        self._runner = runner
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        """Stop serving (the queue itself stays open); in-flight long polls end."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
