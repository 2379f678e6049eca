"""The router's prefill decisions end to end: real router app, real HTTP workers, real queues.

Fake workers are real aiohttp servers on 127.0.0.1 that keep every body they are
sent; the one that caches publishes real KV events over ZMQ. Queues are a
`MemoryPrefillQueue`, a `RedisPrefillQueue` on $KVGATE_REDIS_URL under a key prefix
of its own (deleted afterwards; the test fails if Redis does not answer), and a
`redis-server` the test starts on a free port, kills and restarts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as redis
from aiohttp import web

from indexer.events import BlockStored
from indexer.tokenizer import load_tokenizer, prompt_ids
from kvstore.memory_queue import MemoryPrefillQueue
from kvstore.prefill_job import PrefillJob
from kvstore.prefill_queue import PrefillQueue, QueueConfig
from kvstore.queue_server import QueueServer
from kvstore.redis_queue import RedisPrefillQueue
from router.app import build_app
from router.disagg import DisaggConfig
from router.gateway import GATEWAY, Gateway, GatewayConfig
from router.health import HealthConfig
from router.runner import GatewayRunner
from router.worker_spec import WorkerSpec
from worker.kv_publisher import KVEventPublisher

REDIS_URL = os.environ.get("KVGATE_REDIS_URL", "redis://127.0.0.1:6379")
MODEL = "m"
BLOCK = 16
LONG = "L" * 700  # 701 tokens with BOS: over the default 512
SHORT = "short prompt"  # 13 tokens
FAST_HEALTH = HealthConfig(interval_s=0.05, timeout_s=0.5, fail_threshold=1, pass_threshold=1)
REMOTE_FRESH = {"do_remote_prefill": True, "num_cached_tokens": 0}
LOCAL = {"do_remote_prefill": False}


class FakeWorker:
    """A worker's HTTP API that records each body; optionally publishes KV events."""

    def __init__(self, worker_id: str, role: str, *, num_failures: int = 0, publishes: bool = False) -> None:
        self.worker_id = worker_id
        self.role = role
        self.num_failures = num_failures  # the first requests get a 503
        self.bodies: list[bytes] = []
        self.publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").start() if publishes else None
        self.runner: web.AppRunner | None = None
        self.spec: WorkerSpec | None = None

    @property
    def requests(self) -> list[dict]:
        return [json.loads(body) for body in self.bodies]

    async def start(self) -> WorkerSpec:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/health", _health)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        publisher = self.publisher
        self.spec = WorkerSpec(
            worker_id=self.worker_id, url=f"http://127.0.0.1:{self.runner.addresses[0][1]}", model=MODEL,
            role=self.role, block_size=BLOCK,
            events_endpoint=publisher.bound_endpoint if publisher else None,
            replay_endpoint=publisher.bound_replay_endpoint if publisher else None,
        )
        return self.spec

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.publisher is not None:
            self.publisher.close()

    def publish_cached(self, token_ids: list[int]) -> None:
        """BlockStored for the full blocks of `token_ids`, with this worker's own hashes."""
        assert self.publisher is not None
        num_blocks = len(token_ids) // BLOCK
        hashes = [int.from_bytes(hashlib.blake2b(repr(token_ids[: (i + 1) * BLOCK]).encode(), digest_size=8).digest())
                  >> 1 for i in range(num_blocks)]
        self.publisher.publish([BlockStored(hashes, None, token_ids[: num_blocks * BLOCK], BLOCK)])

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.bodies.append(raw)
        if self.num_failures:
            self.num_failures -= 1
            return web.json_response({"error": {"message": "busy"}}, status=503)
        body = json.loads(raw)
        answer = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
                  "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
        if not body.get("stream"):
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps(answer).encode() + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


