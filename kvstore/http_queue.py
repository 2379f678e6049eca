"""The prefill queue of another process, reached over HTTP (`kvstore.queue_server`).

Owns one worker process's handle on a queue served by a `QueueServer`: an aiohttp
client session, the server's availability, and this client's counters. It keeps the
`PrefillQueue` contract of `kvstore.prefill_queue`; the queue behind the server does
the queueing. URL form: the server's base URL, `http://host:port` (or `https://`); a
path in it is kept as a prefix of the API's routes.

Invariants:
- Every request runs under a deadline of `op_timeout_s` (plus the wait of a claim).
  No answer in time, a refused or broken connection, or a 503 (the served queue is
  unavailable) marks the server down and raises `QueueUnavailable`. While it is down
  every operation fails at once without touching the network, and a
  `kvstore.reconnect.Reconnector` probes `/health` with backoff until it answers 200;
  the connections opened before the outage are dropped first.
- Any other refusal (4xx) raises `QueueRejected`, a `QueueUnavailable` with the
  server's message, so callers fall back to local prefill the same way; a 401 (token
  missing or wrong) also marks the server down, as nothing works until it changes.
- `counters` count what this client did: its enqueues and duplicates, the jobs
  delivered to it, renewed and acked by it, its failed operations (`num_unavailable`),
  and the retirements (reclaimed, expired, dead-lettered) the server reports with its
  claims.
- A claim longer than `MAX_CLAIM_WAIT_S` is several long polls. A claim abandoned on
  this side (timed out, cancelled) after the server took a job leaves that job
  pending there: it is delivered again after `idle_timeout_s`.

Called through `kvstore.prefill_queue.open_prefill_queue()` by worker processes.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

import aiohttp
import msgspec
import yarl

from kvstore.prefill_job import ClaimedJob, DeadLetter, PrefillJob, encode_job
from kvstore.prefill_queue import QueueConfig, QueueCounters, QueueUnavailable
from kvstore.queue_server import (
    MAX_CLAIM_WAIT_S,
    MSGPACK,
    RETIREMENTS,
    ROUTE_PREFIX,
    AckReply,
    ClaimReply,
    ClaimRequest,
    DeadLettersReply,
    DeadLettersRequest,
    DepthReply,
    DepthRequest,
    EnqueueReply,
    EnqueueRequest,
    HealthReply,
    RenewReply,
    claim_from_wire,
    claim_to_wire,
    dead_letter_from_wire,
)
from kvstore.reconnect import Reconnector

T = TypeVar("T")

_UNREACHABLE = (aiohttp.ClientError, TimeoutError, OSError)


class QueueRejected(QueueUnavailable):
    """The queue server answered but refused the request (`status`, its message)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class HttpPrefillQueue:
    """`PrefillQueue` served by a `QueueServer` at `url`; see the module doc."""

    def __init__(self, url: str, config: QueueConfig | None = None, token: str | None = None) -> None:
        parsed = yarl.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"prefill queue URL must be http://host:port or https://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self.config = config or QueueConfig()
        self.counters = QueueCounters()
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._session: aiohttp.ClientSession | None = None
        self._is_session_stale = False
        self._link = Reconnector(
            f"prefill queue server at {self.url}",
            self._probe,
            probe_timeout_s=self.config.op_timeout_s,
            backoff_initial_s=self.config.backoff_initial_s,
            backoff_max_s=self.config.backoff_max_s,
        )

    @property
    def is_available(self) -> bool:
        return self._link.is_up

    async def start(self) -> None:
        await self._link.check()

    async def close(self) -> None:
        await self._link.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def enqueue(self, job: PrefillJob) -> bool:
        reply = await self._call("enqueue", EnqueueRequest(encode_job(job)), EnqueueReply)
        if reply.accepted:
            self.counters.num_enqueued += 1
        else:
            self.counters.num_duplicates += 1
        return reply.accepted

    async def claim(self, model: str, consumer: str, timeout_s: float) -> ClaimedJob | None:
        loop = asyncio.get_running_loop()
        end = loop.time() + max(timeout_s, 0.0)
        while True:
            wait_s = min(max(end - loop.time(), 0.0), MAX_CLAIM_WAIT_S)
            reply = await self._call("claim", ClaimRequest(model, consumer, wait_s), ClaimReply, wait_s)
            for name in RETIREMENTS:
                setattr(self.counters, name, getattr(self.counters, name) + getattr(reply, name))
            if reply.claimed is not None:
                claimed = self._decode_claim(reply)
                self.counters.num_delivered += 1
                return claimed
            # A wait shorter than the cap was the last one.
            if wait_s < MAX_CLAIM_WAIT_S or loop.time() >= end:
                return None

    async def ack(self, claimed: ClaimedJob) -> bool:
        reply = await self._call("ack", claim_to_wire(claimed), AckReply)
        if reply.acked:
            self.counters.num_acked += 1
        return reply.acked

    async def renew(self, claimed: ClaimedJob) -> bool:
        reply = await self._call("renew", claim_to_wire(claimed), RenewReply)
        if reply.renewed:
            self.counters.num_renewed += 1
        return reply.renewed

    async def depth(self, model: str) -> int:
        return (await self._call("depth", DepthRequest(model), DepthReply)).depth

    async def dead_letters(self, model: str, limit: int = 100) -> list[DeadLetter]:
        reply = await self._call("dead-letters", DeadLettersRequest(model, limit), DeadLettersReply)
        return [dead_letter_from_wire(dead) for dead in reply.dead_letters]

    async def _call(self, op: str, request: msgspec.Struct, reply_type: type[T], wait_s: float = 0.0) -> T:
        """POST `request` to `op` within `op_timeout_s + wait_s`; the decoded 200 answer."""
        if not self._link.is_up:
            self.counters.num_unavailable += 1
            if self._link.is_closed:
                raise QueueUnavailable(f"the client of the {self._link.name} is closed")
            reason = self._link.reason
            raise QueueUnavailable(f"{self._link.name} is unavailable ({reason}); probing it in the background")
        headers = {**self._auth, "Content-Type": MSGPACK}
        try:
            async with asyncio.timeout(self.config.op_timeout_s + wait_s):
                async with self._session_now().post(
                    f"{self.url}{ROUTE_PREFIX}/{op}", data=msgspec.msgpack.encode(request), headers=headers
                ) as response:
                    status, payload = response.status, await response.read()
        except _UNREACHABLE as exc:
            raise self._down(f"{op}: {_describe(exc, self.config.op_timeout_s + wait_s)}") from exc
        if status == 200:
            try:
                return msgspec.msgpack.decode(payload, type=reply_type)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise self._rejected(f"{op}: the answer is no {reply_type.__name__}: {exc}", status) from exc
        message = _error_message(payload)
        if status == 503:
            raise self._down(f"{op}: {status} {message}")
        if status == 401:
            self._link.mark_down(f"the server rejected the bearer token: {message}")
        raise self._rejected(f"{op}: {status} {message}", status)

    def _decode_claim(self, reply: ClaimReply) -> ClaimedJob:
        assert reply.claimed is not None
        try:
            return claim_from_wire(reply.claimed)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # The server holds it pending: it comes back after the idle timeout.
            raise self._rejected(f"claim: the server sent an undecodable job: {exc}", 200) from exc

    def _down(self, reason: str) -> QueueUnavailable:
        self._link.mark_down(reason)
        self._is_session_stale = True
        self.counters.num_unavailable += 1
        return QueueUnavailable(f"{self._link.name} is unavailable: {reason}")

    def _rejected(self, message: str, status: int) -> QueueRejected:
        self.counters.num_unavailable += 1
        return QueueRejected(f"{self._link.name} refused {message}", status)

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None:
            # NOTE: no aiohttp timeouts: every call's deadline is enforced around it.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._session

    async def _probe(self) -> None:
        """Returns when the server answers 200 on /health; raises with the reason when not."""
        if self._is_session_stale and self._session is not None:
            # Its connections predate the outage: never reuse them.
            await self._session.close()
            self._session = None
        self._is_session_stale = False
        async with self._session_now().get(f"{self.url}{ROUTE_PREFIX}/health", headers=self._auth) as response:
            status, payload = response.status, await response.read()
        if status == 401:
            raise QueueRejected(f"the server rejected the bearer token: {_error_message(payload)}", status)
        if status != 200:
            raise QueueUnavailable(f"health: {status} {_error_message(payload)}")
        try:
            msgspec.json.decode(payload, type=HealthReply)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise QueueUnavailable(f"health: not a kvgate prefill queue server ({exc})") from exc


def _describe(exc: BaseException, deadline_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {deadline_s:g} s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error_message(payload: bytes) -> str:
    """The message of an OpenAI-style error body, else the start of the body."""
    try:
        return str(msgspec.json.decode(payload)["error"]["message"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return payload[:200].decode(errors="replace")

