"""The prefill queue contract, checked on every implementation, plus faults.

The conformance tests run on `MemoryPrefillQueue`, on `RedisPrefillQueue` against the
real Redis at $KVGATE_REDIS_URL (set by `make test`), each under its own key prefix,
deleted afterwards (they fail if Redis does not answer), and on `HttpPrefillQueue`
reaching a `MemoryPrefillQueue` served by a real `QueueServer` on a free port.
The Redis fault tests start their own `redis-server` on a free port and kill it; the
HTTP fault tests stop and restart the `QueueServer`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import aiohttp
import msgspec
import pytest
import redis.asyncio as redis

from kvstore.http_queue import HttpPrefillQueue
from kvstore.memory_queue import MemoryPrefillQueue
from kvstore.prefill_job import ClaimedJob, PrefillJob
from kvstore.prefill_queue import PrefillQueue, QueueConfig, QueueUnavailable, open_prefill_queue
from kvstore.queue_server import QueueServer
from kvstore.redis_queue import RedisPrefillQueue

REDIS_URL = os.environ.get("KVGATE_REDIS_URL", "redis://127.0.0.1:6379")
MODEL = "tiny-moe"
FAST = {"max_len": 1000, "idle_timeout_s": 0.15, "max_deliveries": 3, "op_timeout_s": 1.0}
# Redis trims with MAXLEN ~ only whole stream nodes (stream-node-max-entries, 100 by default).
TRIM_SLACK = 100


def make_job(request_id: str, model: str = MODEL, deadline_in_s: float = 60.0) -> PrefillJob:
    return PrefillJob(
        request_id=request_id,
        model=model,
        token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
        block_ids=[7, 9],
        decode_worker_id="decode-0",
        transfer_endpoint="tcp://127.0.0.1:5555",
        deadline=time.time() + deadline_in_s,
        num_cached_tokens=0,
        agent_metadata=b"agent",
        created_at=time.time(),
    )


@pytest.fixture(params=["memory", "redis", "http"])
async def make_queue(request):
    prefix = f"kvgate-test-{uuid.uuid4().hex}"
    queues: list[PrefillQueue] = []
    servers: list[QueueServer] = []

    async def make(**overrides) -> PrefillQueue:
        config = QueueConfig(key_prefix=prefix, **{**FAST, **overrides})
        queue: PrefillQueue
        if request.param == "memory":
            queue = MemoryPrefillQueue(config)
        elif request.param == "redis":
            queue = RedisPrefillQueue(REDIS_URL, config)
        else:
            servers.append(QueueServer(MemoryPrefillQueue(config)))
            queue = HttpPrefillQueue(await servers[-1].start(), config)
        queues.append(queue)
        await queue.start()
        assert queue.is_available, f"no Redis answers at {REDIS_URL} (set KVGATE_REDIS_URL)"
        return queue

    yield make
    for queue in queues:
        await queue.close()
    for server in servers:
        await server.stop()
    if request.param == "redis":
        client = redis.Redis.from_url(REDIS_URL)
        try:
            keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


async def drain(queue: PrefillQueue, consumer: str = "w0") -> list[str]:
    """Claim and ack every job ready now; their request ids in delivery order."""
    request_ids = []
    while (claimed := await queue.claim(MODEL, consumer, timeout_s=0)) is not None:
        request_ids.append(claimed.job.request_id)
        assert await queue.ack(claimed)
    return request_ids


async def test_enqueue_claim_ack_round_trip(make_queue):
    queue = await make_queue()
    job = make_job("r1")
    assert isinstance(queue, PrefillQueue)
    assert await queue.enqueue(job) is True
    assert await queue.depth(MODEL) == 1
    claimed = await queue.claim(MODEL, "w0", timeout_s=1.0)
    assert claimed is not None
    assert (claimed.job, claimed.consumer, claimed.num_deliveries) == (job, "w0", 1)
    assert await queue.depth(MODEL) == 1  # claimed, not finished
    assert await queue.ack(claimed) is True
    assert await queue.ack(claimed) is False
    assert await queue.depth(MODEL) == 0
    assert await queue.claim(MODEL, "w0", timeout_s=0) is None
    counters = queue.counters.snapshot()
    assert counters == {**dict.fromkeys(counters, 0), "num_enqueued": 1, "num_delivered": 1, "num_acked": 1}


async def test_blocking_claim_wakes_on_enqueue(make_queue):
    queue = await make_queue()
    waiter = asyncio.create_task(queue.claim(MODEL, "w0", timeout_s=5.0))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    await queue.enqueue(make_job("r1"))
    claimed = await asyncio.wait_for(waiter, 2.0)
    assert claimed is not None and claimed.job.request_id == "r1"
    assert time.monotonic() - started < 1.0


async def test_jobs_come_out_in_enqueue_order(make_queue):
    queue = await make_queue()
    for i in range(6):
        assert await queue.enqueue(make_job(f"r{i}"))
    assert await drain(queue) == [f"r{i}" for i in range(6)]


async def test_queues_are_per_model(make_queue):
    queue = await make_queue()
    for i in range(3):
        await queue.enqueue(make_job(f"a{i}", model="model-a"))
    await queue.enqueue(make_job("b0", model="model-b"))
    assert (await queue.depth("model-a"), await queue.depth("model-b")) == (3, 1)
    claimed = await queue.claim("model-b", "w0", timeout_s=0)
    assert claimed is not None and claimed.job.request_id == "b0"
    assert await queue.claim("model-b", "w0", timeout_s=0) is None
    await queue.ack(claimed)
    assert (await queue.depth("model-a"), await queue.depth("model-b")) == (3, 0)


async def test_length_is_bounded_and_oldest_jobs_are_trimmed(make_queue):
    queue = await make_queue(max_len=5)
    num_jobs = 250
    for i in range(num_jobs):
        assert await queue.enqueue(make_job(f"r{i}"))
    depth = await queue.depth(MODEL)
    assert 5 <= depth <= 5 + TRIM_SLACK
    # What is left is exactly the newest `depth` jobs, in order.
    assert await drain(queue) == [f"r{i}" for i in range(num_jobs - depth, num_jobs)]


async def test_same_request_is_enqueued_once(make_queue):
    queue = await make_queue(dedupe_ttl_s=0.3)
    assert await queue.enqueue(make_job("r1")) is True
    assert await queue.enqueue(make_job("r1")) is False
    assert await queue.depth(MODEL) == 1
    assert await drain(queue) == ["r1"]
    assert await queue.enqueue(make_job("r1")) is False  # still within the TTL once done
    assert queue.counters.num_duplicates == 2
    await asyncio.sleep(0.35)
    assert await queue.enqueue(make_job("r1")) is True
    assert await queue.depth(MODEL) == 1


async def test_expired_job_is_dropped_not_returned(make_queue):
    queue = await make_queue()
    await queue.enqueue(make_job("late", deadline_in_s=-1.0))
    await queue.enqueue(make_job("live"))
    claimed = await queue.claim(MODEL, "w0", timeout_s=0)
    assert claimed is not None and claimed.job.request_id == "live"
    assert queue.counters.num_expired == 1
    assert await queue.depth(MODEL) == 1
    await queue.ack(claimed)
    assert await queue.depth(MODEL) == 0


async def test_job_expiring_while_claimed_is_not_redelivered(make_queue):
    queue = await make_queue()
    await queue.enqueue(make_job("r1", deadline_in_s=0.2))
    assert await queue.claim(MODEL, "dead-worker", timeout_s=0) is not None
    await asyncio.sleep(0.25)  # past both the deadline and the idle timeout
    assert await queue.claim(MODEL, "w1", timeout_s=0) is None
    assert (queue.counters.num_reclaimed, queue.counters.num_expired) == (1, 1)
    assert await queue.depth(MODEL) == 0


async def test_idle_job_is_reclaimed_by_another_consumer(make_queue):
    queue = await make_queue()
    await queue.enqueue(make_job("r1"))
    first = await queue.claim(MODEL, "dead-worker", timeout_s=0)
    assert first is not None
    assert await queue.claim(MODEL, "w1", timeout_s=0) is None  # not idle long enough yet
    started = time.monotonic()
    second = await queue.claim(MODEL, "w1", timeout_s=2.0)
    waited_s = time.monotonic() - started
    assert second is not None
    assert (second.job, second.consumer, second.num_deliveries) == (first.job, "w1", 2)
    assert 0.1 <= waited_s < 1.0
    assert queue.counters.num_reclaimed == 1
    assert await queue.ack(second) is True
    assert await queue.ack(first) is False  # the dead worker's late ack changes nothing
    assert await queue.depth(MODEL) == 0


async def renew_until(stop: asyncio.Event, queue: PrefillQueue, claimed: ClaimedJob, interval_s: float) -> list[bool]:
    """Renew `claimed` every `interval_s` until `stop` is set; each renewal's answer."""
    answers = []
    while not stop.is_set():
        await asyncio.sleep(interval_s)
        answers.append(await queue.renew(claimed))
    return answers


