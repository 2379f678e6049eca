"""`kvgate worker --engine sim` as a real process, driven over real HTTP, ZMQ and signals.

The main test starts the worker with every port left to the OS, reads its ready line,
and checks completions and chat (JSON and SSE) against the engine's deterministic
output, prefix-cache hits in `usage`, its KV events in a real `PrefixIndex`, its load
reports, its errors, aborts on client disconnect, registration with a stand-in router
(an aiohttp app recording the admin calls) and a clean exit on SIGTERM.
The last tests run the server in-process: two workers side by side, and bad bodies.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from indexer.chat_template import render_and_encode
from indexer.hashing import hash_prompt
from indexer.index import PrefixIndex
from indexer.load import LoadAggregator, LoadSubscriber
from indexer.subscriber import EventSubscriber
from indexer.tokenizer import ByteTokenizer, prompt_ids
from worker.api import ServedModel
from worker.server import create_app, start_server
from worker.sim import LOREM, OutputScript, SimConfig, SimEngine

REPO_ROOT = Path(__file__).parents[2]
TOK = ByteTokenizer()
MODEL = "sim-it"
WORKER_ID = "sim-it-0"
BLOCK_SIZE = 16
NUM_BLOCKS = 512
TOKEN = "secret-token"
SHARED = "You are a careful assistant. " * 12  # 348 characters: 21 full blocks of shared prefix


def expected(token_ids, max_tokens: int, seed: int | None = None) -> str:
    """The text the sim engine answers with (ignore_eos): its script, decoded."""
    script = OutputScript(TOK.encode(LOREM).tolist(), list(token_ids), seed, TOK.eos_token_id)
    return TOK.decode([script.next_token() for _ in range(max_tokens)])


def shared_blocks(a, b) -> int:
    """Tokens of `b`'s prompt that the cache holds after `a`: common full blocks, one token recomputed."""
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(common // BLOCK_SIZE, (len(b) - 1) // BLOCK_SIZE) * BLOCK_SIZE


class RouterStandIn:
    """Records the admin API calls a worker makes: 201 on first registration, 200 after."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str | None, dict | None]] = []
        self.app = web.Application()
        self.app.router.add_post("/admin/workers", self._register)
        self.app.router.add_delete("/admin/workers/{worker_id}", self._deregister)

    async def _register(self, request: web.Request) -> web.Response:
        self.calls.append(("POST", request.path, request.headers.get("Authorization"), await request.json()))
        return web.json_response({}, status=200 if len(self.calls) > 1 else 201)

    async def _deregister(self, request: web.Request) -> web.Response:
        self.calls.append(("DELETE", request.path, request.headers.get("Authorization"), None))
        return web.Response(status=204)


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    """Polls `predicate` (plain or async) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not (await result if inspect.isawaitable(result := predicate()) else result):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def sse(response: aiohttp.ClientResponse) -> list:
    """The decoded `data:` payloads of a stream; `[DONE]` as the string."""
    events = []
    async for line in response.content:
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE).group(1))


