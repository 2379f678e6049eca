"""A lean HTTP/1.1 client for the router's upstream hop: pooled keep-alive connections to workers.

Owns the connections from the router to its workers. The proxy (`router.proxy`) sends
every forwarded request through `UpstreamPool.request` and reads the answer from the
returned `UpstreamResponse`, whole (`read`) or chunk by chunk as it arrives (`next_chunk`).

Why not aiohttp's client: this hop runs once per request on the router's hot path, and
aiohttp's general-purpose client (request and response objects, cookie and redirect
handling, a timer per read) cost about as much CPU as everything else the router does
per request. This client does only what the hop needs: one request per connection at a
time, bodies framed by Content-Length, chunked encoding or connection close, and the
body bytes handed over exactly as they arrive (no re-buffering of a stream).

The byte-level work (one connection, its response parser, its read timeout) is in
`router.upstream_conn`; this module owns the pool and the request path.

Invariants:
- A connection goes back to the pool only after its answer was read to the end with
  keep-alive; anything else (an error, a timeout, a caller that stops reading or is
  cancelled) closes it, so the worker sees the disconnect and aborts the request.
- A request that fails on a reused idle connection before any byte of the answer came
  back (the worker closed it while idle) is sent again once on a fresh connection.
- Every socket has TCP_NODELAY; reading pauses while a slow reader has more than
  `upstream_conn.HIGH_WATER` body bytes waiting.
- Every failure is an `UpstreamError` whose `kind` is `connect`, `timeout`,
  `disconnect` or `protocol`.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import defaultdict

from router.upstream_conn import Connection, UpstreamError, UpstreamResponse

__all__ = ["UpstreamError", "UpstreamPool", "UpstreamResponse"]


class UpstreamPool:
    """Keep-alive connections per worker address, reused most recently used first."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, *, max_idle_per_host: int = 256) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle_per_host = max_idle_per_host
        self._idle: defaultdict[tuple[str, int, bool], list[Connection]] = defaultdict(list)
        self._all: set[Connection] = set()
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    async def request(self, host: str, port: int, tls: bool, data: bytes) -> UpstreamResponse:
        """Sends one serialized request; returns once the answer's headers arrived."""
        key = (host, port, tls)
        conn = self._take_idle(key)
        if conn is not None:
            try:
                return await self._exchange(conn, data)
            except UpstreamError as exc:
                if conn.got_bytes or exc.kind != "disconnect":
                    raise
                # A stale keep-alive connection: the worker never saw this request.
        return await self._exchange(await self._connect(key), data)

    async def _exchange(self, conn: Connection, data: bytes) -> UpstreamResponse:
        try:
            return await conn.send(data, self.read_timeout_s)
        except BaseException:
            conn.abort()
            raise

    def _take_idle(self, key: tuple[str, int, bool]) -> Connection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> Connection:
        if self._closed:
            raise UpstreamError("connect", "the router is shutting down")
        host, port, tls = key
        loop = asyncio.get_running_loop()
        context = self._tls_context() if tls else None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, key, loop), host, port, ssl=context,
                    server_hostname=host if tls else None,
                )
        except TimeoutError:
            raise UpstreamError("connect", f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise UpstreamError("connect", f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        self._all.add(conn)
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def give_back(self, conn: Connection) -> None:
        idle = self._idle[conn.key]
        if self._closed or len(idle) >= self.max_idle_per_host:
            conn.abort()
        else:
            idle.append(conn)

    def forget(self, conn: Connection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    @property
    def num_connections(self) -> int:
        return len(self._all)

    async def close(self) -> None:
        """Closes every connection, idle or busy."""
        self._closed = True
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()
        # Let the transports run connection_lost before the loop may close.
        await asyncio.sleep(0)
