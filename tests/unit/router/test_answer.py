"""Pre-encoded whole answers against aiohttp's own `web.Response`, byte for byte, over raw sockets."""

import asyncio

from aiohttp import web

from router.answer import RawAnswer, header_line, whole_answer

BODY = b'{"object": "text_completion", "choices": []}'
CASES = {  # path -> (status, headers)
    "/ok": (200, [("Content-Type", "application/json"), ("X-Kvgate-Worker", "w0"), ("X-Request-Id", "r1")]),
    "/busy": (503, [("Content-Type", "application/json; charset=utf-8"), ("X-Kvgate-Worker", "w1")]),
    "/odd": (599, [("Content-Encoding", "identity")]),
    "/empty": (204, [("X-Kvgate-Worker", "w2")]),
}


def _app() -> web.Application:
    async def raw(request: web.Request) -> web.StreamResponse:
        status, headers = CASES[request.path.removeprefix("/raw")]
        content_type = dict(headers).get("Content-Type")
        lines = b"".join(header_line(name, value) for name, value in headers if name != "Content-Type")
        return whole_answer(request, status, content_type, lines, b"" if status == 204 else BODY)

    async def reference(request: web.Request) -> web.StreamResponse:
        status, headers = CASES[request.path.removeprefix("/ref")]
        return web.Response(status=status, headers=headers, body=None if status == 204 else BODY)

    app = web.Application()
    for path in CASES:
        app.router.add_post(f"/raw{path}", raw)
        app.router.add_post(f"/ref{path}", reference)
    return app


async def _exchange(port: int, requests: list[bytes], *, closes: bool = False) -> list[tuple[str, list[str], bytes]]:
    """Sends `requests` one by one on one connection: (status line, sorted headers but Date, body)
    of each answer; with `closes`, checks that the server then closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answers = []
    try:
        for request in requests:
            writer.write(request)
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")[:-2]
            headers = sorted(line for line in head[1:] if not line.startswith("Date: "))
            lengths = [int(line.split(": ")[1]) for line in head[1:] if line.startswith("Content-Length: ")]
            answers.append((head[0], headers, await reader.readexactly(lengths[0]) if lengths else b""))
        if closes:
            assert await asyncio.wait_for(reader.read(1), 2) == b""
    finally:
        writer.close()
        await writer.wait_closed()
    return answers


def _post(path: str, version: str = "1.1", extra: str = "") -> bytes:
    return f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Length: 0\r\n{extra}\r\n".encode()


async def test_answers_match_aiohttp_responses(serve):
    port = int((await serve(_app())).rsplit(":", 1)[1])
    for path in CASES:  # two answers on one connection: both kept it alive
        raw = await _exchange(port, [_post(f"/raw{path}"), _post(f"/raw{path}")])
        assert raw == await _exchange(port, [_post(f"/ref{path}"), _post(f"/ref{path}")]), path
    status_line, headers, body = raw[0]  # the 204: no body, no Content-Length, as aiohttp does it
    assert (status_line, body) == ("HTTP/1.1 204 No Content", b"")
    assert not any(line.startswith("Content-Length") for line in headers)
    ok = await _exchange(port, [_post("/raw/ok")])
    assert ok[0][0] == "HTTP/1.1 200 OK" and ok[0][2] == BODY
    assert "X-Request-Id: r1" in ok[0][1] and f"Content-Length: {len(BODY)}" in ok[0][1]


async def test_connection_close_and_http_1_0_are_honoured(serve):
    port = int((await serve(_app())).rsplit(":", 1)[1])
    for request in (_post("/raw/ok", extra="Connection: close\r\n"), _post("/raw/ok", version="1.0")):
        raw = await _exchange(port, [request], closes=True)
        assert raw == await _exchange(port, [request.replace(b"/raw/", b"/ref/")], closes=True)
    assert raw[0][0] == "HTTP/1.0 200 OK"  # answered by a plain web.Response


async def test_header_values_cannot_split_the_answer():
    assert header_line("X-Kvgate-Worker", "w0") == b"X-Kvgate-Worker: w0\r\n"
    assert header_line("Content-Type", "text/plain\r\nSet-Cookie: x=1") == b""
    assert header_line("Content-Type", "a\nb") == b""
    answer = RawAnswer(200, b"HTTP/1.1 200 OK\r\nX-Kvgate-Worker: w0\r\nX-Request-Id: r\r\n", b"{}")
    assert dict(answer.headers) == {"X-Kvgate-Worker": "w0", "X-Request-Id": "r"}
    assert (answer.status, answer.reason, answer.prepared) == (200, "OK", False)