@pytest.fixture
async def stand_in():
    router = RouterStandIn()
    runner = web.AppRunner(router.app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    router.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield router
    await runner.cleanup()


@pytest.fixture
async def worker(stand_in, tmp_path):
    stderr_path = tmp_path / "worker.stderr"
    with open(stderr_path, "w") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.cli", "worker", "--engine", "sim", "--host", "127.0.0.1", "--port", "0",
            "--model", MODEL, "--worker-id", WORKER_ID, "--block-size", str(BLOCK_SIZE),
            "--num-blocks", str(NUM_BLOCKS), "--events-endpoint", "tcp://127.0.0.1:0",
            "--replay-endpoint", "tcp://127.0.0.1:0", "--load-endpoint", "tcp://127.0.0.1:0",
            "--speedup", "100", "--max-body-bytes", "65536", "--router", stand_in.url,
            "--heartbeat-interval", "0.1",
            stdout=asyncio.subprocess.PIPE, stderr=stderr, cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVGATE_ROUTER_TOKEN": TOKEN},
        )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        assert line, f"the worker exited: {stderr_path.read_text()}"
        proc.ready = json.loads(line)
        proc.stderr_path = stderr_path
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_worker_process_end_to_end(worker, stand_in):
    ready = worker.ready
    assert ready["event"] == "ready" and (ready["worker_id"], ready["model"]) == (WORKER_ID, MODEL)
    assert ready["block_size"] == BLOCK_SIZE
    for key in ("events_endpoint", "replay_endpoint", "load_endpoint"):
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", ready[key]), ready
    url = ready["url"]
    index = PrefixIndex(BLOCK_SIZE, default_model=MODEL)
    subscriber = EventSubscriber(index, WORKER_ID, ready["events_endpoint"], ready["replay_endpoint"])
    aggregator = LoadAggregator()
    load_subscriber = LoadSubscriber(aggregator, ready["load_endpoint"])
    subscriber.start()
    load_subscriber.start()
    try:
        async with aiohttp.ClientSession() as session:
            await check_completions(session, url)
            await check_chat(session, url)
            await check_errors(session, url)
            await check_disconnects_abort(session, url)
            await check_models_health_metrics(session, url)
            await check_kv_events(session, url, index, subscriber)
        # Reports come every 0.1 s: one soon shows the worker idle.
        await wait_until(lambda: getattr(aggregator.get((WORKER_ID, 0)), "num_running", None) == 0)
        report = aggregator.get((WORKER_ID, 0))
        assert (report.num_kv_blocks_total, report.num_waiting, report.num_prefill_tokens) == (NUM_BLOCKS, 0, 0)
        assert report.num_kv_blocks_used == 0
    finally:
        await subscriber.stop()
        await load_subscriber.stop()
    await check_registration_and_sigterm(worker, stand_in)


async def check_completions(session: aiohttp.ClientSession, url: str) -> None:
    first_prompt, second_prompt = SHARED + "First question?", SHARED + "Second question!"
    body = {"model": MODEL, "prompt": first_prompt, "max_tokens": 24, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200
        answer = await response.json()
    first_ids = prompt_ids(TOK, first_prompt)
    assert answer["object"] == "text_completion" and answer["model"] == MODEL
    assert answer["choices"] == [
        {"index": 0, "text": expected(first_ids, 24), "logprobs": None, "finish_reason": "length"}
    ]
    assert answer["usage"] == {
        "prompt_tokens": len(first_ids), "completion_tokens": 24, "total_tokens": len(first_ids) + 24,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # Streamed, with usage: the same long prefix is now cached.
    second_ids = prompt_ids(TOK, second_prompt)
    body = {**body, "prompt": second_prompt, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
        events = await sse(response)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected(second_ids, 24)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"] == {
        "cached_tokens": shared_blocks(first_ids, second_ids)
    }
    assert shared_blocks(first_ids, second_ids) == 21 * BLOCK_SIZE
    # The router's token ids win over the prompt; a stop string ends the text before it.
    full = expected(second_ids, 40)
    stop = full[10:13]
    body = {"prompt": "ignored", "prompt_token_ids": list(second_ids), "max_tokens": 40, "stop": stop}
    body["ignore_eos"] = True
    async with session.post(f"{url}/v1/completions", json=body) as response:
        answer = await response.json()
    assert answer["choices"][0]["text"] == full[: full.index(stop)]
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["prompt_tokens"] == len(second_ids)


async def check_chat(session: aiohttp.ClientSession, url: str) -> None:
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "Hello!"}]
    body = {"model": MODEL, "messages": messages, "max_completion_tokens": 12, "ignore_eos": True}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        answer = await response.json()
    ids = render_and_encode(TOK, messages)
    assert answer["object"] == "chat.completion"
    assert answer["choices"] == [{
        "index": 0, "message": {"role": "assistant", "content": expected(ids, 12)},
        "logprobs": None, "finish_reason": "length",
    }]
    follow_up = [*messages, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More?"}]
    body = {"model": MODEL, "messages": follow_up, "max_tokens": 12, "ignore_eos": True, "stream": True}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        events = await sse(response)
    follow_ids = render_and_encode(TOK, follow_up)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"]["content"] for e in events[1:-1]) == expected(follow_ids, 12)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events[:-1])


async def check_errors(session: aiohttp.ClientSession, url: str) -> None:
    cases = [
        ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "x", "model": "other"}, 404, "model"),
        ({"prompt": "x" * (NUM_BLOCKS * BLOCK_SIZE)}, 400, "prompt"),
        ({"prompt": "x" * 70_000}, 413, None),
    ]
    for body, status, param in cases:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == status, body
            error = (await response.json())["error"]
            assert error["param"] == param and set(error) == {"message", "type", "param", "code"}
    for raw in (b'{"messages": [', b'{"\xff\xfe": 1}'):  # truncated; invalid UTF-8 in a key
        async with session.post(f"{url}/v1/chat/completions", data=raw) as response:
            assert response.status == 400
            assert (await response.json())["error"]["message"].startswith("the request body is not valid JSON")
    async with session.get(f"{url}/v1/completions") as response:
        assert response.status == 405 and (await response.json())["error"]["type"] == "invalid_request_error"