class Router:
    def __init__(self, url: str, gateway: Gateway, runner: web.AppRunner, http: aiohttp.ClientSession) -> None:
        self.url = url
        self.gateway = gateway
        self.runner = runner
        self.http = http

    async def complete(self, prompt: str, **extra) -> tuple[int, dict, str]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
        async with self.http.post(f"{self.url}/v1/completions", json=body) as response:
            return response.status, dict(response.headers), await response.text()

    async def prefill_header(self, prompt: str, **extra) -> str | None:
        status, headers, text = await self.complete(prompt, **extra)
        assert status == 200, text
        return headers.get("X-Kvgate-Prefill")

    async def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        async with self.http.request(method, f"{self.url}{path}", json=body) as response:
            return response.status, await response.json()

    async def metrics(self) -> dict[str, float]:
        async with self.http.get(f"{self.url}/metrics") as response:
            text = await response.text()
        return {name: float(value) for name, _, value in
                (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))}


async def wait_until(predicate, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.01)


def decision(name: str, reason: str) -> str:
    return f'kvgate_disagg_decisions_total{{decision="{name}",reason="{reason}"}}'


@pytest.fixture
async def fleet():
    """`fleet.worker(...)`, `fleet.router(...)`: started here, all closed when the test ends."""

    class Fleet:
        def __init__(self) -> None:
            self.workers: list[FakeWorker] = []
            self.routers: list[Router] = []

        async def worker(self, worker_id: str, role: str, **options) -> FakeWorker:
            worker = FakeWorker(worker_id, role, **options)
            self.workers.append(worker)
            await worker.start()
            return worker

        async def router(
            self, *workers: FakeWorker, queue: PrefillQueue | None = None, wait_polled: bool = True, **disagg
        ) -> Router:
            disagg.setdefault("poll_interval_s", 0.02)
            config = GatewayConfig(
                workers=tuple(w.spec for w in workers), health=FAST_HEALTH, disagg=DisaggConfig(**disagg),
            )
            app = build_app(config, prefill_queue=queue)
            runner = GatewayRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            router = Router(f"http://127.0.0.1:{runner.addresses[0][1]}", app[GATEWAY], runner, aiohttp.ClientSession())
            self.routers.append(router)
            registry = router.gateway.registry
            await wait_until(lambda: len(registry.eligible()) == len(workers), "workers in rotation")
            if wait_polled and router.gateway.disagg.is_enabled and any(w.role == "prefill" for w in workers):
                await wait_until(lambda: router.gateway.disagg.queue_depth(MODEL) is not None, "a polled depth")
            return router

        async def close(self) -> None:
            for router in self.routers:
                await router.http.close()
                await router.runner.cleanup()
            for worker in self.workers:
                await worker.close()

    fleet = Fleet()
    yield fleet
    await fleet.close()


@pytest.fixture
async def memory_queue():
    queue = MemoryPrefillQueue(QueueConfig())
    await queue.start()
    yield queue
    await queue.close()


@pytest.fixture(params=["memory", "redis"])
async def any_queue(request):
    prefix = f"kvgate-test-{uuid.uuid4().hex}"
    config = QueueConfig(key_prefix=prefix)
    queue = MemoryPrefillQueue(config) if request.param == "memory" else RedisPrefillQueue(REDIS_URL, config)
    await queue.start()
    assert queue.is_available, f"no Redis answers at {REDIS_URL} (set KVGATE_REDIS_URL)"
    yield queue
    await queue.close()
    if request.param == "redis":
        client = redis.Redis.from_url(REDIS_URL)
        try:
            keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


def make_job(request_id: str) -> PrefillJob:
    return PrefillJob(request_id=request_id, model=MODEL, token_ids=list(range(32)), block_ids=[1, 2],
                      decode_worker_id="d0", transfer_endpoint="tcp://127.0.0.1:1", deadline=time.time() + 60)


# -- decisions on the wire ------------------------------------------------------------------