async def test_renewed_job_is_not_reclaimed_past_the_idle_timeout(make_queue):
    queue = await make_queue(idle_timeout_s=0.3)
    await queue.enqueue(make_job("slow"))
    held = await queue.claim(MODEL, "slow-worker", timeout_s=0)
    assert held is not None and held.num_deliveries == 1
    stop = asyncio.Event()
    heartbeat = asyncio.create_task(renew_until(stop, queue, held, interval_s=0.1))
    started = time.monotonic()
    assert await queue.claim(MODEL, "w1", timeout_s=1.0) is None  # over three idle timeouts
    assert time.monotonic() - started >= 1.0
    stop.set()
    answers = await heartbeat
    assert len(answers) >= 5 and answers == [True] * len(answers)
    assert await queue.ack(held) is True  # still the first delivery: renewals count none
    assert (queue.counters.num_renewed, queue.counters.num_reclaimed) == (len(answers), 0)
    assert (queue.counters.num_delivered, queue.counters.num_acked) == (1, 1)
    assert await queue.depth(MODEL) == 0


async def test_renewal_counts_no_delivery_and_a_reclaimed_holder_cannot_renew(make_queue):
    queue = await make_queue()
    await queue.enqueue(make_job("r1"))
    first = await queue.claim(MODEL, "stalled", timeout_s=0)
    assert first is not None
    for _ in range(3):
        assert await queue.renew(first) is True
    second = await queue.claim(MODEL, "w1", timeout_s=2.0)  # once the renewals stopped
    assert second is not None
    assert (second.job, second.consumer, second.num_deliveries) == (first.job, "w1", 2)
    assert await queue.renew(first) is False
    # The failed renewal took nothing: w1 still holds the job, with a fresh idle clock.
    assert await queue.renew(second) is True
    assert await queue.claim(MODEL, "w2", timeout_s=0) is None
    assert await queue.ack(second) is True
    assert (queue.counters.num_renewed, queue.counters.num_reclaimed) == (4, 1)
    assert await queue.depth(MODEL) == 0


