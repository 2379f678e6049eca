"""The gateway app over real in-process sim workers: answers, errors, limits, probes, metrics."""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from router.requests import RequestLimits

PROMPT = "a long shared system prompt that spans many KV blocks of four tokens each, "


def _error(body: dict) -> dict:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


async def test_completion_and_chat_stream_and_not(gateway, sim_worker):
    spec = await sim_worker("s0")
    url, state = await gateway(spec)
    async with aiohttp.ClientSession() as http:
        body = {"model": "sim", "prompt": PROMPT, "max_tokens": 4}
        async with http.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200
            assert response.headers["X-Kvgate-Worker"] == "s0"
            answer = await response.json()
        assert answer["object"] == "text_completion"
        assert answer["usage"]["prompt_tokens"] == len(PROMPT) + 1  # BOS + bytes
        assert answer["usage"]["completion_tokens"] == 4
        chat = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}
        async with http.post(f"{url}/v1/chat/completions", json=chat) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            text = (await response.read()).decode()
        events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    worker = state.registry.get("s0")
    assert (worker.num_requests, worker.num_in_flight, worker.num_failures) == (2, 0, 0)
    assert state.num_in_flight == 0 and state.tracker.num_in_flight == 0


async def test_models_are_aggregated_over_healthy_workers(gateway, sim_worker, serve):
    a, b, c = await sim_worker("a"), await sim_worker("b"), await sim_worker("c", model="other")
    dead = type(a)(worker_id="d", url="http://127.0.0.1:9", model="ghost")
    url, state = await gateway(a, b, c, dead, wait_healthy=False)
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            if len(state.registry.eligible()) == 3 and state.registry.get("d").health.status == "unhealthy":
                break
            await asyncio.sleep(0.01)
        async with http.get(f"{url}/v1/models") as response:
            listed = await response.json()
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == ["other", "sim"]
    assert {m["owned_by"] for m in listed["data"]} == {"kvgate"}


async def test_probes_and_metrics(gateway, sim_worker, warm_up, wait_until):
    url, state = await gateway(wait_healthy=False)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/health") as response:
            assert (response.status, await response.json()) == (
                200, {"status": "ok", "prefill_queue": {"configured": False, "available": False}}
            )
        async with http.get(f"{url}/ready") as response:
            assert response.status == 503
            assert _error(await response.json())["code"] == "no_eligible_worker"
        spec = await sim_worker("s0")
        await state.registry.add(spec)
        for _ in range(300):
            if state.registry.eligible():
                break
            await asyncio.sleep(0.01)
        async with http.get(f"{url}/ready") as response:
            assert (response.status, await response.json()) == (200, {"status": "ready", "num_eligible_workers": 1})
        await warm_up(state, spec)
        blocks = (len(PROMPT) + 1) // 4
        num_indexed = state.registry.num_index_blocks("s0")
        for _ in range(2):
            async with http.post(f"{url}/v1/completions", json={"model": "sim", "prompt": PROMPT, "max_tokens": 1}) as r:
                assert r.status == 200
            await wait_until(lambda: state.registry.num_index_blocks("s0") >= num_indexed + blocks)
        async with http.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}) as response:
            assert response.status == 404
        async with http.get(f"{url}/metrics") as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            text = await response.text()
    for line in [
        'kvgate_requests_total{route="/v1/completions",status="200"} 2.0',
        'kvgate_requests_total{route="/v1/completions",status="404"} 1.0',
        'kvgate_routing_decisions_total{policy="kv",worker="s0"} 2.0',
        f"kvgate_prefix_prompt_blocks_total {float(2 * blocks)}",
        f"kvgate_prefix_matched_blocks_total {float(blocks)}",
        "kvgate_prefix_hit_rate 0.5",
        'kvgate_worker_healthy{worker="s0"} 1.0',
        "kvgate_in_flight_requests 0.0",
        "kvgate_router_overhead_seconds_count 2.0",
    ]:
        assert line in text, line
    for name in ("kvgate_ttft_seconds", "kvgate_kv_events_applied_total", "kvgate_kv_event_gaps_total",
                 "kvgate_kv_event_replays_total", "kvgate_kv_event_resyncs_total", "kvgate_kv_events_malformed_total",
                 'kvgate_index_blocks{block_size="4"}'):
        assert name in text, name