async def check_disconnects_abort(session: aiohttp.ClientSession, url: str) -> None:
    generated = await metric(session, url, "kvgate_worker_generation_tokens_total")
    long_body = {"prompt": "go on and on", "max_tokens": 6000, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json={**long_body, "stream": True}) as response:
        await response.content.readline()  # the first event: it runs
    # Leaving the block closed the connection mid-stream; a non-streaming one is cut by a timeout.
    with pytest.raises(TimeoutError):
        async with session.post(
            f"{url}/v1/completions", json=long_body, timeout=aiohttp.ClientTimeout(total=0.2)
        ) as response:
            await response.read()

    async def idle() -> bool:
        return await metric(session, url, "kvgate_worker_num_requests_running") == 0

    await wait_until(idle)
    assert await metric(session, url, "kvgate_worker_kv_cache_usage_ratio") == 0
    # Neither ran to its end: both were aborted, their blocks freed.
    assert await metric(session, url, "kvgate_worker_generation_tokens_total") - generated < 2 * 6000


async def check_models_health_metrics(session: aiohttp.ClientSession, url: str) -> None:
    async with session.get(f"{url}/v1/models") as response:
        models = await response.json()
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [
        (MODEL, "model", NUM_BLOCKS * BLOCK_SIZE)
    ]
    async with session.get(f"{url}/health") as response:
        assert response.status == 200 and await response.json() == {"status": "ok"}
    assert await metric(session, url, "kvgate_worker_prefix_cache_hit_rate") > 0
    assert await metric(session, url, 'kvgate_worker_requests_total{route="/v1/completions",status="200"}') >= 3
    assert await metric(session, url, 'kvgate_worker_requests_total{route="/v1/completions",status="413"}') == 1


async def check_kv_events(
    session: aiohttp.ClientSession, url: str, index: PrefixIndex, subscriber: EventSubscriber
) -> None:
    # ZMQ's slow joiner: request until the subscriber hears a live batch; replay fills in the rest.
    for i in range(300):
        if subscriber.stats.num_messages:
            break
        body = {"prompt": f"nudge {i:04d} " + "." * 32, "max_tokens": 1}
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200
        await asyncio.sleep(0.01)
    first_ids = prompt_ids(TOK, SHARED + "First question?")
    hashes = hash_prompt(first_ids, BLOCK_SIZE, MODEL)

    async def indexed() -> bool:
        return index.find_matches(hashes) == {(WORKER_ID, 0): len(first_ids) // BLOCK_SIZE}

    await wait_until(indexed)
    assert subscriber.stats.num_malformed == 0 and index.stats().num_unknown_parent == 0


async def check_registration_and_sigterm(worker, stand_in: RouterStandIn) -> None:
    ready = worker.ready
    registration = {
        "worker_id": WORKER_ID, "url": ready["url"], "role": "both", "model": MODEL,
        "events_endpoint": ready["events_endpoint"], "replay_endpoint": ready["replay_endpoint"],
        "load_endpoint": ready["load_endpoint"], "block_size": BLOCK_SIZE, "dp_rank": 0,
    }
    await wait_until(lambda: len(stand_in.calls) >= 2)  # registered, then heartbeats
    posts = [call for call in stand_in.calls if call[0] == "POST"]
    assert all(call == ("POST", "/admin/workers", f"Bearer {TOKEN}", registration) for call in posts)
    started = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(worker.wait(), timeout=10) == 0
    assert time.monotonic() - started < 5
    deletes = [call for call in stand_in.calls if call[0] == "DELETE"]
    assert deletes == [("DELETE", f"/admin/workers/{WORKER_ID}", f"Bearer {TOKEN}", None)]
    stderr = worker.stderr_path.read_text()
    assert "Traceback" not in stderr and "shutting down" in stderr


def test_bad_flags_are_named():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "worker", "--num-blocks", "0"],
        capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=30,
    )
    assert out.returncode == 1 and "kvgate worker: --num-blocks must be positive, got 0" in out.stderr


