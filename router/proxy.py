"""Forwarding one request to the ranked workers: retries before the first byte, relay after.

Owns the upstream exchange of a request. The app's handlers call `Forwarder.forward`
with the parsed request and the routing decision (`router.routing`); it tries the
ranked candidates in order over the pooled connections of `router.upstream` and
relays the first usable answer.

Retry rules (NOTE: the client must never see two answers or half of one twice):
- Retried on the next still-eligible candidate, after a short exponential backoff and
  at most `max_retries` times: a connect error, a timeout or a broken connection
  before the answer's first body byte, and a 429 or 5xx status. Only transport
  errors and 5xx count against the worker's circuit breaker.
- A streamed answer is relayed only once its first body chunk has arrived, so a
  worker that dies between its headers and its first token is still retried. Once a
  byte reached the client nothing is retried: a stream that breaks later ends with an
  SSE `error` event.
- A non-streaming answer is read whole before anything is sent, so it is retried on
  any transport failure, even one in the middle of its body.
- When every attempt failed, the last worker's 429/5xx answer is relayed as is; if
  none answered at all, the client gets 503.

While disaggregation is active, each attempt's body carries that attempt's prefill
decision (`Decision.prefill`, made by `RoutingCore.dispatch`) as `kv_transfer_params`,
and the answer carries `X-Kvgate-Prefill: remote|local`; otherwise the body goes out
exactly as parsed and no such header is added.

Streaming relays each chunk as it arrives (no re-framing of the SSE bytes, no
buffering); both sockets have TCP_NODELAY (the upstream pool sets it; aiohttp sets it
on every connection it accepts). What is already there goes out together, nothing is
held back for what is not: the answer's head with its first chunk, a last chunk with
the end of the answer. A client that goes away cancels the handler (the app runs with
handler cancellation), which closes the upstream connection, so the worker aborts the
request and frees its blocks.

A whole answer is sent from here (`router.answer`, one write) before the attempt's
bookkeeping (breaker, load tracker, metrics), so the client does not wait for it; the
request timeout stops applying once the worker has answered.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from router.answer import header_line, whole_answer
from router.errors import GatewayTimeout, NoEligibleWorker
from router.metrics import GatewayMetrics
from router.requests import CHAT, COMPLETIONS, ParsedRequest, with_kv_transfer_params
from router.upstream import UpstreamError, UpstreamPool, UpstreamResponse

if TYPE_CHECKING:
    from router.policy.base import Candidate
    from router.routing import Decision, RoutingCore

PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
CLIENT_GONE = 499  # nginx's status for "the client closed the request", for metrics only
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_RELAYED_HEADERS = (("content-type", "Content-Type"), ("content-encoding", "Content-Encoding"))


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 300.0  # longest silence allowed inside one answer
    request_timeout_s: float = 0.0  # a whole request; 0: unlimited (streams may be long)
    max_retries: int = 2
    retry_backoff_s: float = 0.01  # doubles per retry, up to retry_backoff_max_s
    retry_backoff_max_s: float = 0.5

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0 or self.request_timeout_s < 0:
            raise ValueError("proxy timeouts must be positive (request_timeout_s may be 0: unlimited)")
        if self.max_retries < 0 or self.retry_backoff_s < 0 or self.retry_backoff_max_s < 0:
            raise ValueError("max_retries and retry backoffs must not be negative")


class _Failure:
    """An attempt that may be retried: why, and the worker's answer if it sent one."""

    __slots__ = ("kind", "detail", "answer")

    def __init__(self, kind: str, detail: str, answer: web.StreamResponse | None = None) -> None:
        self.kind = kind
        self.detail = detail
        self.answer = answer


class _Target:
    """A worker's address and the constant start of every request sent to it, per route."""

    __slots__ = ("host", "port", "tls", "heads")

    def __init__(self, base_url: str) -> None:
        url = URL(base_url)
        self.host = url.host or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.tls = url.scheme == "https"
        prefix = url.path.rstrip("/")
        raw_host = url.raw_host or self.host
        shown_host = f"[{raw_host}]" if ":" in raw_host else raw_host  # an IPv6 literal
        host_header = shown_host if url.is_default_port() else f"{shown_host}:{url.port}"
        self.heads = {
            kind: (f"POST {prefix}{path} HTTP/1.1\r\nHost: {host_header}\r\n"
                   "Content-Type: application/json\r\nContent-Length: ").encode()
            for kind, path in PATHS.items()
        }

    def serialize(self, kind: str, request_id: str, body: bytes) -> bytes:
        return b"".join((self.heads[kind], str(len(body)).encode(), b"\r\nX-Request-Id: ",
                         request_id.encode(), b"\r\n\r\n", body))


