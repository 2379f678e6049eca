"""Forwarding against real misbehaving HTTP backends: retries, relays, aborts, timeouts.

The routing policy is `round_robin`, whose first ranking starts at the lowest worker
id, so the faulty worker "a" is always tried before the healthy ones.
"""

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

from router.health import HealthConfig
from router.proxy import ProxyConfig
from router.worker_spec import WorkerSpec

# Probed once at startup, then not for a long time: a worker killed later stays in rotation.
SLOW_PROBES = HealthConfig(interval_s=30.0, timeout_s=0.5, fail_threshold=1, pass_threshold=1)
SSE_CHUNKS = [b'data: {"n": 0}\n\n', b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]


class Backend:
    """An OpenAI-ish worker that misbehaves as `mode` says."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.num_requests = 0
        self.bodies: list[dict] = []
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/health", self.health)
        self.app = app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.num_requests += 1
        body = await request.json()
        self.bodies.append(body)
        self.started.set()
        try:
            return await self._answer(request, body)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _answer(self, request: web.Request, body: dict) -> web.StreamResponse:
        mode = self.mode
        if mode.startswith("status_"):
            status = int(mode.removeprefix("status_"))
            error = {"error": {"message": f"backend says {status}", "type": "x", "param": None, "code": None}}
            return web.json_response(error, status=status)
        if mode == "hang":
            await asyncio.Event().wait()
        if not body.get("stream"):
            if mode == "drop_mid_body":
                response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
                await response.prepare(request)
                await response.write(b'{"partial": ')
                request.transport.close()
                return response
            return web.json_response({"object": "text_completion", "served_by": id(self)})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if mode == "die_before_first_chunk":
            request.transport.close()
            return response
        for position, chunk in enumerate(SSE_CHUNKS):
            if mode == "slow_stream" and position == 1:
                await asyncio.Event().wait()
            await response.write(chunk)
            if mode == "die_after_first_chunk":
                request.transport.close()
                return response
            if mode == "spaced":
                await asyncio.sleep(0.003)
        await response.write_eof()
        return response


async def _fleet(serve, gateway, *modes: str, **config):
    backends = [Backend(mode) for mode in modes]
    specs = []
    for name, backend in zip("abcdefgh", backends):
        specs.append(WorkerSpec(worker_id=name, url=await serve(backend.app), model="m"))
    config.setdefault("health", SLOW_PROBES)
    url, state = await gateway(*specs, policy="round_robin", **config)
    return url, state, backends


async def _post(url: str, body: dict, path: str = "/v1/completions") -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body) as response:
            return response.status, await response.read(), dict(response.headers)


BODY = {"model": "m", "prompt": "hello"}
STREAM = {**BODY, "stream": True}


async def test_connect_error_is_retried_on_the_next_worker(serve, gateway):
    dead = Backend()
    runner = web.AppRunner(dead.app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    dead_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    live = Backend()
    specs = [WorkerSpec(worker_id="a", url=dead_url, model="m"), WorkerSpec(worker_id="b", url=await serve(live.app), model="m")]
    url, state = await gateway(*specs, policy="round_robin", health=SLOW_PROBES)
    await runner.cleanup()  # "a" dies; its next probe is 30 s away
    status, body, headers = await _post(url, BODY)
    assert status == 200 and headers["X-Kvgate-Worker"] == "b"
    assert json.loads(body)["object"] == "text_completion"
    a = state.registry.get("a")
    assert (a.num_requests, a.num_failures, a.breaker.num_failures) == (1, 1, 1)
    text = state.metrics.render().decode()
    assert 'kvgate_retries_total{reason="connect"} 1.0' in text
    assert 'kvgate_upstream_errors_total{kind="connect",worker="a"} 1.0' in text


@pytest.mark.parametrize(("mode", "counts_against_breaker"), [("status_500", True), ("status_503", True), ("status_429", False)])
async def test_5xx_and_429_are_retried_but_only_5xx_count_as_failures(serve, gateway, mode, counts_against_breaker):
    url, state, (a, b) = await _fleet(serve, gateway, mode, "ok")
    status, _, headers = await _post(url, STREAM)
    assert status == 200 and headers["X-Kvgate-Worker"] == "b"
    assert (a.num_requests, b.num_requests) == (1, 1)
    assert state.registry.get("a").breaker.num_failures == (1 if counts_against_breaker else 0)


async def test_retries_are_bounded_and_the_last_answer_is_relayed(serve, gateway):
    url, state, backends = await _fleet(serve, gateway, "status_500", "status_502", "status_503", "ok",
                                        proxy=ProxyConfig(max_retries=2))
    status, body, headers = await _post(url, BODY)
    assert status == 503 and headers["X-Kvgate-Worker"] == "c"
    assert json.loads(body)["error"]["message"] == "backend says 503"
    assert [backend.num_requests for backend in backends] == [1, 1, 1, 0]


async def test_no_retry_when_retries_are_off_and_nothing_answered(serve, gateway):
    url, state = await gateway(
        WorkerSpec(worker_id="a", url="http://127.0.0.1:9", model="m"), wait_healthy=False,
        proxy=ProxyConfig(max_retries=0),
    )
    state.registry.get("a").health.record(True)  # as if its probe had passed once
    status, body, _ = await _post(url, BODY)
    assert status == 503
    error = json.loads(body)["error"]
    assert error["code"] == "no_eligible_worker" and "after 1 attempt(s)" in error["message"]


async def test_non_streaming_answer_broken_mid_body_is_retried(serve, gateway):
    url, _, (a, b) = await _fleet(serve, gateway, "drop_mid_body", "ok")
    status, body, headers = await _post(url, BODY)
    assert status == 200 and headers["X-Kvgate-Worker"] == "b"
    assert json.loads(body)["served_by"] == id(b)


async def test_stream_dying_before_its_first_chunk_is_retried(serve, gateway):
    url, _, (a, b) = await _fleet(serve, gateway, "die_before_first_chunk", "ok")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    status, body, headers = await _post(url, chat, "/v1/chat/completions")
    assert status == 200 and headers["X-Kvgate-Worker"] == "b"
    assert body == b"".join(SSE_CHUNKS)
    assert headers["Content-Type"] == "text/event-stream"


async def test_stream_broken_after_its_first_byte_is_never_retried(serve, gateway):
    url, state, (a, b) = await _fleet(serve, gateway, "die_after_first_chunk", "ok")
    status, body, headers = await _post(url, STREAM)
    assert status == 200 and headers["X-Kvgate-Worker"] == "a"
    assert body.startswith(SSE_CHUNKS[0])
    event = json.loads(body[len(SSE_CHUNKS[0]):].removeprefix(b"data: "))
    assert event["error"]["type"] == "upstream_error"
    assert b.num_requests == 0
    assert state.registry.get("a").num_failures == 1


@pytest.mark.parametrize("body", [BODY, STREAM])
async def test_client_disconnect_aborts_the_upstream_request(serve, gateway, body):
    url, state, (a,) = await _fleet(serve, gateway, "slow_stream" if body.get("stream") else "hang")
    async with aiohttp.ClientSession() as http:
        request = asyncio.create_task(http.post(url + "/v1/completions", json=body))
        if body.get("stream"):
            response = await asyncio.wait_for(request, 3)
            assert await response.content.readany() == SSE_CHUNKS[0]
            response.close()  # drops the connection mid-stream
        else:
            await asyncio.wait_for(a.started.wait(), 3)
            request.cancel()
            await asyncio.wait([request])
    await asyncio.wait_for(a.cancelled.wait(), 3)
    for _ in range(300):
        if state.num_in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert state.num_in_flight == 0 and state.tracker.num_in_flight == 0
    assert state.registry.get("a").num_in_flight == 0
    assert 'kvgate_requests_total{route="/v1/completions",status="499"} 1.0' in state.metrics.render().decode()


async def test_request_timeout_is_504(serve, gateway):
    url, _, (a,) = await _fleet(serve, gateway, "hang", proxy=ProxyConfig(request_timeout_s=0.2))
    status, body, _ = await _post(url, BODY)
    assert status == 504
    assert json.loads(body)["error"]["code"] == "upstream_timeout"
    await asyncio.wait_for(a.cancelled.wait(), 3)


async def test_answers_within_the_request_timeout_are_relayed_whole(serve, gateway):
    url, state, (a,) = await _fleet(serve, gateway, "ok", proxy=ProxyConfig(request_timeout_s=5.0))
    status, body, headers = await _post(url, BODY)
    assert (status, json.loads(body)["served_by"], headers["X-Kvgate-Worker"]) == (200, id(a), "a")
    assert headers["Content-Length"] == str(len(body)) and headers["Content-Type"].startswith("application/json")
    status, body, _ = await _post(url, STREAM)
    assert (status, body) == (200, b"".join(SSE_CHUNKS))
    assert state.num_in_flight == 0 and state.tracker.num_in_flight == 0


async def test_streams_over_a_keep_alive_connection_never_stall(serve, gateway):
    """Small SSE chunks 3 ms apart arrive 3 ms apart, request after request on one connection.

    A Nagle/delayed-ACK stall (no TCP_NODELAY on one side) shows up as ~40 ms gaps.
    """
    url, _, (a,) = await _fleet(serve, gateway, "spaced")
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as http:
        worst = 0.0
        for _ in range(5):
            async with http.post(url + "/v1/completions", json=STREAM) as response:
                last = time.perf_counter()
                received = b""
                async for chunk in response.content.iter_any():
                    now = time.perf_counter()
                    worst = max(worst, now - last)
                    last = now
                    received += chunk
                assert received == b"".join(SSE_CHUNKS)
    assert worst < 0.030, f"a chunk was held back {worst * 1000:.1f} ms"
