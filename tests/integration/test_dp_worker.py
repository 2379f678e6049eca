"""`kvgate worker --engine torch --dp 2 --enable-expert-parallel` as real processes.

The launcher starts two DP rank processes (gloo on CPU, the tiny seeded model with
its 4 experts sharded 2 + 2, the DP coordinator in rank 0) and each rank serves as a
worker of its own, over real HTTP and ZMQ. Checked: one ready line per rank; a
greedy completion on rank 1 alone equals the single-process engine's (same seed and
model, computed in this process); the idle rank 0 runs exactly as many dummy steps as
rank 1 runs real ones, then both block with their step counters still; requests on
both ranks at once; rank 1's KV events and load reports carry dp_rank 1; killing rank 1
makes rank 0 exit with an error and the launcher exit 1. With `--enable-dbo` and low
thresholds: the same greedy tokens, micro-batched steps counted alike on both ranks;
SIGTERM with a request in flight on rank 1 lets it finish (rank 0 drains with dummy
steps), then the group exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path

import aiohttp
import pytest

from indexer.hashing import hash_prompt
from indexer.index import PrefixIndex
from indexer.load import LoadAggregator, LoadSubscriber
from indexer.subscriber import EventSubscriber
from indexer.tokenizer import ByteTokenizer, prompt_ids
from tests.integration.test_torch_worker import greedy_text as engine_greedy_text
from tests.integration.test_torch_worker import wait_until

REPO_ROOT = Path(__file__).parents[2]
TOK = ByteTokenizer()
MODEL = "dp-it"
BLOCK_SIZE = 16
NUM_BLOCKS = 64
LIVENESS_S = 4.0
PROMPTS = (
    "Data-parallel ranks step together so that the experts always meet. ",
    "Each rank is a worker of its own to the router, with its own load. ",
)


@pytest.fixture
async def dp_group(tmp_path):
    """`await dp_group(*flags) -> (launcher process, ready lines by rank)`; all killed at the end."""
    procs: list[tuple[asyncio.subprocess.Process, list[dict]]] = []

    async def start(*flags: str) -> tuple[asyncio.subprocess.Process, list[dict]]:
        stderr_path = tmp_path / f"group{len(procs)}.stderr"
        with open(stderr_path, "w") as stderr:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router.cli", "worker", "--engine", "torch", "--dp", "2",
                "--enable-expert-parallel", "--port", "0", "--model", MODEL, "--worker-id", "dp-it",
                "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS),
                "--events-endpoint", "tcp://127.0.0.1:0", "--replay-endpoint", "tcp://127.0.0.1:0",
                "--load-endpoint", "tcp://127.0.0.1:0", "--load-interval", "0.1", "--shutdown-timeout", "1",
                "--dp-heartbeat-interval", "0.25", "--dp-liveness-timeout", str(LIVENESS_S), *flags,
                stdout=asyncio.subprocess.PIPE, stderr=stderr, cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            )
        ready: list[dict] = []
        procs.append((proc, ready))
        for _ in range(2):
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=90)
            assert line, f"the DP worker exited: {stderr_path.read_text()}"
            ready.append(json.loads(line))
        ready.sort(key=lambda r: r["dp_rank"])
        return proc, ready

    yield start
    for proc, ready in procs:
        for r in ready:
            try:
                os.kill(r["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


# The single-process engine's answer: the same seeded model, greedy, in this process.
greedy_text = partial(engine_greedy_text, model=MODEL, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["choices"][0]["text"]


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The DP and DBO series of a rank's /metrics, by name and labels as written."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    samples = {}
    for line in text.splitlines():
        if line.startswith(("kvgate_worker_dp_", "kvgate_worker_dbo_", "kvgate_worker_step_")):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def steps(samples: dict[str, float], kind: str) -> float:
    return samples[f'kvgate_worker_dp_steps_total{{kind="{kind}"}}']


def microbatched(samples: dict[str, float]) -> float:
    return samples['kvgate_worker_dbo_steps_total{batching="microbatched"}']


async def eventually(check, timeout_s: float = 10.0):
    """Awaits `check()` until it returns a truthy value; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (result := await check()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)
    return result


