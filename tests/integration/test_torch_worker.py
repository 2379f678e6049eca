"""`kvgate worker --engine torch` as a real process, over real HTTP, ZMQ and signals.

Starts the worker with the tiny seeded model and every port left to the OS, then
checks: a streamed completion equals the engine's greedy output computed in this
process (same seeded weights), a repeated chat hits the prefix cache (usage), bad
requests get 400 while the engine keeps serving, KV events reach a real
`PrefixIndex`, load reports reach a `LoadAggregator`, `/metrics` shows the engine's
gauges, and SIGTERM exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from indexer.hashing import hash_prompt
from indexer.index import PrefixIndex
from indexer.load import LoadAggregator, LoadSubscriber
from indexer.subscriber import EventSubscriber
from indexer.tokenizer import ByteTokenizer, prompt_ids
from worker.engine_core import EngineConfig, EngineCore
from worker.models import ModelConfig
from worker.sampling import SamplingParams

REPO_ROOT = Path(__file__).parents[2]
TOK = ByteTokenizer()
MODEL = "torch-it"
WORKER_ID = "torch-it-0"
BLOCK_SIZE = 16
NUM_BLOCKS = 64  # 1,024 tokens of KV cache
PROMPT = "The reference worker runs a tiny mixture-of-experts model. " * 3


@pytest.fixture
async def worker(tmp_path):
    stderr_path = tmp_path / "worker.stderr"
    with open(stderr_path, "w") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.cli", "worker", "--engine", "torch", "--device", "cpu",
            "--host", "127.0.0.1", "--port", "0", "--model", MODEL, "--worker-id", WORKER_ID,
            "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS),
            "--events-endpoint", "tcp://127.0.0.1:0", "--replay-endpoint", "tcp://127.0.0.1:0",
            "--load-endpoint", "tcp://127.0.0.1:0",
            stdout=asyncio.subprocess.PIPE, stderr=stderr, cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        assert line, f"the worker exited: {stderr_path.read_text()}"
        proc.ready = json.loads(line)
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def greedy_text(
    prompt: str, max_tokens: int, *, model: str = MODEL, block_size: int = BLOCK_SIZE, num_blocks: int = NUM_BLOCKS,
) -> str:
    """What a torch worker must answer: the same seeded model and greedy decoding, in-process.

    Also the reference of `test_dp_worker.py`, for its model name and cache shape.
    """
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks)
    core = EngineCore(config, ModelConfig(), model_name=model, eos_token_id=TOK.eos_token_id)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return TOK.decode(core.generate([prompt_ids(TOK, prompt).tolist()], params)[0])


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_torch_worker_process_end_to_end(worker):
    url = worker.ready["url"]
    assert (worker.ready["model"], worker.ready["block_size"]) == (MODEL, BLOCK_SIZE)
    index = PrefixIndex(BLOCK_SIZE, default_model=MODEL)
    subscriber = EventSubscriber(index, WORKER_ID, worker.ready["events_endpoint"], worker.ready["replay_endpoint"])
    aggregator = LoadAggregator()
    load_subscriber = LoadSubscriber(aggregator, worker.ready["load_endpoint"])
    subscriber.start()
    load_subscriber.start()
    try:
        async with aiohttp.ClientSession() as session:
            await check_streamed_completion(session, url)
            await check_chat_prefix_hit(session, url)
            await check_bad_requests(session, url)
            await check_metrics(session, url)
        ids = prompt_ids(TOK, PROMPT)
        hashes = hash_prompt(ids, BLOCK_SIZE, MODEL)
        await wait_until(lambda: index.find_matches(hashes) == {(WORKER_ID, 0): len(ids) // BLOCK_SIZE})
        assert subscriber.stats.num_malformed == 0
        await wait_until(lambda: getattr(aggregator.get((WORKER_ID, 0)), "num_running", None) == 0)
        report = aggregator.get((WORKER_ID, 0))
        assert (report.num_kv_blocks_total, report.num_waiting, report.num_kv_blocks_used) == (NUM_BLOCKS, 0, 0)
    finally:
        await subscriber.stop()
        await load_subscriber.stop()
    worker.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(worker.wait(), timeout=30) == 0


async def check_streamed_completion(session: aiohttp.ClientSession, url: str) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        events = [line[6:].strip() async for line in response.content if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == greedy_text(PROMPT, 24)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["prompt_tokens"] == len(prompt_ids(TOK, PROMPT))  # BOS + bytes
    assert chunks[-1]["usage"]["completion_tokens"] == 24


async def check_chat_prefix_hit(session: aiohttp.ClientSession, url: str) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "temperature": 0}
    usages = []
    for _ in range(2):
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            answer = await response.json()
        assert answer["object"] == "chat.completion"
        usages.append(answer["usage"])
    num_prompt = usages[0]["prompt_tokens"]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] < usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE


async def check_bad_requests(session: aiohttp.ClientSession, url: str) -> None:
    bad = [
        ({"prompt": "x" * 1000, "max_tokens": 100}, "context_length_exceeded"),  # 1,100 > 1,024 tokens of cache
        ({"prompt": "hi", "temperature": 5}, None),
        ({"prompt": "hi", "top_p": 0}, None),
        ({"prompt_token_ids": [1, 999]}, None),
    ]
    for body, code in bad:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 400, body
            assert (await response.json())["error"]["code"] == code
    async with session.get(f"{url}/health") as response:
        assert response.status == 200
    body = {"prompt_token_ids": [72, 105], "max_tokens": 3, "temperature": 0.8, "top_p": 0.9, "seed": 11}
    answers = []
    for _ in range(2):
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200
            answers.append((await response.json())["choices"][0]["text"])
    assert answers[0] == answers[1]  # seeded


async def check_metrics(session: aiohttp.ClientSession, url: str) -> None:
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    gauges = dict(re.findall(r"^(kvgate_worker_\w+) (\S+)$", text, re.MULTILINE))
    assert float(gauges["kvgate_worker_engine_alive"]) == 1.0
    assert float(gauges["kvgate_worker_kv_blocks_total"]) == NUM_BLOCKS
    assert float(gauges["kvgate_worker_prefix_cache_hit_rate"]) > 0.0
    assert float(gauges["kvgate_worker_generation_tokens_total"]) >= 24 + 10 + 6