async def test_renewal_of_an_older_delivery_to_the_same_consumer_fails(make_queue):
    queue = await make_queue()
    await queue.enqueue(make_job("r1"))
    first = await queue.claim(MODEL, "w0", timeout_s=0)
    second = await queue.claim(MODEL, "w0", timeout_s=2.0)  # another slot of the same worker
    assert first is not None and second is not None
    assert (second.consumer, second.num_deliveries) == ("w0", 2)
    assert await queue.renew(first) is False
    assert await queue.renew(second) is True
    assert queue.counters.num_renewed == 1


async def test_renewal_after_ack_or_of_an_unknown_job_fails(make_queue):
    queue = await make_queue()
    await queue.enqueue(make_job("r1"))
    claimed = await queue.claim(MODEL, "w0", timeout_s=0)
    assert claimed is not None
    assert await queue.ack(claimed) is True
    assert await queue.renew(claimed) is False
    never_queued = ClaimedJob(make_job("r2", model="never-used"), "1-0", "w0", 1)
    assert await queue.renew(never_queued) is False
    assert queue.counters.num_renewed == 0
    assert await queue.depth(MODEL) == 0


async def test_renewal_of_an_expired_or_dead_lettered_job_fails(make_queue):
    queue = await make_queue(max_deliveries=2)
    await queue.enqueue(make_job("poison"))
    first = await queue.claim(MODEL, "w0", timeout_s=0)
    second = await queue.claim(MODEL, "w1", timeout_s=2.0)
    assert first is not None and second is not None and second.num_deliveries == 2
    assert await queue.claim(MODEL, "w2", timeout_s=0.5) is None  # its third delivery: dead
    assert queue.counters.num_dead_lettered == 1
    assert (await queue.renew(first), await queue.renew(second)) == (False, False)
    await queue.enqueue(make_job("late", deadline_in_s=0.2))
    late = await queue.claim(MODEL, "w0", timeout_s=0)
    assert late is not None and late.job.request_id == "late"
    await asyncio.sleep(0.25)  # past both the deadline and the idle timeout
    assert await queue.claim(MODEL, "w1", timeout_s=0) is None
    assert queue.counters.num_expired == 1
    assert await queue.renew(late) is False
    assert queue.counters.num_renewed == 0
    assert await queue.depth(MODEL) == 0


