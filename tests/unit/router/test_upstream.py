"""The upstream HTTP/1.1 client against raw TCP servers that answer byte for byte as told."""

import asyncio

import pytest

from router.upstream import UpstreamError, UpstreamPool

REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


class RawServer:
    """Answers each request on a connection with the next scripted reply (a list of byte pieces)."""

    def __init__(self, replies) -> None:
        self.replies = list(replies)
        self.num_connections = 0
        self.requests: list[bytes] = []
        self.closed_by_peer = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                for piece in reply:
                    if piece == "CLOSE":
                        writer.close()
                        return
                    if piece == "HANG":
                        if await reader.read(1) == b"":
                            self.closed_by_peer.set()
                        return
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                        continue
                    writer.write(piece)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_peer.set()
        finally:
            writer.close()

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def raw_server():
    servers: list[RawServer] = []
    pools: list[UpstreamPool] = []

    async def start(*replies, read_timeout_s: float = 5.0):
        server = RawServer(replies)
        port = await server.start()
        pool = UpstreamPool(connect_timeout_s=1.0, read_timeout_s=read_timeout_s)
        servers.append(server)
        pools.append(pool)
        return server, pool, port

    yield start
    for pool in pools:
        await pool.close()
    for server in servers:
        await server.close()


def _ok(body: bytes, extra: bytes = b"") -> list[bytes]:
    return [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body]


async def test_content_length_answers_reuse_one_connection(raw_server):
    server, pool, port = await raw_server(_ok(b'{"a": 1}'), _ok(b'{"b": 2}'))
    first = await pool.request("127.0.0.1", port, False, REQUEST)
    assert (first.status, first.headers["content-type"]) == (200, "application/json")
    assert await first.read() == b'{"a": 1}' and first.done
    second = await pool.request("127.0.0.1", port, False, REQUEST)
    assert await second.read() == b'{"b": 2}'
    assert server.num_connections == 1 and pool.num_connections == 1
    assert server.requests == [REQUEST, REQUEST]


async def test_chunked_body_split_anywhere_is_dechunked(raw_server):
    raw = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
           b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n")
    pieces = [raw[i:i + 3] for i in range(0, len(raw), 3)]  # every boundary in a new segment
    server, pool, port = await raw_server([*pieces], _ok(b"next"))
    response = await pool.request("127.0.0.1", port, False, REQUEST)
    assert response.headers["content-type"] == "text/event-stream"
    assert await response.read() == b"hello, world"
    again = await pool.request("127.0.0.1", port, False, REQUEST)
    assert await again.read() == b"next" and server.num_connections == 1


async def test_streamed_chunks_arrive_as_they_are_sent(raw_server):
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, pool, port = await raw_server([head, b"6\r\ndata 1\r\n", 0.05, b"6\r\ndata 2\r\n", 0.05, b"0\r\n\r\n"])
    response = await pool.request("127.0.0.1", port, False, REQUEST)
    assert await response.next_chunk() == b"data 1"
    assert await response.next_chunk() == b"data 2"
    assert await response.next_chunk() == b""


async def test_interim_and_empty_answers(raw_server):
    server, pool, port = await raw_server(
        [b"HTTP/1.1 100 Continue\r\n\r\n", *_ok(b"after 100")],
        [b"HTTP/1.1 204 No Content\r\n\r\n"],
        [b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy"],
    )
    assert await (await pool.request("127.0.0.1", port, False, REQUEST)).read() == b"after 100"
    empty = await pool.request("127.0.0.1", port, False, REQUEST)
    assert (empty.status, await empty.read()) == (204, b"")
    busy = await pool.request("127.0.0.1", port, False, REQUEST)
    assert (busy.status, await busy.read()) == (503, b"busy")
    assert server.num_connections == 1


async def test_close_delimited_and_connection_close_answers_are_not_reused(raw_server):
    server, pool, port = await raw_server(
        [b"HTTP/1.1 200 OK\r\n\r\nuntil ", 0.02, b"the end", "CLOSE"],
        _ok(b"closing", b"Connection: close\r\n"),
        _ok(b"fresh"),
    )
    assert await (await pool.request("127.0.0.1", port, False, REQUEST)).read() == b"until the end"
    assert await (await pool.request("127.0.0.1", port, False, REQUEST)).read() == b"closing"
    assert await (await pool.request("127.0.0.1", port, False, REQUEST)).read() == b"fresh"
    assert server.num_connections == 3


async def test_a_stale_idle_connection_is_replaced_transparently(raw_server):
    server, pool, port = await raw_server([*_ok(b"one"), "CLOSE"], _ok(b"two"))
    assert await (await pool.request("127.0.0.1", port, False, REQUEST)).read() == b"one"
    # The server closed the kept-alive connection; the pool may not have noticed yet.
    answer = await pool.request("127.0.0.1", port, False, REQUEST)
    assert await answer.read() == b"two"
    assert server.num_connections == 2 and server.requests == [REQUEST, REQUEST]


@pytest.mark.parametrize(
    ("reply", "kind", "when"),
    [
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "CLOSE"], "disconnect", "body"),
        (["CLOSE"], "disconnect", "head"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n"], "protocol", "body"),
        ([b"SMTP ready\r\n\r\n"], "protocol", "head"),
        ([b"HTTP/1.1 200 OK\r\nbroken header\r\n\r\n"], "protocol", "head"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nabc"], "protocol", "body"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n"], "protocol", "head"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nabc"], "protocol", "body"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc"], "protocol", "body"),
    ],
)
async def test_broken_answers_raise_typed_errors(raw_server, reply, kind, when):
    server, pool, port = await raw_server(reply)
    with pytest.raises(UpstreamError) as caught:
        response = await pool.request("127.0.0.1", port, False, REQUEST)
        assert when == "body"
        await response.read()
    assert caught.value.kind == kind
    await asyncio.sleep(0.01)
    assert pool.num_connections == 0


