"""GatewayRunner: the two OpenAI POST routes skip the app layer, everything else goes through it."""

import aiohttp
from aiohttp import web

from router.app import build_app
from router.gateway import GATEWAY, GatewayConfig
from router.health import HealthConfig
from router.runner import GatewayRunner
from router.worker_spec import WorkerSpec

FAST = HealthConfig(interval_s=0.05, timeout_s=0.5, fail_threshold=1, pass_threshold=1)


def _backend() -> web.Application:
    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"object": "text_completion", "prompt_token_ids": body["prompt_token_ids"]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_get("/health", health)
    return app


async def test_direct_routes_and_app_routes(serve, wait_until):
    spec = WorkerSpec(worker_id="w", url=await serve(_backend()), model="m")
    app = build_app(GatewayConfig(workers=(spec,), health=FAST))
    runner = GatewayRunner(app, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        await wait_until(lambda: len(app[GATEWAY].registry.eligible()) == 1)
        dispatcher = runner.server.request_handler
        through_app: list[str] = []
        app_handler = dispatcher._app_handler

        async def counting(request: web.Request) -> web.StreamResponse:
            through_app.append(f"{request.method} {request.path}")
            return await app_handler(request)

        dispatcher._app_handler = counting
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as http:
            for path, body, status in [
                ("/v1/completions", {"model": "m", "prompt": "ab"}, 200),
                ("/v1/completions?trace=1", {"model": "m", "prompt": "ab"}, 200),
                ("/v1/chat/completions", chat, 200),
                ("/v1/completions", {"model": "m", "prompt": 7}, 400),
                ("/v1/completions", {"model": "other", "prompt": "x"}, 404),
            ]:
                async with http.post(url + path, json=body) as response:
                    answer = await response.json()
                    assert response.status == status, answer
                    assert ("error" in answer) is (status != 200)
            assert through_app == []
            async with http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "ab"}, expect100=True) as r:
                assert r.status == 200 and (await r.json())["prompt_token_ids"] == [256, 97, 98]
            for method, path, status in [("GET", "/v1/completions", 405), ("POST", "/v1/completions/", 404),
                                         ("GET", "/health", 200), ("GET", "/admin/workers", 200)]:
                async with http.request(method, url + path) as response:
                    assert response.status == status, path
                    assert response.headers["Content-Type"].startswith("application/json")
        assert through_app == ["POST /v1/completions", "GET /v1/completions", "POST /v1/completions/",
                               "GET /health", "GET /admin/workers"]
        metrics = app[GATEWAY].metrics
        assert metrics.route("/v1/completions").by_status == {200: 3, 400: 1, 404: 1}
        assert metrics.route("/v1/chat/completions").by_status == {200: 1}
    finally:
        await runner.cleanup()