async def test_renewal_of_a_trimmed_job_fails(make_queue):
    queue = await make_queue(max_len=5)
    await queue.enqueue(make_job("r0"))
    oldest = await queue.claim(MODEL, "w0", timeout_s=0)
    assert oldest is not None
    for i in range(1, 250):
        assert await queue.enqueue(make_job(f"r{i}"))
    assert await queue.renew(oldest) is False
    assert queue.counters.num_renewed == 0


async def test_job_delivered_too_often_is_dead_lettered(make_queue):
    queue = await make_queue(max_deliveries=2, idle_timeout_s=0.1)
    job = make_job("poison")
    await queue.enqueue(job)
    await queue.enqueue(make_job("fine"))
    assert (await queue.claim(MODEL, "w0", timeout_s=0)).job.request_id == "poison"
    assert (await queue.claim(MODEL, "w0", timeout_s=0)).job.request_id == "fine"
    second = await queue.claim(MODEL, "w1", timeout_s=1.0)
    assert second is not None and (second.job.request_id, second.num_deliveries) == ("poison", 2)
    # "fine" is never acked either: its second delivery, then both hit the limit.
    third = await queue.claim(MODEL, "w2", timeout_s=1.0)
    assert third is not None and (third.job.request_id, third.num_deliveries) == ("fine", 2)
    assert await queue.claim(MODEL, "w3", timeout_s=0.5) is None
    dead = await queue.dead_letters(MODEL)
    assert [(d.job, d.num_deliveries, d.reason) for d in dead][:1] == [
        (job, 3, "delivered 3 times without ack (limit 2)")
    ]
    assert [d.job.request_id for d in dead] == ["poison", "fine"]
    assert queue.counters.num_dead_lettered == 2
    assert await queue.depth(MODEL) == 0


async def test_depth_counts_waiting_and_claimed_jobs(make_queue):
    queue = await make_queue()
    assert await queue.depth(MODEL) == 0
    for i in range(4):
        await queue.enqueue(make_job(f"r{i}"))
    claimed = await queue.claim(MODEL, "w0", timeout_s=0)
    assert await queue.depth(MODEL) == 4
    await queue.ack(claimed)
    assert await queue.depth(MODEL) == 3


