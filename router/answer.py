"""Whole answers to clients, written as one pre-encoded HTTP/1.1 message.

Owns `whole_answer(...)`, which the proxy (`router.proxy`) uses for every answer it
relays whole: a worker's non-streamed answer, or its 429/5xx when retries ran out.
It returns a `RawAnswer` (a `web.StreamResponse` whose head is pre-encoded bytes) or,
where that cannot be exact, a plain `web.Response`.

Why: an aiohttp `web.Response` builds a header multidict per answer, runs its generic
preparation (cookies, compression, chunking, content-type defaults, the
`on_response_prepare` signal) and serialises the headers, about a dozen Python calls
for a head that is nearly the same bytes every time. `RawAnswer` is handed the head
already encoded (status lines and header lines are cached per distinct value) and
gives head and body to aiohttp's writer in one `write_eof`: one transport write, and
aiohttp still owns the connection (keep-alive, pipelining, closing, disconnects).

Invariants:
- The bytes on the wire are those aiohttp would send for the same answer: status line,
  the given headers, `Content-Length`, `Date`, `Server`, and `Connection: close` when
  the request did not keep the connection alive. Anything `RawAnswer` cannot render
  that way (an HTTP/1.0 request, a status without a body: 1xx, 204, 304) gets a
  `web.Response` instead.
- No header line with a CR or LF inside is ever written: a worker's header value
  cannot split the answer (such a value is dropped, as aiohttp would refuse it).
- It skips the `on_response_prepare` signal: the router's apps register none.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11
from multidict import CIMultiDict

_MAX_CACHED_LINES = 4096  # distinct header lines kept encoded (worker ids, content types)
_NO_BODY_STATUSES = frozenset({204, 304})
_SERVER_LINE = f"Server: {SERVER_SOFTWARE}\r\n".encode()
_KEEP_ALIVE_END = b"\r\n\r\n"
_CLOSE_END = b"\r\nConnection: close\r\n\r\n"


class _Date:
    """The current HTTP `Date` header line, encoded again only when the second changes."""

    __slots__ = ("second", "line")

    def __init__(self) -> None:
        self.second = -1
        self.line = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.line = f"Date: {formatdate(now, usegmt=True)}\r\n".encode()
        return self.line


_date = _Date()
_status_lines: dict[int, bytes] = {}
_header_lines: dict[tuple[str, str], bytes] = {}


def status_line(status: int) -> bytes:
    line = _status_lines.get(status)
    if line is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = ""
        line = _status_lines[status] = f"HTTP/1.1 {status} {reason}\r\n".encode()
    return line


def header_line(name: str, value: str) -> bytes:
    """`name: value\\r\\n`, encoded once per distinct pair; b"" for a value with CR or LF."""
    key = (name, value)
    line = _header_lines.get(key)
    if line is None:
        line = b"" if "\r" in value or "\n" in value else f"{name}: {value}\r\n".encode()  # as aiohttp encodes
        if len(_header_lines) >= _MAX_CACHED_LINES:
            _header_lines.clear()  # request ids never come here; this only bounds odd workers
        _header_lines[key] = line
    return line


class RawAnswer(web.StreamResponse):
    """A whole answer whose head (status line and headers, see `whole_answer`) is pre-encoded."""

    def __init__(self, status: int, head: bytes, body: bytes) -> None:
        # NOTE: StreamResponse.__init__ is skipped on purpose (it builds a header multidict
        # nobody reads); the class attributes it relies on keep their defaults.
        self._state = {}
        self._status = status
        self._raw_head = head
        self._raw_body = body

    @property
    def reason(self) -> str:
        return self._raw_head[13 : self._raw_head.find(b"\r\n")].decode("latin-1")

    @property
    def _headers(self) -> CIMultiDict[str]:  # type: ignore[override]
        """The headers as written, for `headers` and aiohttp's readers of them (logging); built on demand."""
        headers: CIMultiDict[str] = CIMultiDict()
        for line in self._raw_head.decode("latin-1").split("\r\n")[1:-1]:
            name, _, value = line.partition(": ")
            headers.add(name, value)
        return headers

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if self._eof_sent:
            return None
        if self._payload_writer is None:
            self._req = request
            self._keep_alive = request.keep_alive
            self._payload_writer = request.writer
        return self._payload_writer

    async def write_eof(self, data: bytes = b"") -> None:
        if self._eof_sent:
            return
        writer = self._payload_writer
        assert writer is not None and not data, "prepare() first; the body is given up front"
        body = self._raw_body
        end = _KEEP_ALIVE_END if self._keep_alive else _CLOSE_END
        await writer.write_eof(b"".join((
            self._raw_head, _date.get(), _SERVER_LINE, b"Content-Length: ", str(len(body)).encode(), end, body,
        )))
        self._eof_sent = True
        self._req = None
        self._body_length = len(body)
        self._payload_writer = None


def whole_answer(
    request: web.BaseRequest, status: int, content_type: str | None, header_lines: bytes, body: bytes
) -> web.StreamResponse:
    """The answer to `request`: `status`, `content_type`, more `header_lines` (from `header_line`), `body`."""
    if content_type is None and body:
        content_type = "application/octet-stream"  # aiohttp's default for a body of unknown type
    if content_type is not None:
        header_lines = header_line("Content-Type", content_type) + header_lines
    if request.version == HttpVersion11 and status >= 200 and status not in _NO_BODY_STATUSES:
        return RawAnswer(status, status_line(status) + header_lines, body)
    headers: CIMultiDict[str] = CIMultiDict()
    for line in header_lines.decode("latin-1").split("\r\n")[:-1]:
        name, _, value = line.partition(": ")
        headers.add(name, value)
    return web.Response(status=status, body=body, headers=headers)