async def test_long_prompts_go_remote_short_ones_local_and_prefill_workers_get_no_requests(memory_queue, fleet):
    decode, prefill = await fleet.worker("d0", "decode"), await fleet.worker("p0", "prefill")
    router = await fleet.router(decode, prefill, queue=memory_queue)
    assert await router.prefill_header(LONG) == "remote"
    assert await router.prefill_header(SHORT) == "local"
    assert await router.prefill_header(LONG, stream=True) == "remote"  # the relayed stream's head too
    chat = {"model": MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 2}
    async with router.http.post(f"{router.url}/v1/chat/completions", json=chat) as response:
        assert (response.status, response.headers["X-Kvgate-Prefill"]) == (200, "remote")
    # A client's own kv_transfer_params never reach the worker while the router decides.
    assert await router.prefill_header(SHORT, kv_transfer_params={"do_remote_prefill": True, "x": 1}) == "local"
    params = [body["kv_transfer_params"] for body in decode.requests]
    assert params == [REMOTE_FRESH, LOCAL, REMOTE_FRESH, REMOTE_FRESH, LOCAL]
    assert decode.requests[3]["messages"] == chat["messages"]
    assert prefill.bodies == []
    metrics = await router.metrics()
    assert metrics[decision("remote", "long_prompt")] == 3.0
    assert metrics[decision("local", "short_prompt")] == 2.0
    assert metrics['kvgate_prefill_queue_depth{model="m"}'] == 0.0
    assert metrics["kvgate_prefill_queue_available"] == 1.0
    assert metrics["kvgate_prefill_queue_unavailable_total"] == 0.0
    status, health = await router.call("GET", "/health")
    assert (status, health) == (200, {"status": "ok", "prefill_queue": {"configured": True, "available": True}})


async def test_cached_tokens_on_the_worker_count_and_a_retry_decides_again(memory_queue, fleet):
    cached = await fleet.worker("d0", "decode", num_failures=1, publishes=True)
    both = await fleet.worker("b0", "both")
    prefill = await fleet.worker("p0", "prefill")
    router = await fleet.router(cached, both, prefill, queue=memory_queue)
    tokens = list(prompt_ids(load_tokenizer("byte"), "C" * 1200))  # 1201 tokens
    registry = router.gateway.registry
    while registry.num_index_blocks("d0") < 40:  # re-published until the subscriber has caught on
        cached.publish_cached(tokens[:640])
        await asyncio.sleep(0.05)
    dry = (await router.call("POST", "/admin/route", {"model": MODEL, "prompt": "C" * 1200}))[1]
    assert dry["worker_id"] == "d0"
    assert dry["disagg"] == {"prefill": "remote", "reason": "long_prompt", "uncached_tokens": 561, "queue_depth": 0}
    # d0 (40 blocks cached) answers 503 first; the retry on b0 (role both) prefills there.
    status, headers, _ = await router.complete("C" * 1200)
    assert (status, headers["X-Kvgate-Worker"], headers["X-Kvgate-Prefill"]) == (200, "b0", "local")
    assert cached.requests[0]["kv_transfer_params"] == {"do_remote_prefill": True, "num_cached_tokens": 640}
    assert both.requests[0]["kv_transfer_params"] == LOCAL
    # 1000 tokens with 640 cached: 360 uncached, under the limit.
    assert await router.prefill_header("C" * 999) == "local"
    assert cached.requests[1]["kv_transfer_params"] == LOCAL
    metrics = await router.metrics()
    assert metrics[decision("remote", "long_prompt")] == 1.0
    assert metrics[decision("local", "role")] == 1.0
    assert metrics[decision("local", "short_prompt")] == 1.0