async def test_undecodable_redis_entry_is_dead_lettered_with_the_reason():
    config = QueueConfig(key_prefix=f"kvgate-test-{uuid.uuid4().hex}", **FAST)
    queue = RedisPrefillQueue(REDIS_URL, config)
    client = redis.Redis.from_url(REDIS_URL)
    stream = f"{config.key_prefix}:prefill:{MODEL}"
    try:
        await queue.start()
        await client.xadd(stream, {"job": b"\xc1 not msgpack"})
        await queue.enqueue(make_job("r1"))
        claimed = await queue.claim(MODEL, "w0", timeout_s=0)
        assert claimed is not None and claimed.job.request_id == "r1"
        [dead] = await queue.dead_letters(MODEL)
        assert (dead.job, dead.num_deliveries) == (None, 1)
        assert dead.reason.startswith("undecodable job: ")
        assert queue.counters.num_dead_lettered == 1
    finally:
        await queue.close()
        await client.delete(stream, f"{stream}:dead", f"{stream}:seen:r1")
        await client.aclose()


def test_open_prefill_queue_picks_the_implementation():
    assert isinstance(open_prefill_queue(None), MemoryPrefillQueue)
    assert isinstance(open_prefill_queue(REDIS_URL), RedisPrefillQueue)
    assert isinstance(open_prefill_queue("http://127.0.0.1:8901", token="t"), HttpPrefillQueue)
    assert isinstance(open_prefill_queue("https://queue.internal"), HttpPrefillQueue)


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="QueueConfig.max_deliveries"):
        QueueConfig(max_deliveries=0)


# --- faults: a redis-server of our own ---------------------------------------------