class Forwarder:
    """See the module docstring."""

    def __init__(self, pool: UpstreamPool, config: ProxyConfig, metrics: GatewayMetrics) -> None:
        self.pool = pool
        self.config = config
        self.metrics = metrics
        self._targets: dict[str, _Target] = {}

    def _target(self, base_url: str) -> _Target:
        target = self._targets.get(base_url)
        if target is None:
            target = self._targets[base_url] = _Target(base_url)
        return target

    async def forward(
        self, request: web.Request, parsed: ParsedRequest, decision: Decision, core: RoutingCore, started: float
    ) -> web.StreamResponse:
        if self.config.request_timeout_s <= 0:
            return await self._forward(request, parsed, decision, core, started, None)
        try:
            async with asyncio.timeout(self.config.request_timeout_s) as timeout:
                return await self._forward(request, parsed, decision, core, started, timeout)
        except TimeoutError:
            raise GatewayTimeout(f"no answer within {self.config.request_timeout_s:g} s") from None

    async def _forward(
        self, request: web.Request, parsed: ParsedRequest, decision: Decision, core: RoutingCore, started: float,
        timeout: asyncio.Timeout | None,
    ) -> web.StreamResponse:
        failure: _Failure | None = None
        num_attempts = 0
        for candidate in decision.ranked:
            if num_attempts > self.config.max_retries:
                break
            if num_attempts:
                if not core.is_eligible(candidate):
                    continue
                self.metrics.observe_retry(failure.kind if failure else "unknown")
                await asyncio.sleep(self._backoff(num_attempts))
            num_attempts += 1
            core.dispatch(decision, candidate)
            if num_attempts == 1:
                self.metrics.observe_overhead(time.perf_counter() - started)
            try:
                outcome = await self._attempt(request, parsed, decision, candidate, core, started, timeout)
            finally:
                core.finish(decision, candidate)
            if not isinstance(outcome, _Failure):
                return outcome
            failure = outcome
            self.metrics.observe_upstream_error(candidate.worker_id, outcome.kind)
        if failure is not None and failure.answer is not None:
            return failure.answer
        detail = f": last error {failure.detail}" if failure else ""
        raise NoEligibleWorker(f"no worker could serve the request after {num_attempts} attempt(s){detail}")

    def _backoff(self, num_attempts: int) -> float:
        return min(self.config.retry_backoff_max_s, self.config.retry_backoff_s * (2 ** (num_attempts - 1)))

    async def _attempt(
        self, request: web.Request, parsed: ParsedRequest, decision: Decision,
        candidate: Candidate, core: RoutingCore, started: float, timeout: asyncio.Timeout | None,
    ) -> web.StreamResponse | _Failure:
        target = self._target(candidate.url)
        request_id = decision.request.request_id
        prefill = decision.prefill
        body = parsed.body if prefill is None else with_kv_transfer_params(parsed, prefill.kv_transfer_params())
        data = target.serialize(parsed.kind, request_id, body)
        upstream: UpstreamResponse | None = None
        try:
            upstream = await self.pool.request(target.host, target.port, target.tls, data)
            status = upstream.status
            if status in _RETRY_STATUSES:
                answer = await self._whole(request, upstream, candidate, decision)
                core.record_outcome(decision, ok=status < 500)
                return _Failure(f"status_{status}", f"{candidate.worker_id} answered {status}", answer)
            if parsed.stream and status == 200:
                return await self._relay_stream(request, upstream, decision, candidate, core, started)
            answer = await self._whole(request, upstream, candidate, decision)
        except UpstreamError as exc:
            core.record_outcome(decision, ok=False)
            return _Failure(exc.kind, f"{candidate.worker_id}: {exc}")
        finally:
            if upstream is not None:
                upstream.close()  # a no-op once read whole; else the worker sees the disconnect
        await self._deliver(request, answer, decision, timeout)
        core.record_outcome(decision, ok=True)
        core.first_token(decision)
        return answer

    @staticmethod
    async def _deliver(
        request: web.Request, answer: web.StreamResponse, decision: Decision, timeout: asyncio.Timeout | None
    ) -> None:
        """Sends a whole answer now, so the client does not wait for the bookkeeping after it."""
        if timeout is not None:
            timeout.reschedule(None)  # the worker has answered: only waiting on it is limited
        try:
            await answer.prepare(request)
            await answer.write_eof()  # aiohttp's own write after the handler then does nothing
        except ConnectionResetError:
            decision.client_gone = True

    @staticmethod
    async def _whole(
        request: web.Request, upstream: UpstreamResponse, candidate: Candidate, decision: Decision
    ) -> web.StreamResponse:
        """The worker's answer, read whole, as the client will get it."""
        body = await upstream.read()
        headers = upstream.headers
        encoding = headers.get("content-encoding")
        prefill = decision.prefill
        lines = b"".join((
            header_line("Content-Encoding", encoding) if encoding is not None else b"",
            header_line("X-Kvgate-Worker", candidate.worker_id),
            header_line("X-Kvgate-Prefill", prefill.label) if prefill is not None else b"",
            b"X-Request-Id: ", decision.request.request_id.encode(), b"\r\n",
        ))
        return whole_answer(request, upstream.status, headers.get("content-type"), lines, body)

    @staticmethod
    def _headers(upstream: UpstreamResponse, candidate: Candidate, decision: Decision) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict()
        for name, shown in _RELAYED_HEADERS:
            value = upstream.headers.get(name)
            if value is not None:
                headers[shown] = value
        headers["X-Kvgate-Worker"] = candidate.worker_id
        if decision.prefill is not None:
            headers["X-Kvgate-Prefill"] = decision.prefill.label
        headers["X-Request-Id"] = decision.request.request_id
        return headers

    async def _relay_stream(
        self, request: web.Request, upstream: UpstreamResponse, decision: Decision,
        candidate: Candidate, core: RoutingCore, started: float,
    ) -> web.StreamResponse | _Failure:
        first = await upstream.next_chunk()  # an UpstreamError here is retried
        if not first:
            core.record_outcome(decision, ok=False)
            return _Failure("empty", f"{candidate.worker_id} closed the stream before its first byte")
        headers = self._headers(upstream, candidate, decision)
        headers["Cache-Control"] = "no-cache"
        response = _StreamAnswer(status=upstream.status, headers=headers)
        try:
            await response.prepare(request)
            core.first_token(decision)
            self.metrics.observe_ttft(time.perf_counter() - started)
            await self._relay(upstream, response, decision, candidate, core, first)
        except ConnectionResetError:
            decision.client_gone = True  # the caller's `finally` closes the upstream side
        return response

    async def _relay(
        self, upstream: UpstreamResponse, response: web.StreamResponse,
        decision: Decision, candidate: Candidate, core: RoutingCore, chunk: bytes,
    ) -> None:
        """Relays `chunk` and the rest until the worker's end, then ends the answer.

        A chunk that is the stream's last goes out with the end of the answer in one
        write; nothing is ever held back to merge it with what has not arrived yet.
        A client write error propagates.
        """
        read = upstream.next_chunk
        write = response.write
        while not upstream.at_end:
            await write(chunk)
            last = chunk
            try:
                chunk = await read()
            except UpstreamError as exc:
                core.record_outcome(decision, ok=False)
                self.metrics.observe_upstream_error(candidate.worker_id, "broken_stream")
                await response.write_eof(_stream_error_event(last, f"the worker's stream broke: {exc}"))
                return
            if not chunk:
                break
        core.record_outcome(decision, ok=True)
        await response.write_eof(chunk)


class _StreamAnswer(web.StreamResponse):
    """A relayed stream whose head goes out with its first chunk: one write, one TCP segment."""

    _send_headers_immediately = False


def _stream_error_event(last_chunk: bytes, message: str) -> bytes:
    event = msgspec.json.encode({"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}})
    # An event cut in half by the failure is terminated first, so this one parses alone.
    prefix = b"" if last_chunk.endswith(b"\n\n") else b"\n\n"
    return prefix + b"data: " + event + b"\n\n"
