"""One keep-alive HTTP/1.1 connection to a worker: the response parser under `router.upstream`.

Owns the byte-level side of the router's upstream client: `Connection` (an asyncio
protocol that sends one serialized request at a time and parses its answer: status
line, headers, then a body framed by Content-Length, chunked encoding or connection
close), `UpstreamResponse` (the answer as its caller reads it) and `UpstreamError`.
Only `router.upstream.UpstreamPool` creates connections; it is told through the
`ConnectionOwner` hooks when one may be reused (`give_back`) or is gone (`forget`).

Invariants:
- Body bytes are handed over exactly as they arrive, de-chunked, in order; the
  connection pauses reading while more than `HIGH_WATER` bytes wait for the reader.
- An answer read to its end with keep-alive returns the connection to its owner at
  once; any other ending aborts the connection (the worker sees the disconnect).
- The read timeout is the longest silence allowed while an answer is awaited; a
  reader too slow to take the bytes (reading paused) never counts as silence. One
  timer per connection serves every exchange on it (no timer per request).
- Every failure reaches the waiting caller as an `UpstreamError` whose `kind` is
  `disconnect`, `timeout` or `protocol` (the pool adds `connect`).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Protocol

MAX_HEAD_BYTES = 64 * 1024
HIGH_WATER = 1 << 20
# Where a chunked body's parser is when it is not inside a chunk's data (`_remaining`
# then holds one of these; inside data it holds the bytes left, always > 0).
_AT_SIZE_LINE = -1
_AT_DATA_END = -2  # the CRLF after a chunk's data
_AT_TRAILERS = -3  # after the last chunk, until an empty line


class UpstreamError(Exception):
    """The exchange with a worker failed; `kind` says how (see the module docstring)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UpstreamResponse:
    """One worker answer: status and headers first, then the body as it arrives."""

    __slots__ = ("status", "headers", "_conn", "_chunks", "_num_buffered", "_waiter", "_done", "_error")

    def __init__(self, conn: Connection, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers  # lower-case names; the last value of a repeated header
        self._conn = conn
        self._chunks: list[bytes] = []
        self._num_buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: UpstreamError | None = None

    async def next_chunk(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); b"" at the end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._num_buffered = 0
        self._conn.may_resume()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        chunks = self._chunks
        if self._done and self._error is None:  # it all came with the head: nothing to wait for
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._num_buffered = 0
            return data
        parts = []
        while chunk := await self.next_chunk():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def num_buffered(self) -> int:
        """Body bytes received and not yet read."""
        return self._num_buffered

    @property
    def at_end(self) -> bool:
        """Whether the whole answer arrived fine and was read: `next_chunk()` would return b""."""
        return self._done and not self._chunks and self._error is None

    @property
    def done(self) -> bool:
        """Whether the whole answer arrived (its connection may already serve another)."""
        return self._done

    def close(self) -> None:
        """Stops reading: an answer that did not arrive whole closes its connection."""
        if not self._done:
            self._conn.abort()

    # -- fed by the connection -----------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._num_buffered += len(data)
        self._wake()

    def _finish(self, error: UpstreamError | None) -> None:
        if error is not None and not self._done:
            self._error = error
        self._done = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class ConnectionOwner(Protocol):
    def give_back(self, conn: Connection) -> None: ...

    def forget(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One keep-alive connection: parses the answer to the request in flight."""

    def __init__(self, pool: ConnectionOwner, key: tuple[str, int, bool], loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.num_requests = 0
        self._head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._buffer = bytearray()
        self._state = "idle"  # head -> length | chunked | until_close -> idle
        self._remaining = 0  # body bytes left (length), or of the chunk, or an _AT_* state
        self._keep_alive = True
        self._got_bytes = False
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self._last_activity = 0.0

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self._state == "until_close":
            self._complete()
        elif self._state != "idle":
            self._fail(UpstreamError("disconnect", f"the worker closed the connection{_reason(exc)}"))
        self._cancel_timer()

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        self._last_activity = self.loop.time()
        if self._state == "idle":
            self.abort()  # bytes nobody asked for: the connection cannot be trusted
            return
        try:
            self._parse(data)
        except UpstreamError as exc:
            self._fail(exc)
            self.abort()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost finishes the answer

    # -- one exchange ----------------------------------------------------------------------

    def send(self, data: bytes, read_timeout_s: float) -> asyncio.Future[UpstreamResponse]:
        assert self._state == "idle" and self.transport is not None
        self.num_requests += 1
        self._state = "head"
        self._got_bytes = False
        self._keep_alive = True
        waiter = self._head_waiter = self.loop.create_future()
        self._last_activity = now = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_at(now + read_timeout_s, self._on_timer, read_timeout_s)
        self.transport.write(data)
        return waiter

    @property
    def got_bytes(self) -> bool:
        return self._got_bytes

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.abort()

    def may_resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self._last_activity = self.loop.time()
            self.transport.resume_reading()

    # -- parsing ---------------------------------------------------------------------------

    def _parse(self, data: bytes) -> None:
        if self._state == "head":
            if self._buffer:  # the head came in pieces: parse it whole
                self._buffer += data
                data = bytes(self._buffer)
                self._buffer.clear()
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > MAX_HEAD_BYTES:
                    raise UpstreamError("protocol", "response headers too large")
                self._buffer += data
                return
            head, rest = data[:end], data[end + 4 :]
            if not self._start_response(head):
                self._state = "head"
                if rest:
                    self._parse(rest)
                return
            data = rest
            if not data and self._state != "idle":
                return
        if self._state == "length":
            self._body_length(data)
        elif self._state == "chunked":
            self._buffer += data
            self._body_chunked()
        elif self._state == "until_close":
            if data:
                self._deliver(data)

    def _start_response(self, head: bytes) -> bool:
        """Parses a response head; False for a 1xx interim answer (skipped)."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise UpstreamError("protocol", f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return False
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise UpstreamError("protocol", f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        connection = headers.get("connection", "").lower()
        self._keep_alive = parts[0] == "HTTP/1.1" and "close" not in connection
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state, self._remaining = "chunked", _AT_SIZE_LINE
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise UpstreamError("protocol", f"bad Content-Length {length[:20]!r}")
            self._state, self._remaining = "length", int(length)
        elif status in (204, 304):
            self._state, self._remaining = "length", 0
        else:
            self._state, self._keep_alive = "until_close", False
        self._response = UpstreamResponse(self, status, headers)
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(self._response)
        if self._state == "length" and self._remaining == 0:
            self._complete()
        return True

    def _body_length(self, data: bytes) -> None:
        if len(data) > self._remaining:
            raise UpstreamError("protocol", "more body bytes than Content-Length")
        self._remaining -= len(data)
        if data:
            self._deliver(data)
        if self._remaining == 0:
            self._complete()

    def _body_chunked(self) -> None:
        buffer = self._buffer
        while True:
            if self._remaining > 0:  # inside a chunk's data
                take = min(self._remaining, len(buffer))
                if take == 0:
                    return
                self._deliver(bytes(buffer[:take]))
                del buffer[:take]
                self._remaining -= take
                if self._remaining:
                    return
                self._remaining = _AT_DATA_END
            line_end = buffer.find(b"\r\n")
            if line_end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise UpstreamError("protocol", "chunk size line too long")
                return
            line = bytes(buffer[:line_end])
            del buffer[: line_end + 2]
            if self._remaining == _AT_DATA_END:
                if line:
                    raise UpstreamError("protocol", "missing CRLF after a chunk")
                self._remaining = _AT_SIZE_LINE
            elif self._remaining == _AT_TRAILERS:
                if not line:
                    self._complete()
                    return
            else:
                self._remaining = _chunk_size(line) or _AT_TRAILERS

    def _deliver(self, data: bytes) -> None:
        response = self._response
        assert response is not None
        response._feed(data)
        if response._num_buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _complete(self) -> None:
        response, self._response = self._response, None
        self._state = "idle"
        self._buffer.clear()
        if response is not None:
            response._finish(None)
        if self._keep_alive and not self.closed:
            self.pool.give_back(self)
        else:
            self.abort()

    def _fail(self, error: UpstreamError) -> None:
        self._state = "idle"
        self._cancel_timer()
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        response, self._response = self._response, None
        if response is not None:
            response._finish(error)

    # -- read timeout: one timer per connection, pushed back lazily on activity ----------------
    # NOTE: an exchange that finishes leaves the timer running, and the next one reuses
    # it (`send` only records its start): no timer is created or cancelled per request.
    # A timer that fires on an idle connection just lapses; `send` arms a new one.

    def _on_timer(self, timeout_s: float) -> None:
        deadline = self._last_activity + timeout_s
        if self._state == "idle":
            self._timer = None
        elif self.loop.time() < deadline or self._paused:  # a slow reader is not a slow worker
            deadline = max(deadline, self.loop.time() + timeout_s) if self._paused else deadline
            self._timer = self.loop.call_at(deadline, self._on_timer, timeout_s)
        else:
            self._timer = None
            self._fail(UpstreamError("timeout", f"the worker sent nothing for {timeout_s:g} s"))
            self.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _chunk_size(line: bytes) -> int:
    """The size on a chunk-size line (extensions after ';' ignored), hexadecimal digits only."""
    digits = line.split(b";", 1)[0].strip()
    if not digits or digits.strip(b"0123456789abcdefABCDEF"):
        raise UpstreamError("protocol", f"bad chunk size {line[:40]!r}")
    return int(digits, 16)


def _reason(exc: Exception | None) -> str:
    return f": {exc}" if exc is not None else ""