# -- in-process servers -----------------------------------------------------------------


@pytest.fixture
async def servers():
    runners = []

    async def start(worker_id: str) -> tuple[SimEngine, str, web.AppRunner]:
        config = SimConfig(block_size=4, num_blocks=64, speedup=1000.0)
        engine = SimEngine(config, ServedModel("m", TOK, config.context_len), worker_id=worker_id)
        runner, url = await start_server(create_app(engine), "127.0.0.1", 0)
        runners.append(runner)
        return engine, url, runner

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_two_workers_share_a_process_with_their_own_metrics(servers):
    (_, url_a, _), (_, url_b, _) = await servers("a"), await servers("b")
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url_a}/v1/completions", json={"prompt": "hello", "max_tokens": 3}) as response:
            assert response.status == 200
        assert await metric(session, url_a, "kvgate_worker_generation_tokens_total") == 3
        assert await metric(session, url_b, "kvgate_worker_generation_tokens_total") == 0


async def test_random_and_truncated_bodies_get_4xx_never_500(servers):
    engine, url, _ = await servers("fuzz")
    rng = random.Random(7)
    valid = [
        json.dumps({"prompt": "abc", "max_tokens": 2, "stream": True, "stop": ["x"]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode(),
    ]
    values = [None, True, -1, 0, 1.5, "s", [], {}, [1, "a"], {"include_usage": 1}, 10**30]
    fields = ["prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop"]
    bodies = [v[: rng.randrange(len(v))] for v in valid for _ in range(20)]  # truncated JSON
    bodies += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(20)]
    for _ in range(60):
        body = json.loads(rng.choice(valid))
        body[rng.choice(fields)] = rng.choice(values)
        bodies.append(json.dumps(body).encode())
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            for path in ("/v1/completions", "/v1/chat/completions"):
                async with session.post(f"{url}{path}", data=body) as response:
                    assert response.status in (200, 400, 404), body
                    await response.read()
        async with session.get(f"{url}/health") as response:
            assert response.status == 200
    assert engine.is_alive and engine.pool.num_used_blocks == 0


async def test_a_stopping_server_answers_503(servers):
    engine, url, runner = await servers("stopping")
    await runner.app.shutdown()  # what SIGTERM starts: in-flight requests may finish, new ones go elsewhere
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/health") as response:
            assert response.status == 503 and await response.json() == {"status": "stopping"}
        async with session.post(f"{url}/v1/completions", json={"prompt": "hi"}) as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "engine_unavailable"
    assert engine.is_alive  # the engine itself stops only after the last handler


def test_sigint_stops_a_worker_without_router_or_events():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "worker", "--port", "0", "--events-endpoint", "",
         "--replay-endpoint", "", "--load-endpoint", ""],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env,
    )
    try:
        ready = json.loads(proc.stdout.readline())
        assert (ready["events_endpoint"], ready["replay_endpoint"], ready["load_endpoint"]) == (None, None, None)
        assert ready["model"] == "kvgate-sim" and ready["worker_id"] == f"sim-{os.uname().nodename}-{proc.pid}"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "Traceback" not in stderr