async def test_read_timeout_and_connect_errors(raw_server):
    server, pool, port = await raw_server(["HANG"], read_timeout_s=0.1)
    with pytest.raises(UpstreamError) as caught:
        await pool.request("127.0.0.1", port, False, REQUEST)
    assert caught.value.kind == "timeout"
    await asyncio.wait_for(server.closed_by_peer.wait(), 2)  # the worker saw the connection go
    await server.close()
    with pytest.raises(UpstreamError) as caught:
        await pool.request("127.0.0.1", port, False, REQUEST)
    assert caught.value.kind == "connect"


async def test_a_slow_gap_between_chunks_is_fine_below_the_read_timeout(raw_server):
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = [head] + [piece for _ in range(4) for piece in (0.06, b"1\r\nx\r\n")] + [b"0\r\n\r\n"]
    server, pool, port = await raw_server(chunks, read_timeout_s=0.1)
    response = await pool.request("127.0.0.1", port, False, REQUEST)
    assert await response.read() == b"xxxx"  # 0.24 s in all, never 0.1 s of silence


async def test_closing_an_unfinished_answer_drops_the_connection(raw_server):
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, pool, port = await raw_server([head, b"1\r\na\r\n", "HANG"], _ok(b"later"))
    response = await pool.request("127.0.0.1", port, False, REQUEST)
    assert await response.next_chunk() == b"a"
    response.close()
    await asyncio.wait_for(server.closed_by_peer.wait(), 2)
    assert await (await pool.request("127.0.0.1", port, False, REQUEST)).read() == b"later"
    assert server.num_connections == 2


async def test_cancelling_a_waiting_request_drops_the_connection(raw_server):
    server, pool, port = await raw_server(["HANG"])
    task = asyncio.create_task(pool.request("127.0.0.1", port, False, REQUEST))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.wait([task])
    await asyncio.wait_for(server.closed_by_peer.wait(), 2)
    await asyncio.sleep(0.01)
    assert pool.num_connections == 0


async def test_a_slow_reader_pauses_the_worker_instead_of_buffering_everything(raw_server):
    big = b"y" * (3 << 20)
    server, pool, port = await raw_server(_ok(big))
    response = await pool.request("127.0.0.1", port, False, REQUEST)
    await asyncio.sleep(0.2)  # the body arrives while nobody reads
    assert response.num_buffered <= (1 << 20) + (1 << 18)
    assert await response.read() == big


async def test_connections_have_tcp_nodelay(raw_server):
    import socket

    server, pool, port = await raw_server(_ok(b"x"))
    await (await pool.request("127.0.0.1", port, False, REQUEST)).read()
    (conn,) = pool._all
    sock = conn.transport.get_extra_info("socket")
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_one_timer_serves_a_connection_across_requests(raw_server):
    server, pool, port = await raw_server(_ok(b"one"), _ok(b"two"), ["HANG"], read_timeout_s=0.2)
    loop = asyncio.get_running_loop()
    assert await (await pool.request("127.0.0.1", port, False, REQUEST)).read() == b"one"
    await asyncio.sleep(0.25)  # the timer fires while the connection is idle, and lapses
    assert await (await pool.request("127.0.0.1", port, False, REQUEST)).read() == b"two"
    await asyncio.sleep(0.12)  # this timer is still pending when the next request starts
    started = loop.time()
    with pytest.raises(UpstreamError) as caught:
        await pool.request("127.0.0.1", port, False, REQUEST)
    assert caught.value.kind == "timeout" and loop.time() - started >= 0.19  # timed from its own start
    assert server.num_connections == 1
