"""The worker registry with real HTTP health endpoints and real ZMQ event and load feeds."""

import asyncio
import time

from aiohttp import web

from indexer.hashing import hash_prompt
from indexer.load import LoadAggregator, LoadReport
from router.breaker import BreakerConfig
from router.health import HEALTHY, UNHEALTHY, HealthConfig
from router.registry import WorkerRegistry
from router.worker_spec import WorkerSpec
from worker.block_pool import BlockPool
from worker.kv_publisher import KVEventPublisher, LoadPublisher

BLOCK_SIZE = 4
FAST = HealthConfig(interval_s=0.05, timeout_s=0.5, fail_threshold=2, pass_threshold=2)


def _health_app(state: dict) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if state["up"] else 503)

    app = web.Application()
    app.router.add_get("/health", health)
    return app


def _report(worker_id: str, num_running: int) -> LoadReport:
    return LoadReport(worker_id, 0, time.time(), num_running, 0, 10, 100, 0)


async def test_lifecycle_feeds_index_and_drops_entries_on_death_and_removal(serve, wait_until):
    state = {"up": True}
    url = await serve(_health_app(state))
    pool = BlockPool(64, BLOCK_SIZE)
    tokens = list(range(1, 1 + 4 * BLOCK_SIZE))
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").start()
    loads = LoadPublisher("tcp://127.0.0.1:*")
    aggregator = LoadAggregator()
    registry = WorkerRegistry(aggregator, health_config=FAST, breaker_config=BreakerConfig())
    forgotten: list[str] = []
    registry.add_forget_listener(forgotten.append)
    spec = WorkerSpec(
        worker_id="w0", url=url, model="m", events_endpoint=publisher.bound_endpoint,
        replay_endpoint=publisher.bound_replay_endpoint, load_endpoint=loads.bound_endpoint, block_size=BLOCK_SIZE,
    )
    try:
        # Events published before the router subscribed are caught up through replay.
        pool.allocate("r0", tokens)
        pool.commit("r0", len(tokens))
        publisher.publish(pool.take_events())
        worker, created = await registry.add(spec)
        assert created and registry.get("w0") is worker
        index = registry.indexes[BLOCK_SIZE]
        await wait_until(lambda: worker.health.status == HEALTHY and worker.is_eligible, what="healthy")
        # The subscriber catches up when it sees its first live batch (ZMQ's slow joiner
        # may lose the first few: keep publishing one more block until one arrives).
        extra = 0

        def one_more_block() -> bool:
            nonlocal extra
            if registry.num_index_blocks("w0") >= 5:
                return True
            extra += 1
            pool.allocate(f"x{extra}", [1000 + extra] * BLOCK_SIZE)
            pool.commit(f"x{extra}", BLOCK_SIZE)
            publisher.publish(pool.take_events())
            return False

        await wait_until(one_more_block, what="indexed blocks")
        assert index.find_matches(hash_prompt(tokens, BLOCK_SIZE, "m")) == {("w0", 0): 4}
        num_blocks = registry.num_index_blocks("w0")
        assert num_blocks == len(pool.cached_block_hashes())
        await wait_until(lambda: (loads.publish(_report("w0", 3)), aggregator.get(("w0", 0)))[1] is not None)
        assert registry.eligible() == [worker]
        assert registry.healthy_models() == ["m"]

        # A heartbeat (identical spec) changes nothing.
        assert await registry.add(spec) == (worker, False)

        # Death: out of rotation, entries and load dropped, listeners told.
        state["up"] = False
        await wait_until(lambda: worker.health.status == UNHEALTHY, what="unhealthy")
        assert not worker.is_eligible and registry.eligible() == []
        await wait_until(lambda: forgotten == ["w0"], what="forget listener")
        assert registry.num_index_blocks("w0") == 0 and index.workers() == []
        assert aggregator.get(("w0", 0)) is None
        assert registry.healthy_models() == []

        # Back up: a fresh subscriber catches up from seq 0 through replay.
        state["up"] = True
        await wait_until(lambda: worker.is_eligible, what="healthy again")
        await wait_until(one_more_block, what="re-indexed")
        assert index.find_matches(hash_prompt(tokens, BLOCK_SIZE, "m")) == {("w0", 0): 4}
        stats = worker.event_stats()
        # Both subscribers read the replay buffer from seq 0 when they connect, so nothing was lost.
        assert stats["num_replays"] >= 2 and stats["num_resyncs"] == 0 and stats["num_malformed"] == 0

        # A changed spec replaces the worker; the old one's entries go first.
        moved = WorkerSpec(worker_id="w0", url=url, model="m2", block_size=BLOCK_SIZE)
        replacement, created = await registry.add(moved)
        assert created and replacement is not worker and registry.get("w0") is replacement
        assert index.workers() == [] and forgotten == ["w0", "w0"]

        assert await registry.remove("w0") is True
        assert await registry.remove("w0") is False
        assert registry.workers == {} and forgotten == ["w0", "w0", "w0"]
    finally:
        await registry.close()
        publisher.close()
        loads.close()