async def test_admin_config_changes_the_outcome_at_runtime(memory_queue, fleet):
    decode, prefill = await fleet.worker("d0", "decode"), await fleet.worker("p0", "prefill")
    router = await fleet.router(decode, prefill, queue=memory_queue)
    status, config = await router.call("GET", "/admin/config")
    assert (status, config["disagg_active"], config["max_local_prefill_tokens"], config["max_prefill_queue_depth"]) == (
        200, True, 512, 32)
    assert await router.prefill_header(LONG) == "remote"
    status, config = await router.call("PATCH", "/admin/config", {"max_local_prefill_tokens": 701})
    assert (status, config["max_local_prefill_tokens"]) == (200, 701)
    assert await router.prefill_header(LONG) == "local"  # 701 uncached: not over 701
    await router.call("PATCH", "/admin/config", {"max_local_prefill_tokens": 700, "max_prefill_queue_depth": 0})
    assert await router.prefill_header(LONG) == "local"
    dry = (await router.call("POST", "/admin/route", {"model": MODEL, "prompt": LONG}))[1]
    assert dry["disagg"]["reason"] == "queue_full"
    await router.call("PATCH", "/admin/config", {"max_prefill_queue_depth": 1})
    # The first remote decision counts in the depth until a poll has seen the queue since.
    await wait_until(lambda: router.gateway.disagg.queue_depth(MODEL) == 0, "a poll after the remote decision")
    assert await router.prefill_header(LONG) == "remote"
    for bad in ({"max_local_prefill_tokens": -1}, {"max_local_prefill_tokens": "512"},
                {"max_prefill_queue_depth": 2.5}, {"max_prefill_queue_depth": True}):
        status, body = await router.call("PATCH", "/admin/config", bad)
        assert status == 400 and body["error"]["param"] == next(iter(bad)), body
        assert next(iter(bad)) in body["error"]["message"]
    config = (await router.call("GET", "/admin/config"))[1]
    assert (config["max_local_prefill_tokens"], config["max_prefill_queue_depth"]) == (700, 1)
    reasons = [body["kv_transfer_params"] for body in decode.requests]
    assert reasons == [REMOTE_FRESH, LOCAL, LOCAL, REMOTE_FRESH]


async def test_a_full_queue_keeps_prefill_local_until_it_drains(any_queue, fleet):
    decode, prefill = await fleet.worker("d0", "decode"), await fleet.worker("p0", "prefill")
    router = await fleet.router(decode, prefill, queue=any_queue, max_prefill_queue_depth=3)
    for i in range(3):
        assert await any_queue.enqueue(make_job(f"job-{i}"))
    disagg = router.gateway.disagg
    await wait_until(lambda: disagg.polled_depths() == {MODEL: 3}, "the depth of 3 polled")
    dry = (await router.call("POST", "/admin/route", {"model": MODEL, "prompt": LONG}))[1]
    assert dry["disagg"] == {"prefill": "local", "reason": "queue_full", "uncached_tokens": 701, "queue_depth": 3}
    assert await router.prefill_header(LONG) == "local"
    assert (await router.metrics())['kvgate_prefill_queue_depth{model="m"}'] == 3.0
    stats = (await router.call("GET", "/admin/stats"))[1]
    assert stats["prefill_queue"] == {"configured": True, "available": True, "depths": {"m": 3}}
    claimed = await any_queue.claim(MODEL, "p0", timeout_s=1.0)
    assert claimed is not None and await any_queue.ack(claimed)
    await wait_until(lambda: disagg.polled_depths() == {MODEL: 2}, "the depth of 2 polled")
    assert await router.prefill_header(LONG) == "remote"
    assert [body["kv_transfer_params"] for body in decode.requests] == [LOCAL, REMOTE_FRESH]
    metrics = await router.metrics()
    assert metrics[decision("local", "queue_full")] == 1.0 and metrics[decision("remote", "long_prompt")] == 1.0


async def test_remote_decisions_count_in_the_depth_before_the_next_poll(memory_queue, fleet):
    decode, prefill = await fleet.worker("d0", "decode"), await fleet.worker("p0", "prefill")
    # A poll interval far longer than the test: only the router's own count moves the depth.
    router = await fleet.router(decode, prefill, queue=memory_queue, max_prefill_queue_depth=2, poll_interval_s=60.0)
    headers = [await router.prefill_header(LONG) for _ in range(3)]
    assert headers == ["remote", "remote", "local"]
    assert (await router.metrics())[decision("local", "queue_full")] == 1.0


