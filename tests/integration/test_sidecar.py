"""`kvgate sidecar` as a real process between a vLLM stand-in and a real `kvgate router`.

The engine stand-in is only what vLLM exposes: an OpenAI-ish HTTP server (`/health`,
`/v1/models`, `/v1/completions`), a Prometheus text `/metrics` with vLLM's metric
names, and KV events in vLLM's wire format with a replay socket (kvgate's own
`KVEventPublisher` speaks exactly that). The sidecar relays the events (`--relay`),
so every event the router indexes has gone engine -> sidecar -> router.
"""

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from indexer.events import BlockStored
from indexer.tokenizer import ByteTokenizer, prompt_ids
from worker.kv_publisher import KVEventPublisher

REPO_ROOT = Path(__file__).parents[2]
MODEL = "stand-in/llama"
BLOCK_SIZE = 16
# The byte tokenizer: one token per byte, plus BOS; 64 bytes are 4 full blocks, 32 bytes 2.
PROMPT_A = "The quick brown fox jumps over the lazy dog, then naps in the sun."[:64]
PROMPT_B = "Pack my box with five dozen liquor jugs, said the sphinx of black quartz."[:32]
PROMPT_C = "How vexingly quick daft zebras jump when the wizard quits the room!!"[:32]


class EngineStandIn:
    """A vLLM look-alike; `start()` again after `stop()` comes back on the same ports."""

    def __init__(self) -> None:
        self.num_running, self.num_waiting, self.kv_usage = 3, 5, 0.25
        self.http_port = 0
        self.events, self.replay = "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"
        self.publisher: KVEventPublisher | None = None
        self._runner: web.AppRunner | None = None
        self._next_hash = 1000

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    async def start(self) -> None:
        self.start_publisher()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.http_port)
        await site.start()
        self.http_port = self._runner.addresses[0][1]

    def start_publisher(self) -> None:
        self.publisher = KVEventPublisher(self.events, self.replay, topic="kv").start()
        self.events, self.replay = self.publisher.bound_endpoint, self.publisher.bound_replay_endpoint

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.stop_publisher()

    def stop_publisher(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def store(self, prompt: str, *, blocks_per_batch: int = 1) -> None:
        """Publishes the prompt's full blocks as cached, `blocks_per_batch` per message."""
        # As the engine sees it (BOS first), full blocks only, as vLLM caches them.
        token_ids = list(prompt_ids(ByteTokenizer(), prompt))
        token_ids = token_ids[:len(token_ids) - len(token_ids) % BLOCK_SIZE]
        parent = None
        step = blocks_per_batch * BLOCK_SIZE
        for start in range(0, len(token_ids), step):
            chunk = token_ids[start:start + step]
            hashes = list(range(self._next_hash, self._next_hash + len(chunk) // BLOCK_SIZE))
            self._next_hash += len(hashes)
            assert self.publisher is not None
            self.publisher.publish([BlockStored(hashes, parent, chunk, BLOCK_SIZE)])
            parent = hashes[-1]

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm"}]})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({
            "id": "cmpl-0", "object": "text_completion", "model": body.get("model", MODEL),
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
        })

    async def _metrics(self, request: web.Request) -> web.Response:
        labels = f'engine="0",model_name="{MODEL}"'
        text = "\n".join([
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {self.num_running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {self.num_waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {self.kv_usage}",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",engine="0",num_gpu_blocks="2000"}} 1.0',
        ]) + "\n"
        return web.Response(text=text, content_type="text/plain")


class Process:
    """A `python -m router.cli ...` child with its JSON ready line read."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc = proc
        self.log = log
        self.ready: dict = {}

    @classmethod
    async def start(cls, log: Path, *argv: str) -> "Process":
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        env["PYTHONPATH"] = str(REPO_ROOT)
        with open(log, "wb") as stderr:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router.cli", *argv,
                stdout=asyncio.subprocess.PIPE, stderr=stderr, env=env, cwd=REPO_ROOT,
            )
        child = cls(proc, log)
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 20)
            child.ready = json.loads(line)
        except (TimeoutError, ValueError):
            await child.stop()
            raise AssertionError(f"{argv[0]} did not start: {log.read_text()}") from None
        return child

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        return self.proc.returncode


async def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture
async def fleet(tmp_path):
    """An engine stand-in, a real router and a session; the sidecar is started by each test."""
    engine = EngineStandIn()
    await engine.start()
    router = await Process.start(
        tmp_path / "router.log", "router", "--port", "0", "--log-level", "WARNING",
        "--health-interval", "0.1", "--health-timeout", "0.5", "--block-size", str(BLOCK_SIZE),
    )
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
    started: list[Process] = []

    async def start_sidecar() -> Process:
        sidecar = await Process.start(
            tmp_path / "sidecar.log", "sidecar", "--engine-url", engine.url, "--events", engine.events,
            "--replay", engine.replay, "--router", router.ready["url"], "--worker-id", "eng0", "--relay",
            "--relay-endpoint", "tcp://127.0.0.1:*", "--relay-replay-endpoint", "tcp://127.0.0.1:*",
            "--load-endpoint", "tcp://127.0.0.1:*", "--port", "0", "--health-interval", "0.1",
            "--deregister-after", "0.5", "--heartbeat-interval", "0.5",
        )
        started.append(sidecar)
        return sidecar

    try:
        yield engine, router, session, start_sidecar
    finally:
        for child in started:
            await child.stop(signal.SIGKILL)
        await router.stop()
        await session.close()
        await engine.stop()


async def get(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as response:
        return await response.json()


async def workers(session, router) -> dict[str, dict]:
    body = await get(session, f"{router.ready['url']}/admin/workers")
    return {worker["worker_id"]: worker for worker in body["workers"]}


async def matched(session, router, prompt: str) -> int | None:
    """eng0's matched blocks for `prompt` in a dry run, None while it is no candidate."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with session.post(f"{router.ready['url']}/admin/route", json=body) as response:
        if response.status != 200:
            return None
        answer = await response.json()
    return next((c["matched_blocks"] for c in answer["candidates"] if c["worker_id"] == "eng0"), None)


async def test_registers_relays_events_reports_load_and_deregisters_on_sigterm(fleet):
    engine, router, session, start_sidecar = fleet
    engine.store(PROMPT_A[:32])  # history from before the sidecar: reaches the router by replay
    sidecar = await start_sidecar()

    async def registered() -> bool:
        return "eng0" in await workers(session, router)

    await wait_until(registered, what="registration")
    worker = (await workers(session, router))["eng0"]
    assert {key: worker[key] for key in ("url", "model", "role", "block_size")} == {
        "url": engine.url, "model": MODEL, "role": "both", "block_size": BLOCK_SIZE,
    }
    assert worker["events_endpoint"] == sidecar.ready["events_endpoint"] != engine.events
    assert worker["replay_endpoint"] == sidecar.ready["replay_endpoint"] != engine.replay
    assert worker["load_endpoint"] == sidecar.ready["load_endpoint"]

    async def history_indexed() -> bool:
        return await matched(session, router, PROMPT_A) == 2

    await wait_until(history_indexed, what="the replayed history in the index")
    engine.store(PROMPT_A)  # live now: all four blocks (the first two again, as vLLM would not)

    async def live_indexed() -> bool:
        return await matched(session, router, PROMPT_A) == 4

    await wait_until(live_indexed, what="live events in the index")

    async def load_shown() -> bool:
        load = (await get(session, f"{router.ready['url']}/admin/stats"))["workers"]["eng0"]["load"]
        return load is not None and load["num_running"] == 3
    await wait_until(load_shown, what="the scraped load in /admin/stats")
    load = (await get(session, f"{router.ready['url']}/admin/stats"))["workers"]["eng0"]["load"]
    assert (load["num_running"], load["num_waiting"], load["kv_usage"], load["num_kv_blocks_total"]) == (3, 5, 0.25, 2000)
    engine.num_waiting = 9

    async def load_follows() -> bool:
        stats = await get(session, f"{router.ready['url']}/admin/stats")
        return stats["workers"]["eng0"]["load"]["num_waiting"] == 9
    await wait_until(load_follows, timeout_s=3, what="a changed metric in /admin/stats")

    status = await get(session, f"{sidecar.ready['url']}/health")
    assert (status["state"], status["registered"], status["model"], status["block_size"]) == (
        "healthy", True, MODEL, BLOCK_SIZE)
    assert await sidecar.stop(signal.SIGTERM) == 0
    assert "eng0" not in await workers(session, router)


async def test_engine_restart_resyncs_and_engine_death_deregisters_until_it_returns(fleet):
    engine, router, session, start_sidecar = fleet
    sidecar = await start_sidecar()
    engine.store(PROMPT_A)  # four batches, seq 0..3

    async def a_indexed() -> bool:
        return await matched(session, router, PROMPT_A) == 4
    await wait_until(a_indexed, what="the first engine's blocks")

    # The engine's publisher restarts: its seq goes back to 0.
    engine.stop_publisher()
    engine.start_publisher()
    await asyncio.sleep(0.3)  # the relay's SUB reconnects (every 100 ms)
    engine.store(PROMPT_B)  # seq 0..1

    async def resynced() -> bool:
        return await matched(session, router, PROMPT_A) == 0 and await matched(session, router, PROMPT_B) == 2
    await wait_until(resynced, what="the index to drop the old engine's blocks and hold the new ones")
    assert (await get(session, f"{sidecar.ready['url']}/health"))["relay"]["num_restarts"] == 1

    # The engine dies: unhealthy, then deregistered after --deregister-after.
    await engine.stop()

    async def deregistered() -> bool:
        return "eng0" not in await workers(session, router)
    await wait_until(deregistered, what="deregistration of the dead engine")
    async with session.get(f"{sidecar.ready['url']}/health") as response:
        assert (response.status, (await response.json())["state"]) == (503, "down")

    # It comes back (a fresh process: seq from 0 again): registered again, indexed afresh.
    await engine.start()
    engine.store(PROMPT_C)

    async def back() -> bool:
        return "eng0" in await workers(session, router) and await matched(session, router, PROMPT_C) == 2
    await wait_until(back, what="re-registration with the new engine's blocks")
    assert await matched(session, router, PROMPT_B) == 0
    assert await sidecar.stop(signal.SIGINT) == 0