FAULT_CONFIG = {"op_timeout_s": 0.3, "backoff_initial_s": 0.02, "backoff_max_s": 0.1, "idle_timeout_s": 30.0}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_redis(port: int, data_dir: Path, durable: bool) -> subprocess.Popen:
    """A redis-server on `port`; `durable` fsyncs every write to an AOF in `data_dir`."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed"
    persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence, "--dir", str(data_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 5.0
    while not _answers(port):
        assert proc.poll() is None, f"redis-server exited with {proc.returncode}"
        assert time.monotonic() < deadline, "redis-server did not answer within 5 s"
        time.sleep(0.01)
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(5)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2) as conn:
            conn.sendall(b"*1\r\n$4\r\nPING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


async def wait_available(queue: PrefillQueue, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not queue.is_available:
        assert time.monotonic() < deadline, "the queue did not reconnect by itself"
        await asyncio.sleep(0.01)


async def assert_unavailable_fast(queue: PrefillQueue) -> None:
    """Every operation raises QueueUnavailable, each within 1 s."""
    operations = [
        lambda: queue.enqueue(make_job("during-outage")),
        lambda: queue.claim(MODEL, "w0", timeout_s=0.5),
        lambda: queue.depth(MODEL),
        lambda: queue.renew(ClaimedJob(make_job("during-outage"), "1-0", "w0", 1)),
    ]
    for operation in operations:
        started = time.monotonic()
        with pytest.raises(QueueUnavailable):
            await operation()
        assert time.monotonic() - started < 1.0


@pytest.fixture
def redis_dir(tmp_path):
    procs: list[subprocess.Popen] = []
    yield tmp_path, procs
    for proc in procs:
        if proc.poll() is None:
            kill(proc)


async def test_unreachable_redis_raises_fast_and_start_does_not():
    queue = RedisPrefillQueue(f"redis://127.0.0.1:{free_port()}", QueueConfig(**FAULT_CONFIG))
    try:
        await queue.start()
        assert not queue.is_available
        await assert_unavailable_fast(queue)
        assert queue.counters.num_unavailable >= 4
    finally:
        await queue.close()


async def test_durable_redis_killed_and_restarted_loses_no_enqueued_job(redis_dir):
    data_dir, procs = redis_dir
    port = free_port()
    procs.append(start_redis(port, data_dir, durable=True))
    queue = RedisPrefillQueue(f"redis://127.0.0.1:{port}", QueueConfig(**FAULT_CONFIG))
    try:
        await queue.start()
        for i in range(5):
            assert await queue.enqueue(make_job(f"r{i}"))
        in_flight = await queue.claim(MODEL, "w0", timeout_s=0)
        assert in_flight is not None and in_flight.job.request_id == "r0"
        # A claim blocked on an empty queue is interrupted by the crash, not left hanging.
        blocked = asyncio.create_task(queue.claim("idle-model", "w1", timeout_s=5.0))
        await asyncio.sleep(0.05)
        kill(procs[0])
        with pytest.raises(QueueUnavailable):
            await asyncio.wait_for(blocked, 1.0)
        assert not queue.is_available
        await assert_unavailable_fast(queue)
        procs.append(start_redis(port, data_dir, durable=True))
        await wait_available(queue)
        # Jobs, the consumer group with its pending entry and dedupe keys all survive.
        assert await queue.depth(MODEL) == 5
        assert await queue.renew(in_flight) is True  # a fresh server: the script is loaded again
        assert await queue.enqueue(make_job("r3")) is False
        assert await drain(queue, "w1") == ["r1", "r2", "r3", "r4"]
        assert await queue.ack(in_flight) is True
        assert await queue.depth(MODEL) == 0
    finally:
        await queue.close()


async def test_redis_without_persistence_restarts_empty_and_queue_works_again(redis_dir):
    data_dir, procs = redis_dir
    port = free_port()
    procs.append(start_redis(port, data_dir, durable=False))
    queue = RedisPrefillQueue(f"redis://127.0.0.1:{port}", QueueConfig(**FAULT_CONFIG))
    try:
        await queue.start()
        for i in range(3):
            assert await queue.enqueue(make_job(f"r{i}"))
        held = await queue.claim(MODEL, "w0", timeout_s=0)
        assert held is not None
        kill(procs[0])
        await assert_unavailable_fast(queue)
        procs.append(start_redis(port, data_dir, durable=False))
        await wait_available(queue)
        # Nothing survives: no jobs, no group, no dedupe keys. Decode workers fall back
        # at their deadlines; the queue itself recreates what it needs.
        assert await queue.depth(MODEL) == 0
        assert await queue.renew(held) is False
        assert await queue.enqueue(make_job("r0")) is True
        assert await drain(queue) == ["r0"]
    finally:
        await queue.close()


# --- faults: the queue served over HTTP ---------------------------------------------

QUEUE_ROUTES = "/v1/prefill-queue"


@pytest.fixture
async def served():
    """A `MemoryPrefillQueue` behind a `QueueServer`; the servers and clients made are closed."""
    servers: list[QueueServer] = []
    clients: list[HttpPrefillQueue] = []

    async def serve(queue: MemoryPrefillQueue, port: int = 0, token: str | None = None) -> QueueServer:
        servers.append(QueueServer(queue, port=port, token=token))
        await servers[-1].start()
        return servers[-1]

    async def connect(url: str, token: str | None = None) -> HttpPrefillQueue:
        clients.append(HttpPrefillQueue(url, QueueConfig(**FAULT_CONFIG), token=token))
        await clients[-1].start()
        return clients[-1]

    yield serve, connect
    for client in clients:
        await client.close()
    for server in servers:
        await server.stop()


async def post(url: str, op: str, body: bytes, token: str | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}{QUEUE_ROUTES}/{op}", data=body, headers=headers) as response:
            return response.status, await response.json()


async def test_http_queue_without_server_raises_fast_and_start_does_not(served):
    _, connect = served
    queue = await connect(f"http://127.0.0.1:{free_port()}")
    assert not queue.is_available
    await assert_unavailable_fast(queue)
    assert queue.counters.num_unavailable == 4


async def test_http_queue_gives_up_within_op_timeout_on_a_silent_server(served):
    serve, connect = served
    # A socket that accepts connections (in the kernel's backlog) and never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        queue = await connect(f"http://127.0.0.1:{silent.getsockname()[1]}")
        assert 0.3 <= time.monotonic() - started < 0.5
        assert not queue.is_available
        with pytest.raises(QueueUnavailable, match=r"\(no answer within 0.3 s\); probing it in the background"):
            await queue.depth(MODEL)

    class StuckDepth(MemoryPrefillQueue):
        async def depth(self, model: str) -> int:
            await asyncio.Event().wait()
            return 0

    server = await serve(StuckDepth())
    queue = await connect(server.url)
    started = time.monotonic()
    with pytest.raises(QueueUnavailable, match="depth: no answer within 0.3 s"):
        await queue.depth(MODEL)
    assert 0.3 <= time.monotonic() - started < 0.5
    assert not queue.is_available
    await wait_available(queue)  # /health still answers: the server is back at once
    assert await queue.enqueue(make_job("r1")) is True


async def test_http_queue_server_stopped_and_restarted_on_the_same_port(served):
    serve, connect = served
    memory = MemoryPrefillQueue(QueueConfig(**FAULT_CONFIG))
    server = await serve(memory)
    queue = await connect(server.url)
    for i in range(3):
        assert await queue.enqueue(make_job(f"r{i}"))
    in_flight = await queue.claim(MODEL, "w0", timeout_s=0)
    assert in_flight is not None and in_flight.job.request_id == "r0"
    # A claim long-polling on an empty queue is ended by the stop, not left hanging.
    blocked = asyncio.create_task(queue.claim("idle-model", "w1", timeout_s=5.0))
    await asyncio.sleep(0.05)
    await server.stop()
    with pytest.raises(QueueUnavailable):
        await asyncio.wait_for(blocked, 1.0)
    assert not queue.is_available
    await assert_unavailable_fast(queue)
    await serve(memory, port=int(server.url.rsplit(":", 1)[1]))
    await wait_available(queue)
    # The served queue kept everything: jobs, the pending claim, the dedupe window.
    assert await queue.depth(MODEL) == 3
    assert await queue.enqueue(make_job("r1")) is False
    assert await drain(queue, "w1") == ["r1", "r2"]
    assert await queue.ack(in_flight) is True
    assert await queue.depth(MODEL) == 0
    assert queue.counters.num_unavailable == 5  # the blocked claim and the four above


async def test_http_queue_needs_the_servers_token(served):
    serve, connect = served
    server = await serve(MemoryPrefillQueue(), token="s3cret")
    for token in (None, "wrong"):
        queue = await connect(server.url, token=token)
        assert not queue.is_available
        expected = r"\(the server rejected the bearer token: missing or wrong bearer token for the prefill queue\)"
        with pytest.raises(QueueUnavailable, match=expected):
            await queue.enqueue(make_job("r1"))
    queue = await connect(server.url, token="s3cret")
    assert queue.is_available
    assert await queue.enqueue(make_job("r1")) is True
    status, body = await post(server.url, "depth", b"\x81\xa5model\xa1m", token="wrong")
    assert (status, body) == (
        401,
        {
            "error": {
                "message": "missing or wrong bearer token for the prefill queue",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        },
    )


async def test_http_queue_server_answers_bad_bodies_with_400(served):
    serve, _ = served
    memory = MemoryPrefillQueue()
    server = await serve(memory)
    status, body = await post(server.url, "enqueue", b"\xc1 not msgpack")
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("bad enqueue request (a msgpack EnqueueRequest is expected): ")
    status, body = await post(server.url, "enqueue", msgspec.msgpack.encode({"job": b"\x93junk"}))
    assert (status, body["error"]["code"]) == (400, "bad_job")
    claim = {"model": MODEL, "consumer": "w0", "timeout_s": -1.0}
    status, body = await post(server.url, "claim", msgspec.msgpack.encode(claim))
    assert status == 400 and body["error"]["message"].endswith("Expected `float` >= 0.0 - at `$.timeout_s`")
    status, body = await post(server.url, "claim", msgspec.msgpack.encode({"model": MODEL, "timeout_s": 1}))
    assert status == 400 and body["error"]["message"].endswith("Object missing required field `consumer`")
    bad_claim = {"job": b"", "entry_id": "1-0", "consumer": "", "num_deliveries": 1}
    status, body = await post(server.url, "renew", msgspec.msgpack.encode(bad_claim))
    assert status == 400 and body["error"]["message"] == (
        "bad renew request (a msgpack WireClaim is expected): Expected `str` of length >= 1 - at `$.consumer`"
    )
    status, body = await post(server.url, "no-such-op", b"")
    assert (status, body["error"]["type"]) == (404, "invalid_request_error")
    assert await memory.depth(MODEL) == 0


async def test_http_queue_follows_the_availability_of_the_served_queue(served):
    serve, connect = served
    memory = MemoryPrefillQueue()
    server = await serve(memory)
    queue = await connect(server.url)
    await memory.close()
    expected = "claim: 503 prefill queue unavailable: the served prefill queue is closed"
    with pytest.raises(QueueUnavailable, match=expected):
        await queue.claim(MODEL, "w0", timeout_s=0)
    assert not queue.is_available
    claim = msgspec.msgpack.encode({"model": MODEL, "consumer": "w0", "timeout_s": 0})
    status, body = await post(server.url, "claim", claim)
    assert (status, body["error"]["type"]) == (503, "queue_unavailable")
    await asyncio.sleep(0.2)
    assert not queue.is_available  # /health answers 503 while the served queue is down
    await memory.start()
    await wait_available(queue)
    assert await queue.enqueue(make_job("r1")) is True
    await queue.close()
    with pytest.raises(QueueUnavailable, match="is closed"):
        await queue.depth(MODEL)


async def test_http_claim_whose_client_vanishes_loses_no_job(served):
    serve, connect = served
    memory = MemoryPrefillQueue(QueueConfig(**{**FAULT_CONFIG, "idle_timeout_s": 0.2}))
    server = await serve(memory)
    queue = await connect(server.url)
    # A long poll abandoned while it waits takes nothing.
    waiting = asyncio.create_task(queue.claim(MODEL, "gone", timeout_s=5.0))
    await asyncio.sleep(0.05)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await asyncio.sleep(0.05)
    await queue.enqueue(make_job("r1"))
    first = await queue.claim(MODEL, "w1", timeout_s=1.0)
    assert first is not None and (first.job.request_id, first.num_deliveries) == ("r1", 1)
    assert await queue.ack(first)
    # A claim answered to a client that dies before reading the answer.
    await queue.enqueue(make_job("r2"))
    host, port = server.url.removeprefix("http://").split(":")
    request = msgspec.msgpack.encode({"model": MODEL, "consumer": "gone", "timeout_s": 0})
    with socket.create_connection((host, int(port))) as conn:
        head = f"POST {QUEUE_ROUTES}/claim HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(request)}\r\n\r\n"
        conn.sendall(head.encode() + request)
        while memory.counters.num_delivered < 2:
            await asyncio.sleep(0.01)
    started = time.monotonic()
    second = await queue.claim(MODEL, "w1", timeout_s=1.0)
    assert second is not None
    assert (second.job.request_id, second.consumer, second.num_deliveries) == ("r2", "w1", 2)
    assert time.monotonic() - started >= 0.15  # it came back once idle for the timeout
    assert await queue.ack(second)
    assert await memory.depth(MODEL) == 0


async def test_http_claim_longer_than_the_server_cap_is_split(served, monkeypatch):
    import kvstore.http_queue
    import kvstore.queue_server

    monkeypatch.setattr(kvstore.queue_server, "MAX_CLAIM_WAIT_S", 0.2)
    monkeypatch.setattr(kvstore.http_queue, "MAX_CLAIM_WAIT_S", 0.2)
    serve, connect = served
    server = await serve(MemoryPrefillQueue())
    queue = await connect(server.url)
    started = time.monotonic()
    assert await queue.claim(MODEL, "w0", timeout_s=0.5) is None
    assert 0.5 <= time.monotonic() - started < 0.8
    waiter = asyncio.create_task(queue.claim(MODEL, "w0", timeout_s=2.0))
    await asyncio.sleep(0.5)  # past two server-side long polls
    await queue.enqueue(make_job("r1"))
    claimed = await asyncio.wait_for(waiter, 1.0)
    assert claimed is not None and claimed.job.request_id == "r1"