async def test_without_a_healthy_prefill_worker_prefill_stays_local(memory_queue, fleet):
    decode = await fleet.worker("d0", "decode")
    router = await fleet.router(decode, queue=memory_queue)
    assert (await router.call("GET", "/ready"))[1]["num_eligible_workers"] == 1
    assert await router.prefill_header(LONG) == "local"
    dry = (await router.call("POST", "/admin/route", {"model": MODEL, "prompt": LONG}))[1]
    assert dry["disagg"] == {"prefill": "local", "reason": "no_prefill_workers", "uncached_tokens": 701,
                             "queue_depth": None}
    prefill = await fleet.worker("p0", "prefill")
    status, _ = await router.call("POST", "/admin/workers", prefill.spec.to_dict())
    assert status == 201
    disagg, registry = router.gateway.disagg, router.gateway.registry
    await wait_until(lambda: registry.get("p0").is_eligible and disagg.queue_depth(MODEL) == 0, "p0 polled")
    assert (await router.call("GET", "/ready"))[1]["num_eligible_workers"] == 1  # p0 answers no client
    assert await router.prefill_header(LONG) == "remote"
    assert (await router.call("POST", "/admin/workers/p0/drain"))[0] == 200
    assert await router.prefill_header(LONG) == "local"
    await router.call("DELETE", "/admin/workers/p0")
    await wait_until(lambda: disagg.polled_depths() == {}, "the model's depth forgotten")
    assert await router.prefill_header(LONG) == "local"
    assert [body["kv_transfer_params"] for body in decode.requests] == [LOCAL, REMOTE_FRESH, LOCAL, LOCAL]
    assert (await router.metrics())[decision("local", "no_prefill_workers")] == 3.0
    assert prefill.bodies == []


async def test_the_dry_run_changes_nothing(memory_queue, fleet):
    decode, prefill = await fleet.worker("d0", "decode"), await fleet.worker("p0", "prefill")
    router = await fleet.router(decode, prefill, queue=memory_queue, max_prefill_queue_depth=1, poll_interval_s=60.0)
    for _ in range(3):
        dry = (await router.call("POST", "/admin/route", {"model": MODEL, "prompt": LONG}))[1]
        assert dry["disagg"] == {"prefill": "remote", "reason": "long_prompt", "uncached_tokens": 701, "queue_depth": 0}
    assert decode.bodies == [] and router.gateway.disagg.queue_depth(MODEL) == 0
    assert not any(name.startswith("kvgate_disagg_decisions_total") for name in await router.metrics())


async def test_without_disaggregation_bodies_pass_through_byte_identical(fleet):
    decode, prefill = await fleet.worker("d0", "decode"), await fleet.worker("p0", "prefill")
    config = GatewayConfig(workers=(decode.spec, prefill.spec), health=FAST_HEALTH, forward_token_ids=False)
    app = build_app(config)
    runner = GatewayRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    raw = b'{"model": "m", "prompt": "' + b"L" * 700 + b'", "kv_transfer_params": {"do_remote_prefill": true}}  '
    try:
        await wait_until(lambda: len(app[GATEWAY].registry.eligible()) == 2, "workers in rotation")
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/completions", data=raw,
                                 headers={"Content-Type": "application/json"}) as response:
                assert response.status == 200 and "X-Kvgate-Prefill" not in response.headers
            async with http.get(f"{url}/health") as response:
                status, health = response.status, await response.json()
            async with http.get(f"{url}/admin/config") as response:
                config_view = await response.json()
        assert decode.bodies == [raw]
        assert (status, health["prefill_queue"]) == (200, {"configured": False, "available": False})
        assert config_view["disagg_active"] is False
    finally:
        await runner.cleanup()


async def test_the_app_closes_the_queue_it_opened_never_an_injected_one(any_queue, tmp_path):
    injected = build_app(GatewayConfig(disagg=DisaggConfig(poll_interval_s=0.02)), prefill_queue=any_queue)
    runner = web.AppRunner(injected)
    await runner.setup()
    assert injected[GATEWAY].prefill_monitor.queue is any_queue
    await runner.cleanup()
    assert any_queue.is_available
    own = build_app(GatewayConfig(disagg=DisaggConfig(prefill_queue_url=REDIS_URL, poll_interval_s=0.02)))
    runner = web.AppRunner(own)
    await runner.setup()
    queue = own[GATEWAY].prefill_monitor.queue
    assert isinstance(queue, RedisPrefillQueue) and queue.is_available
    await runner.cleanup()
    assert not queue.is_available
    with pytest.raises(ValueError, match="prefill_queue_url"):
        build_app(GatewayConfig(disagg=DisaggConfig(prefill_queue_url=REDIS_URL)), prefill_queue=any_queue)