async def test_ep_ranks_serve_like_one_worker(dp_group):
    launcher, ready = await dp_group()
    assert [(r["dp_rank"], r["worker_id"], r["model"], r["block_size"]) for r in ready] == [
        (0, "dp-it-dp0", MODEL, BLOCK_SIZE), (1, "dp-it-dp1", MODEL, BLOCK_SIZE),
    ]
    assert ready[0]["url"] != ready[1]["url"] and ready[0]["load_endpoint"] != ready[1]["load_endpoint"]
    url0, url1 = ready[0]["url"], ready[1]["url"]
    index = PrefixIndex(BLOCK_SIZE, default_model=MODEL)
    events = EventSubscriber(index, "dp-it-dp1", ready[1]["events_endpoint"], ready[1]["replay_endpoint"])
    aggregator = LoadAggregator()
    loads = LoadSubscriber(aggregator, ready[1]["load_endpoint"])
    events.start()
    loads.start()
    try:
        async with aiohttp.ClientSession() as session:
            # One request on rank 1 only: rank 0 pairs every step with a dummy one.
            assert await complete(session, url1, PROMPTS[0], 12) == greedy_text(PROMPTS[0], 12)

            async def settled():
                m0, m1 = await scrape(session, url0), await scrape(session, url1)
                return (m0, m1) if steps(m0, "dummy") == steps(m1, "real") else None

            m0, m1 = await eventually(settled)
            assert (steps(m1, "real"), steps(m1, "dummy"), steps(m0, "real")) == (12, 0, 0)
            assert m0["kvgate_worker_step_comm_seconds_count"] == m1["kvgate_worker_step_compute_seconds_count"] == 12
            # Then both block: nothing steps any more.
            await asyncio.sleep(0.5)
            assert (await scrape(session, url0), await scrape(session, url1)) == (m0, m1)
            # Requests on both ranks at once.
            texts = await asyncio.gather(*(complete(session, u, p, 8) for u, p in zip((url0, url1), PROMPTS)))
            assert texts == [greedy_text(p, 8) for p in PROMPTS]

            async def same_step_counts():
                m0, m1 = await scrape(session, url0), await scrape(session, url1)
                return steps(m0, "real") + steps(m0, "dummy") == steps(m1, "real") + steps(m1, "dummy")

            await eventually(same_step_counts)
        ids = prompt_ids(TOK, PROMPTS[0])
        hashes = hash_prompt(ids, BLOCK_SIZE, MODEL)
        await wait_until(lambda: index.find_matches(hashes) == {("dp-it-dp1", 1): len(ids) // BLOCK_SIZE})
        await wait_until(lambda: aggregator.get(("dp-it-dp1", 1)) is not None)
        assert aggregator.get(("dp-it-dp1", 1)).num_kv_blocks_total == NUM_BLOCKS
        assert aggregator.get(("dp-it-dp1", 0)) is None
    finally:
        await events.stop()
        await loads.stop()
    # A rank killed: the other finds the group lost and exits with an error, and so does the launcher.
    # (Bounded by the liveness timeout plus the ranks' shutdown; generous for a loaded machine.)
    os.kill(ready[1]["pid"], signal.SIGKILL)
    assert await asyncio.wait_for(launcher.wait(), timeout=LIVENESS_S + 30) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(ready[0]["pid"], 0)


async def test_dbo_keeps_greedy_tokens_and_counts_microbatched_steps(dp_group):
    launcher, ready = await dp_group(
        "--enable-dbo", "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "8",
        "--shutdown-timeout", "20",  # what a request in flight at SIGTERM gets (rank 0's drain too)
    )
    url0, url1 = ready[0]["url"], ready[1]["url"]
    async with aiohttp.ClientSession() as session:
        # Two requests on rank 1 and one on rank 0: prefills split; decodes split while
        # both ranks have >= 2 tokens, else every rank runs plainly.
        jobs = [(url1, PROMPTS[0]), (url1, PROMPTS[1]), (url0, PROMPTS[1])]
        texts = await asyncio.gather(*(complete(session, u, p, 10) for u, p in jobs))
        assert texts == [greedy_text(p, 10) for _, p in jobs]
        assert await complete(session, url1, PROMPTS[0] * 2, 6) == greedy_text(PROMPTS[0] * 2, 6)

        async def settled():
            m0, m1 = await scrape(session, url0), await scrape(session, url1)
            same = steps(m0, "real") + steps(m0, "dummy") == steps(m1, "real") + steps(m1, "dummy")
            return (m0, m1) if same else None

        m0, m1 = await eventually(settled)
        assert microbatched(m0) == microbatched(m1) >= 2
        assert steps(m0, "dummy") >= 6  # rank 0 idles through the last request's 6 steps
        # SIGTERM with a request in flight on rank 1: rank 0 keeps stepping until it ends.
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with session.post(f"{url1}/v1/completions", json=body) as response:
            assert response.status == 200
            lines = aiter(response.content)
            chunks = [await anext(lines)]
            launcher.send_signal(signal.SIGTERM)
            chunks += [line async for line in lines]
    events = [c[6:].strip() for c in chunks if c.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    bodies = [json.loads(e) for e in events[:-1]]
    assert not [b for b in bodies if "error" in b], bodies[-1]
    text = "".join(b["choices"][0]["text"] for b in bodies)
    assert text == greedy_text(PROMPTS[1], 120)
    assert await asyncio.wait_for(launcher.wait(), timeout=30) == 0