async def test_drain_and_breaker_take_a_worker_out_of_rotation(serve, wait_until):
    url = await serve(_health_app({"up": True}))
    registry = WorkerRegistry(LoadAggregator(), health_config=FAST, breaker_config=BreakerConfig(failure_threshold=1))
    try:
        worker, _ = await registry.add(WorkerSpec(worker_id="a", url=url, model="m"))
        other, _ = await registry.add(WorkerSpec(worker_id="b", url=url, model="n", block_size=32, role="prefill"))
        await wait_until(lambda: worker.is_eligible and other.is_eligible)
        assert registry.drain("a") is worker and not worker.is_eligible
        assert registry.eligible() == [other]
        registry.drain("a", False)
        worker.breaker.record_failure()
        assert registry.eligible() == [other]
        assert registry.drain("nobody") is None
        assert sorted(registry.indexes) == [16, 32]
        assert registry.healthy_models() == ["m", "n"]
        assert registry.healthy_models({"both", "decode"}) == ["m"]  # "n" has only a prefill worker
    finally:
        await registry.close()


async def test_an_unreachable_worker_never_enters_rotation(wait_until):
    registry = WorkerRegistry(LoadAggregator(), health_config=FAST)
    try:
        worker, _ = await registry.add(WorkerSpec(worker_id="gone", url="http://127.0.0.1:9", model="m"))
        await wait_until(lambda: worker.health.status == UNHEALTHY)
        assert "ClientConnectorError" in worker.health.last_error
        assert registry.eligible() == []
    finally:
        await registry.close()


async def test_self_registered_workers_lapse_when_down_and_silent(wait_until):
    registry = WorkerRegistry(LoadAggregator(), health_config=FAST, expiry_s=0.2)
    forgotten: list[str] = []
    registry.add_forget_listener(forgotten.append)
    try:
        dynamic, _ = await registry.add(WorkerSpec(worker_id="dyn", url="http://127.0.0.1:9", model="m"), expires=True)
        static, _ = await registry.add(WorkerSpec(worker_id="static", url="http://127.0.0.1:9", model="m"))
        await wait_until(lambda: dynamic.health.status == UNHEALTHY and static.health.status == UNHEALTHY)
        await wait_until(lambda: "dyn" not in registry.workers, what="the lapsed registration removed")
        assert registry.get("static") is static and "dyn" in forgotten
        # A heartbeat keeps a registration alive even while its worker is down.
        again, _ = await registry.add(WorkerSpec(worker_id="dyn", url="http://127.0.0.1:9", model="m"), expires=True)
        for _ in range(6):
            await asyncio.sleep(0.05)
            assert (await registry.add(again.spec, expires=True)) == (again, False)
        assert registry.get("dyn") is again
    finally:
        await registry.close()
