"""worker.disagg in one process: a decode and a prefill sim engine over a real queue and real TCP notifications.

The in-process `MemoryPrefillQueue` and the sim's KV ports (`worker.sim_transfer`,
real loopback TCP) connect a `DecodeLink` and a `PrefillLoop`; the answers are
compared with an aggregated engine's, and the counters say which path ran.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest

from indexer.tokenizer import ByteTokenizer
from kvstore.http_queue import HttpPrefillQueue
from kvstore.memory_queue import MemoryPrefillQueue
from kvstore.prefill_queue import PrefillQueue, QueueConfig
from worker.api import GenerateRequest, ServedModel
from worker.disagg import DecodeLink, PrefillLoop
from worker.sim import SimConfig, SimEngine
from worker.sim_transfer import SimEgress, SimIngress, SimLink

MODEL = "kvgate-sim"
BS = 16
CONFIG = SimConfig(block_size=BS, num_blocks=512, speedup=50.0, load_interval_s=0.05)


def engine(worker_id: str, timeout_s: float = 5.0) -> SimEngine:
    served = ServedModel(MODEL, ByteTokenizer(), CONFIG.context_len)
    return SimEngine(CONFIG, served, worker_id=worker_id, remote_prefill_timeout_s=timeout_s)


def request(request_id: str, prompt: list[int], *, remote: bool = True, max_tokens: int = 6) -> GenerateRequest:
    return GenerateRequest(request_id, "completion", MODEL, array("l", prompt), max_tokens, ignore_eos=True,
                           remote_prefill=remote)


async def run(eng: SimEngine, req: GenerateRequest) -> list[int]:
    tokens: list[int] = []
    async for output in eng.submit(req):
        tokens.extend(output.token_ids)
    return tokens


@dataclass
class Pair:
    decode: SimEngine
    prefill: SimEngine
    link: DecodeLink
    loop: PrefillLoop
    queue: MemoryPrefillQueue


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    queue = MemoryPrefillQueue(QueueConfig(idle_timeout_s=1.0))
    await queue.start()
    decode, prefill = engine("D"), engine("P")
    await decode.start()
    await prefill.start()
    ingress = SimIngress(BS, CONFIG.num_blocks)
    await ingress.start()
    link = DecodeLink(queue, ingress, decode, model=MODEL, worker_id="D", block_size=BS)
    loop = PrefillLoop(queue, SimEgress(SimLink(speedup=CONFIG.speedup)), prefill, model=MODEL, consumer="P",
                       block_size=BS, max_jobs=4)
    loop.start()
    yield Pair(decode, prefill, link, loop, queue)
    await loop.close()
    await link.close()
    await decode.stop()
    await prefill.stop()
    await queue.close()


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(length)]


async def test_remote_prefill_answers_like_local_and_moves_the_prompt_blocks(pair: Pair):
    aggregated = engine("A")
    await aggregated.start()
    try:
        expected = await run(aggregated, request("x", prompt(1, 200), remote=False))
    finally:
        await aggregated.stop()
    assert await run(pair.decode, request("r1", prompt(1, 200))) == expected
    counters = pair.decode.remote_counters
    assert (counters.num_requested, counters.num_completed, counters.num_remote_tokens) == (1, 1, 192)
    assert pair.loop.counters.num_jobs_served == 1 and pair.loop.counters.num_blocks_sent == 12
    assert pair.link.counters.num_jobs_enqueued == 1
    assert await pair.queue.depth(MODEL) == 0
    # The prefill worker's blocks were released: only its prefix cache keeps them.
    assert pair.prefill.pool.num_used_blocks == 0 and pair.prefill.pool.num_cached_blocks == 12
    assert not pair.prefill.scheduler.held


async def test_many_concurrent_remote_requests_all_complete(pair: Pair):
    results = await asyncio.gather(*(run(pair.decode, request(f"c{i}", prompt(i, 100 + 40 * i))) for i in range(8)))
    assert all(len(tokens) == 6 for tokens in results)
    assert pair.decode.remote_counters.num_completed == 8
    assert pair.decode.pool.num_used_blocks == 0


async def test_short_prompt_is_prefilled_locally_even_when_asked_remote(pair: Pair):
    assert len(await run(pair.decode, request("s", prompt(3, 10)))) == 6
    assert pair.decode.remote_counters.num_requested == 0


@asynccontextmanager
async def decode_only(queue: PrefillQueue, timeout_s: float) -> AsyncIterator[SimEngine]:
    """A decode engine linked to `queue` with no prefill worker anywhere."""
    await queue.start()
    decode = engine("D", timeout_s=timeout_s)
    await decode.start()
    ingress = SimIngress(BS, CONFIG.num_blocks)
    await ingress.start()
    link = DecodeLink(queue, ingress, decode, model=MODEL, worker_id="D", block_size=BS)
    try:
        yield decode
    finally:
        await link.close()
        await decode.stop()
        await queue.close()


async def test_no_prefill_worker_falls_back_at_the_deadline():
    async with decode_only(MemoryPrefillQueue(), timeout_s=0.3) as decode:
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert len(await run(decode, request("f", prompt(4, 300)))) == 6
        assert loop.time() - start >= 0.3
        assert decode.remote_counters.num_fallback_deadline == 1


async def test_unreachable_queue_falls_back_at_once():
    queue = HttpPrefillQueue("http://127.0.0.1:1", QueueConfig(op_timeout_s=0.2))  # nothing listens there
    async with decode_only(queue, timeout_s=30.0) as decode:
        assert len(await asyncio.wait_for(run(decode, request("u", prompt(5, 300))), 5)) == 6
        assert decode.remote_counters.num_fallback_unqueued == 1


async def test_aborted_remote_request_holds_its_blocks_until_the_deadline():
    async with decode_only(MemoryPrefillQueue(), timeout_s=0.4) as decode:
        outputs = decode.submit(request("a", prompt(6, 300)))
        task = asyncio.ensure_future(outputs.__anext__())
        await asyncio.sleep(0.1)
        assert decode.scheduler.remote_prefilling
        decode.abort("a")  # what the server does when the client goes away
        task.cancel()
        await asyncio.sleep(0.1)
        assert "a" in decode.scheduler.held and decode.pool.num_used_blocks > 0
        await asyncio.sleep(0.9)  # past the deadline plus the grace
        assert not decode.scheduler.held and decode.pool.num_used_blocks == 0
        assert decode.remote_counters.num_aborted == 1