async def test_error_statuses_are_openai_json(gateway, sim_worker):
    spec = await sim_worker("s0")
    limits = RequestLimits(max_body_bytes=4096, max_prompt_tokens=64)
    url, _ = await gateway(spec, limits=limits)
    cases = [
        ("POST", "/v1/completions", b'{"model": "sim", "prompt": ', 400, "invalid_request_error"),
        ("POST", "/v1/completions", b'{"model": "sim", "prompt": "x", "max_tokens": -1}', 400, "invalid_request_error"),
        ("POST", "/v1/chat/completions", b'{"model": "sim", "messages": []}', 400, "invalid_request_error"),
        ("POST", "/v1/completions", b'{"model": "gpt-9", "prompt": "x"}', 404, "not_found_error"),
        ("POST", "/v1/completions", json.dumps({"model": "sim", "prompt": "x" * 100}).encode(), 413, "invalid_request_error"),
        ("POST", "/v1/completions", b" " * 5000, 413, "invalid_request_error"),
        ("GET", "/v1/completions", b"", 405, "invalid_request_error"),
        ("GET", "/v1/nothing", b"", 404, "not_found_error"),
        ("GET", "/admin/nothing", b"", 404, "not_found_error"),
    ]
    async with aiohttp.ClientSession() as http:
        for method, path, data, status, error_type in cases:
            async with http.request(method, f"{url}{path}", data=data,
                                    headers={"Content-Type": "application/json"}) as response:
                assert response.status == status, (path, data[:40], await response.text())
                assert response.headers["Content-Type"].startswith("application/json")
                assert _error(await response.json())["type"] == error_type

        async def chunks():
            for _ in range(10):
                yield b" " * 1000

        async with http.post(f"{url}/v1/completions", data=chunks()) as response:  # chunked, no Content-Length
            assert response.status == 413


async def test_no_eligible_worker_is_503(gateway, sim_worker):
    spec = await sim_worker("s0")
    url, state = await gateway(spec)
    state.registry.drain("s0")
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", json={"model": "sim", "prompt": "x"}) as response:
            assert response.status == 503
            error = _error(await response.json())
    assert error["code"] == "no_eligible_worker" and "sim" in error["message"]


async def test_admission_limit_is_429(gateway, serve):
    release = asyncio.Event()
    arrived = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        arrived.set()
        await release.wait()
        return web.json_response({"ok": True})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", slow)
    app.router.add_get("/health", health)
    backend = await serve(app)
    from router.worker_spec import WorkerSpec

    url, state = await gateway(WorkerSpec(worker_id="slow", url=backend, model="m"), max_concurrent_requests=1)
    async with aiohttp.ClientSession() as http:
        first = asyncio.create_task(http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}))
        await asyncio.wait_for(arrived.wait(), 3)
        async with http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"}) as response:
            assert response.status == 429
            assert _error(await response.json())["code"] == "rate_limit_exceeded"
        release.set()
        async with await first as response:
            assert response.status == 200
    assert state.num_in_flight == 0


async def test_api_keys_guard_v1_only(gateway, sim_worker):
    spec = await sim_worker("s0")
    url, _ = await gateway(spec, api_keys=("k1", "k2"))
    body = {"model": "sim", "prompt": "x", "max_tokens": 1}
    async with aiohttp.ClientSession() as http:
        for headers, status in [({}, 401), ({"Authorization": "Bearer nope"}, 401), ({"Authorization": "k1"}, 401),
                                ({"Authorization": "Bearer k2"}, 200)]:
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as response:
                assert response.status == status
                if status == 401:
                    assert _error(await response.json())["type"] == "authentication_error"
                    assert response.headers["WWW-Authenticate"] == "Bearer"
        async with http.get(f"{url}/v1/models") as response:
            assert response.status == 401
        async with http.get(f"{url}/health") as response:
            assert response.status == 200


@pytest.mark.parametrize("forward", [True, False])
async def test_prompt_token_ids_forwarding_can_be_switched_off(gateway, serve, forward):
    seen: list[dict] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"ok": True})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    from router.worker_spec import WorkerSpec

    url, _ = await gateway(WorkerSpec(worker_id="e", url=await serve(app), model="m"), forward_token_ids=forward)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "ab"}) as response:
            assert response.status == 200
    expected = {"model": "m", "prompt": "ab"}
    if forward:
        expected["prompt_token_ids"] = [256, 97, 98]
    assert seen == [expected]
