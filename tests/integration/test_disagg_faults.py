"""Decode-first disaggregation under faults: real worker processes, a real Redis of our own.

Every test starts its own `redis-server` on a free port (append-only file, fsync on
every write, so queued jobs survive a restart) and `kvgate worker --engine sim`
processes: decode workers, prefill workers and, for reference, an aggregated one.
Requests go straight to the decode worker's OpenAI API with
`"kv_transfer_params": {"do_remote_prefill": true}`; outcomes are checked on the
answers (the sim's text is a function of the prompt alone, so a remote prefill, a
local fallback and an aggregated worker all answer the same), on the workers'
`/metrics` and `/health`, and on the queue's streams in Redis.

Faults: a prefill worker SIGKILLed while holding a job; a slow one that keeps its job
by renewing it (no second worker computes it); no prefill worker left;
Redis SIGKILLed and restarted under running workers; a job enqueued twice; a job
whose every consumer dies (dead-lettered, the client still answered).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as redis

from indexer.tokenizer import ByteTokenizer, prompt_ids
from kvstore.prefill_job import PrefillJob
from kvstore.prefill_queue import QueueConfig
from kvstore.redis_queue import RedisPrefillQueue
from tests.integration.test_prefill_queue import free_port, kill, start_redis
from tests.integration.test_sim_worker import expected, metric, wait_until
from worker.sim_transfer import SimIngress

REPO_ROOT = Path(__file__).parents[2]
TOK = ByteTokenizer()
MODEL = "sim-disagg"
BLOCK_SIZE = 16
MAX_TOKENS = 8
STREAM = f"kvgate:prefill:{MODEL}"  # QueueConfig's default key prefix
DISAGG = "kvgate_worker_disagg_"
FAST = ["--speedup", "20"]
# The sim's prefill at 4 ms a token: a 2,400-token prompt holds its prefill worker for ~10 s.
SLOW = ["--speedup", "1", "--prefill-ms-per-token", "4"]


def long_prompt(tag: str, num_chars: int = 2400) -> str:
    """A prompt of `num_chars` byte tokens, distinct from the first character on."""
    head = f"[{tag}] "
    return head + ("The decode worker asks a prefill worker for this prompt's KV. " * 40)[: num_chars - len(head)]


def answer_of(prompt: str) -> str:
    return expected(prompt_ids(TOK, prompt), MAX_TOKENS)


@dataclass
class Worker:
    worker_id: str
    proc: asyncio.subprocess.Process
    url: str

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)


class Fleet:
    """One test's processes: a durable redis-server and `kvgate worker` processes; all killed at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}"
        self.redis_proc = start_redis(self.redis_port, tmp_path, durable=True)
        self.redis = redis.Redis.from_url(self.redis_url)
        self.procs: list[asyncio.subprocess.Process] = []
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        # The workers read KVGATE_* as flag values: keep this run's environment out of theirs.
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
        self._env["PYTHONPATH"] = str(REPO_ROOT)

    def kill_redis(self) -> None:
        kill(self.redis_proc)

    async def restart_redis(self) -> None:
        self.redis_proc = start_redis(self.redis_port, self.dir, durable=True)
        await self.redis.connection_pool.disconnect()  # this test's own connections died with the old server

    async def start(self, role: str, worker_id: str, *flags: str) -> Worker:
        stderr_path = self.dir / f"{worker_id}.stderr"
        queue = ["--prefill-queue", self.redis_url] if role != "both" else []
        with open(stderr_path, "w") as stderr:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router.cli", "worker", "--engine", "sim", "--role", role, *queue,
                "--port", "0", "--model", MODEL, "--worker-id", worker_id, "--block-size", str(BLOCK_SIZE),
                "--events-endpoint", "", "--replay-endpoint", "", "--load-endpoint", "", "--log-level", "WARNING",
                *flags, stdout=asyncio.subprocess.PIPE, stderr=stderr, cwd=REPO_ROOT, env=self._env,
            )
        self.procs.append(proc)
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
        assert line, f"worker {worker_id} exited: {stderr_path.read_text()}"
        return Worker(worker_id, proc, json.loads(line)["url"])

    async def close(self) -> None:
        await self.session.close()
        for proc in self.procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGKILL)
            await proc.wait()
        await self.redis.aclose()
        if self.redis_proc.poll() is None:
            kill(self.redis_proc)

    async def complete(self, worker: Worker, prompt: str, *, remote: bool = True) -> str:
        """The answer's text; asserts a 200 with a whole answer."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
        if remote:
            body["kv_transfer_params"] = {"do_remote_prefill": True}
        async with self.session.post(f"{worker.url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
        assert answer["choices"][0]["finish_reason"] == "length"
        return answer["choices"][0]["text"]

    async def counters(self, worker: Worker, *names: str) -> dict[str, int]:
        return {name: int(await metric(self.session, worker.url, f"{DISAGG}{name}_total")) for name in names}

    async def health(self, worker: Worker) -> tuple[int, bool]:
        async with self.session.get(f"{worker.url}/health") as response:
            return response.status, (await response.json())["prefill_queue"]["available"]


@pytest.fixture
async def fleet(tmp_path):
    fleet = Fleet(tmp_path)
    try:
        yield fleet
    finally:
        await fleet.close()


async def test_prefill_worker_killed_holding_a_job_is_replaced(fleet):
    decode, slow, aggregated = await asyncio.gather(
        fleet.start("decode", "D", *FAST, "--remote-prefill-timeout", "30"),
        fleet.start("prefill", "P-slow", *SLOW),
        fleet.start("both", "A", *FAST),
    )
    prompt = long_prompt("killed")
    request = asyncio.create_task(fleet.complete(decode, prompt))
    await wait_until(lambda: _claimed(fleet, slow), timeout_s=20)
    # P-slow holds the job (pending on it in the group) and is mid-prefill: kill it there.
    [pending] = await fleet.redis.xpending_range(STREAM, "prefill-workers", "-", "+", 10)
    assert pending["consumer"] == b"P-slow" and pending["times_delivered"] == 1
    slow.kill()
    fresh = await fleet.start("prefill", "P-fresh", *FAST, "--prefill-queue-idle-timeout", "0.5")
    text = await asyncio.wait_for(request, 30)
    assert text == await fleet.complete(aggregated, prompt, remote=False) == answer_of(prompt)
    assert await fleet.counters(decode, "requested", "completed", "fallback_deadline", "fallback_unqueued") == {
        "requested": 1, "completed": 1, "fallback_deadline": 0, "fallback_unqueued": 0,
    }
    # Acked (after its counters moved): nothing is left in the stream or pending.
    await wait_until(lambda: _stream_len(fleet, 0))
    assert (await fleet.redis.xpending(STREAM, "prefill-workers"))["pending"] == 0
    assert await fleet.counters(fresh, "jobs_claimed", "jobs_served") == {"jobs_claimed": 1, "jobs_served": 1}
    assert await metric(fleet.session, fresh.url, "kvgate_worker_prefill_queue_reclaimed_total") == 1


async def test_slow_prefill_worker_alive_keeps_its_job_by_renewing_it(fleet):
    # Both prefill workers reclaim jobs idle for 1 s; the slow one's prefill takes ~5 s.
    idle = ("--prefill-queue-idle-timeout", "1")
    decode, slow = await asyncio.gather(
        fleet.start("decode", "D", *FAST, "--remote-prefill-timeout", "30"),
        fleet.start("prefill", "P-slow", *SLOW, *idle),
    )
    prompt = long_prompt("renewed", 1200)
    request = asyncio.create_task(fleet.complete(decode, prompt))
    await wait_until(lambda: _claimed(fleet, slow), timeout_s=20)
    second = await fleet.start("prefill", "P-second", *FAST, *idle)
    assert await asyncio.wait_for(request, 30) == answer_of(prompt)
    assert await fleet.counters(slow, "jobs_claimed", "jobs_served") == {"jobs_claimed": 1, "jobs_served": 1}
    assert await fleet.counters(second, "jobs_claimed", "jobs_served") == {"jobs_claimed": 0, "jobs_served": 0}
    assert await metric(fleet.session, slow.url, "kvgate_worker_prefill_queue_renewed_total") >= 3
    assert await fleet.counters(decode, "completed", "fallback_deadline") == {"completed": 1, "fallback_deadline": 0}


async def test_no_prefill_worker_left_decode_falls_back_at_the_deadline(fleet):
    decode, prefill = await asyncio.gather(
        fleet.start("decode", "D", *FAST, "--remote-prefill-timeout", "1"),
        fleet.start("prefill", "P", *FAST),
    )
    served = long_prompt("served")
    assert await fleet.complete(decode, served) == answer_of(served)
    await wait_until(lambda: _stream_len(fleet, 0))  # acked just after the KV went out
    prefill.kill()
    await prefill.proc.wait()
    orphan = long_prompt("orphan")
    started = time.monotonic()
    assert await fleet.complete(decode, orphan) == answer_of(orphan)
    assert time.monotonic() - started >= 1.0
    assert await fleet.counters(decode, "requested", "completed", "fallback_deadline", "fallback_unqueued") == {
        "requested": 2, "completed": 1, "fallback_deadline": 1, "fallback_unqueued": 0,
    }
    # The orphaned job waits unclaimed; a prefill worker would drop it as expired.
    assert await fleet.redis.xlen(STREAM) == 1


async def test_redis_killed_and_restarted_under_running_workers_loses_no_request(fleet):
    decode, prefill = await asyncio.gather(
        fleet.start("decode", "D", *FAST, "--remote-prefill-timeout", "30"),
        fleet.start("prefill", "P", *FAST),
    )
    before = long_prompt("before")
    assert await fleet.complete(decode, before) == answer_of(before)
    fleet.kill_redis()
    # During the outage every request is prefilled locally at once, not at the deadline.
    for i in range(3):
        during = long_prompt(f"during-{i}")
        started = time.monotonic()
        assert await fleet.complete(decode, during) == answer_of(during)
        assert time.monotonic() - started < 5.0
    assert await fleet.health(decode) == (200, False)
    await wait_until(lambda: _health_is(fleet, prefill, (200, False)))
    await fleet.restart_redis()
    for worker in (decode, prefill):
        await wait_until(lambda w=worker: _health_is(fleet, w, (200, True)), timeout_s=10)
    after = long_prompt("after")
    assert await fleet.complete(decode, after) == answer_of(after)
    assert await fleet.counters(decode, "requested", "completed", "fallback_deadline", "fallback_unqueued") == {
        "requested": 5, "completed": 2, "fallback_deadline": 0, "fallback_unqueued": 3,
    }
    await wait_until(lambda: _stream_len(fleet, 0))
    assert await fleet.counters(prefill, "jobs_served") == {"jobs_served": 2}
    assert await metric(fleet.session, decode.url, "kvgate_worker_prefill_queue_available") == 1


async def test_queued_job_survives_a_redis_restart_and_is_served(fleet):
    decode = await fleet.start("decode", "D", *FAST, "--remote-prefill-timeout", "30")
    queued = long_prompt("queued")
    request = asyncio.create_task(fleet.complete(decode, queued))
    await wait_until(lambda: _stream_len(fleet, 1))
    fleet.kill_redis()
    await fleet.restart_redis()
    # The job came back from the append-only file; a prefill worker started now serves it.
    prefill = await fleet.start("prefill", "P", *FAST)
    assert await asyncio.wait_for(request, 30) == answer_of(queued)
    assert await fleet.counters(decode, "completed", "fallback_deadline", "fallback_unqueued") == {
        "completed": 1, "fallback_deadline": 0, "fallback_unqueued": 0,
    }
    await wait_until(lambda: _stream_len(fleet, 0))
    assert await fleet.counters(prefill, "jobs_served") == {"jobs_served": 1}


async def test_same_request_enqueued_twice_is_prefilled_once(fleet):
    # This test is the decode worker: its KV receiver counts the notifications.
    notified: list[str] = []
    ingress = SimIngress(BLOCK_SIZE, num_blocks=1024)
    await ingress.start()
    ingress.set_on_ready(notified.append)
    queue = RedisPrefillQueue(fleet.redis_url, QueueConfig(op_timeout_s=2.0))
    prefill = await fleet.start("prefill", "P", *FAST)
    try:
        await queue.start()
        token_ids = prompt_ids(TOK, long_prompt("twice")).tolist()
        job = PrefillJob(
            request_id="req-twice", model=MODEL, token_ids=token_ids, block_ids=list(range(10, 20)),
            decode_worker_id="test", transfer_endpoint="", deadline=time.time() + 30,
            block_size=BLOCK_SIZE, receivers=ingress.endpoints(), created_at=time.time(),
        )
        assert await queue.enqueue(job) is True
        assert await queue.enqueue(job) is False
        await wait_until(lambda: notified == ["req-twice"], timeout_s=15)
        # Acked and gone, and never stored twice: no second delivery can follow.
        await wait_until(lambda: _stream_len(fleet, 0))
        assert (await fleet.redis.xpending(STREAM, "prefill-workers"))["pending"] == 0
        assert notified == ["req-twice"]
        assert await fleet.counters(prefill, "jobs_claimed", "jobs_served", "blocks_sent") == {
            "jobs_claimed": 1, "jobs_served": 1, "blocks_sent": 10,
        }
        assert (queue.counters.num_enqueued, queue.counters.num_duplicates) == (1, 1)
    finally:
        await queue.close()
        ingress.close()


async def test_job_that_kills_every_consumer_is_dead_lettered_and_the_client_answered(fleet):
    max_deliveries = 2
    queue_flags = ["--prefill-queue-idle-timeout", "0.3", "--prefill-queue-max-deliveries", str(max_deliveries)]
    decode = await fleet.start("decode", "D", *FAST, "--remote-prefill-timeout", "12")
    prompt = long_prompt("poison")
    started = time.monotonic()
    request = asyncio.create_task(fleet.complete(decode, prompt))
    for attempt in range(1, max_deliveries + 1):
        consumer = await fleet.start("prefill", f"P{attempt}", *SLOW, *queue_flags)
        await wait_until(lambda c=consumer: _claimed(fleet, c), timeout_s=10)
        consumer.kill()
        await consumer.proc.wait()
    # The next consumer finds the job over its delivery limit: dead-lettered, not run.
    last = await fleet.start("prefill", "P-last", *FAST, *queue_flags)
    queue = RedisPrefillQueue(fleet.redis_url, QueueConfig(op_timeout_s=2.0))
    try:
        await wait_until(lambda: _dead_letters(queue), timeout_s=10)
        [dead] = await queue.dead_letters(MODEL)
    finally:
        await queue.close()
    assert dead.reason == f"delivered {max_deliveries + 1} times without ack (limit {max_deliveries})"
    assert dead.num_deliveries == max_deliveries + 1
    assert dead.job is not None and dead.job.token_ids == prompt_ids(TOK, prompt).tolist()
    assert await fleet.redis.xlen(STREAM) == 0
    # The client is answered by a local prefill at its deadline.
    assert await asyncio.wait_for(request, 20) == answer_of(prompt)
    assert time.monotonic() - started >= 12.0
    assert await fleet.counters(decode, "completed", "fallback_deadline") == {"completed": 0, "fallback_deadline": 1}
    await wait_until(lambda: _metric_is(fleet, last, "kvgate_worker_prefill_queue_dead_lettered_total", 1))
    assert await fleet.counters(last, "jobs_claimed", "jobs_served") == {"jobs_claimed": 0, "jobs_served": 0}


async def _claimed(fleet: Fleet, worker: Worker) -> bool:
    return (await fleet.counters(worker, "jobs_claimed"))["jobs_claimed"] == 1


async def _metric_is(fleet: Fleet, worker: Worker, name: str, value: float) -> bool:
    return await metric(fleet.session, worker.url, name) == value


async def _stream_len(fleet: Fleet, length: int) -> bool:
    return await fleet.redis.xlen(STREAM) == length


async def _health_is(fleet: Fleet, worker: Worker, status: tuple[int, bool]) -> bool:
    return await fleet.health(worker) == status


async def _dead_letters(queue: RedisPrefillQueue) -> bool:
    return bool(await queue.dead_letters(MODEL))