async def test_a_queue_served_over_http_is_polled_with_its_token(memory_queue, fleet):
    server = QueueServer(memory_queue, token="s3cret")
    url = await server.start()
    try:
        decode, prefill = await fleet.worker("d0", "decode"), await fleet.worker("p0", "prefill")
        router = await fleet.router(decode, prefill, prefill_queue_url=url, prefill_queue_token="s3cret",
                                    max_prefill_queue_depth=2)
        assert await router.prefill_header(LONG) == "remote"
        for i in range(2):
            assert await memory_queue.enqueue(make_job(f"job-{i}"))
        await wait_until(lambda: router.gateway.disagg.polled_depths() == {MODEL: 2}, "the depth of 2 polled")
        assert await router.prefill_header(LONG) == "local"
        wrong = await fleet.router(decode, prefill, prefill_queue_url=url, prefill_queue_token="nope",
                                   wait_polled=False)
        await wait_until(lambda: not wrong.gateway.prefill_monitor.is_available, "the refusal noticed")
        status, health = await wrong.call("GET", "/health")
        assert (status, health["prefill_queue"]) == (200, {"configured": True, "available": False})
        assert await wrong.prefill_header(LONG) == "local"
        assert [body["kv_transfer_params"] for body in decode.requests] == [REMOTE_FRESH, LOCAL, LOCAL]
        assert (await wrong.metrics())[decision("local", "queue_unavailable")] == 1.0
    finally:
        await server.stop()


# -- a Redis of our own, killed and restarted ------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_redis(port: int, data_dir: Path) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed"
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(data_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 5.0
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2) as conn:
                conn.sendall(b"*1\r\n$4\r\nPING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        assert proc.poll() is None, f"redis-server exited with {proc.returncode}"
        assert time.monotonic() < deadline, "redis-server did not answer within 5 s"
        time.sleep(0.01)


@pytest.fixture
def redis_procs():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


async def test_redis_killed_then_restarted_prefill_falls_back_then_goes_remote_again(fleet, redis_procs, tmp_path):
    port = free_port()
    redis_procs.append(start_redis(port, tmp_path))
    decode, prefill = await fleet.worker("d0", "decode"), await fleet.worker("p0", "prefill")
    router = await fleet.router(decode, prefill, prefill_queue_url=f"redis://127.0.0.1:{port}")
    monitor = router.gateway.prefill_monitor
    assert await router.prefill_header(LONG) == "remote"

    redis_procs[0].kill()
    redis_procs[0].wait(5)
    await wait_until(lambda: not monitor.is_available, "the outage noticed")
    for prompt in (LONG, SHORT, LONG):
        assert await router.prefill_header(prompt) == "local"
    dry = (await router.call("POST", "/admin/route", {"model": MODEL, "prompt": LONG}))[1]
    assert dry["disagg"] == {"prefill": "local", "reason": "queue_unavailable", "uncached_tokens": 701,
                             "queue_depth": None}
    status, health = await router.call("GET", "/health")
    assert (status, health["prefill_queue"]) == (200, {"configured": True, "available": False})
    metrics = await router.metrics()
    assert metrics["kvgate_prefill_queue_available"] == 0.0
    assert metrics["kvgate_prefill_queue_unavailable_total"] == 1.0
    assert metrics[decision("local", "queue_unavailable")] == 3.0
    assert 'kvgate_prefill_queue_depth{model="m"}' not in metrics

    redis_procs.append(start_redis(port, tmp_path))
    await wait_until(lambda: monitor.is_available and router.gateway.disagg.queue_depth(MODEL) is not None,
                     "the queue back", timeout_s=15.0)
    assert await router.prefill_header(LONG) == "remote"
    status, health = await router.call("GET", "/health")
    assert (status, health["prefill_queue"]) == (200, {"configured": True, "available": True})
    assert (await router.metrics())["kvgate_prefill_queue_available"] == 1.0
    params = [body["kv_transfer_params"] for body in decode.requests]
    assert params == [REMOTE_FRESH, LOCAL, LOCAL, LOCAL, REMOTE_FRESH]
