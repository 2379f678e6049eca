"""The worker registry: every worker the router may send to, with its live state and feeds.

Owns, per worker: its `WorkerSpec`, health (`router.health`), draining flag, circuit
breaker (`router.breaker`), request counters, and the lifecycles of its
`EventSubscriber` (KV events into the prefix index of its block size) and
`LoadSubscriber` (load reports into the shared `LoadAggregator`). Also owns those
prefix indexes, one per distinct block size. Callers: the app's startup (static
workers), the admin API (add, remove, drain), the candidate builder (`eligible`), the
health monitor (`on_health_change`), metrics and stats (read only).

Invariants:
- A worker is eligible only when healthy, not draining and its breaker allows it.
- A removed worker, and a worker that becomes unhealthy, has no entries left in any
  index, no load report held, and no predicted load (`forget` listeners): its event
  subscriber is stopped so nothing refills the index, and a fresh one (catching up
  through replay) starts when the worker is healthy again.
- Re-registering an identical spec is a heartbeat and changes nothing; a changed spec
  replaces the worker (its old index entries and feeds are dropped first).
- A worker registered through the admin API (`expires=True`) that is unhealthy and has
  not re-registered for `expiry_s` is removed; configured workers never are.
Mutations happen on the event loop, never across an `await` of another mutation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

import zmq.asyncio

from indexer.index import PrefixIndex
from indexer.load import LoadAggregator, LoadSubscriber
from indexer.subscriber import EventSubscriber
from router.breaker import BreakerConfig, CircuitBreaker
from router.health import HEALTHY, HealthConfig, HealthMonitor, HealthState
from router.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

EVENT_COUNTERS = ("num_batches", "num_events", "num_gaps", "num_replays", "num_resyncs", "num_malformed")


class Worker:
    """One registered worker and everything the router keeps about it."""

    __slots__ = (
        "spec", "health", "breaker", "draining", "event_subscriber", "load_subscriber",
        "registered_at", "last_heartbeat_at", "last_seen", "expires", "num_requests", "num_failures", "num_in_flight",
        "num_matched_blocks", "num_prompt_blocks", "retired_event_stats",
    )

    def __init__(
        self, spec: WorkerSpec, health_config: HealthConfig, breaker_config: BreakerConfig, expires: bool = False
    ) -> None:
        self.spec = spec
        self.expires = expires  # self-registered: lapses when down and no longer re-registering
        self.last_seen = time.monotonic()  # of the last registration or heartbeat
        self.health = HealthState(health_config)
        self.breaker = CircuitBreaker(breaker_config)
        self.draining = False
        self.event_subscriber: EventSubscriber | None = None
        self.load_subscriber: LoadSubscriber | None = None
        self.registered_at = self.last_heartbeat_at = time.time()
        self.num_requests = 0  # requests sent here (attempts, retries included)
        self.num_failures = 0  # attempts that failed in transport or with a 5xx
        self.num_in_flight = 0
        self.num_matched_blocks = 0  # prompt blocks found cached here when routed here
        self.num_prompt_blocks = 0
        # Counters of event subscribers already stopped, so totals never go backwards.
        self.retired_event_stats = dict.fromkeys(EVENT_COUNTERS, 0)

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @property
    def is_eligible(self) -> bool:
        return self.health.status == HEALTHY and not self.draining and self.breaker.allows()

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_matched_blocks / self.num_prompt_blocks if self.num_prompt_blocks else 0.0

    def event_stats(self) -> dict[str, int]:
        """KV event counters over every subscriber this worker had (see `EVENT_COUNTERS`)."""
        totals = dict(self.retired_event_stats)
        if self.event_subscriber is not None:
            stats = self.event_subscriber.stats
            for name in EVENT_COUNTERS:
                totals[name] += getattr(stats, name)
        return totals


ForgetListener = Callable[[str], None]
"""Called with a worker id whose load state must be dropped (removal or death)."""


class WorkerRegistry:
    """See the module docstring. Create and `close()` it inside a running event loop."""

    def __init__(
        self,
        aggregator: LoadAggregator,
        *,
        health_config: HealthConfig | None = None,
        breaker_config: BreakerConfig | None = None,
        replay_timeout_s: float = 1.0,
        expiry_s: float = 60.0,
    ) -> None:
        if expiry_s <= 0:
            raise ValueError("expiry_s must be positive")
        self.aggregator = aggregator
        self.expiry_s = expiry_s
        self.health_config = health_config or HealthConfig()
        self.breaker_config = breaker_config or BreakerConfig()
        self.replay_timeout_s = replay_timeout_s
        self.workers: dict[str, Worker] = {}
        self.indexes: dict[int, PrefixIndex] = {}
        self._forget_listeners: list[ForgetListener] = [self._forget_load_reports]
        self._context = zmq.asyncio.Context()
        self._monitor = HealthMonitor(self.health_config, self.on_health_change)
        self._stopping: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._closed = False

    def add_forget_listener(self, listener: ForgetListener) -> None:
        self._forget_listeners.append(listener)

    # -- membership ----------------------------------------------------------------

    async def add(self, spec: WorkerSpec, *, expires: bool = False) -> tuple[Worker, bool]:
        """Registers `spec`; returns the worker and whether it is new (False: a heartbeat).

        `expires`: the registration lapses if heartbeats stop while the worker is down.
        """
        if self._closed:
            raise RuntimeError("the registry is closed")
        held = self.workers.get(spec.worker_id)
        if held is not None and held.spec == spec:
            held.last_heartbeat_at = time.time()
            held.last_seen = time.monotonic()
            held.expires = held.expires and expires
            return held, False
        if held is not None:
            logger.info("worker %s re-registered with a new spec: replacing it", spec.worker_id)
            await self.remove(spec.worker_id)
        worker = Worker(spec, self.health_config, self.breaker_config, expires)
        self.workers[spec.worker_id] = worker
        if expires and self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="registry expiry")
        self.index_for(spec.block_size).set_model(spec.worker_id, spec.model)
        if spec.load_endpoint is not None:
            worker.load_subscriber = LoadSubscriber(self.aggregator, spec.load_endpoint, context=self._context)
            worker.load_subscriber.start()
        self._monitor.watch(spec.worker_id, spec.url, worker.health)
        logger.info("worker %s registered at %s (model %s)", spec.worker_id, spec.url, spec.model)
        return worker, True

    async def remove(self, worker_id: str) -> bool:
        """Forgets a worker, its feeds and its index entries; False if it was unknown."""
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return False
        await self._monitor.unwatch(worker_id)
        await self._stop_events(worker)
        if worker.load_subscriber is not None:
            await worker.load_subscriber.stop()
            worker.load_subscriber = None
        self._forget(worker)
        logger.info("worker %s removed", worker_id)
        return True

    async def _sweep(self) -> None:
        """Removes lapsed registrations (see the module docstring), every quarter expiry."""
        while True:
            await asyncio.sleep(min(5.0, self.expiry_s / 4))
            now = time.monotonic()
            for worker in list(self.workers.values()):
                lapsed = worker.expires and not worker.health.is_healthy and now - worker.last_seen > self.expiry_s
                if lapsed and self.workers.get(worker.worker_id) is worker:
                    logger.warning("worker %s is down and stopped re-registering: removing it", worker.worker_id)
                    await self.remove(worker.worker_id)

    def drain(self, worker_id: str, draining: bool = True) -> Worker | None:
        """Takes a worker out of rotation for new requests (its streams finish)."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.draining = draining
        return worker

    def get(self, worker_id: str) -> Worker | None:
        return self.workers.get(worker_id)

    def index_for(self, block_size: int) -> PrefixIndex:
        index = self.indexes.get(block_size)
        if index is None:
            index = self.indexes[block_size] = PrefixIndex(block_size)
        return index

    # -- queries -------------------------------------------------------------------

    def eligible(self) -> list[Worker]:
        return [worker for worker in self.workers.values() if worker.is_eligible]

    def healthy_models(self, roles: Collection[str] | None = None) -> list[str]:
        """Models served by at least one healthy worker (of one of `roles`, if given), sorted, each once."""
        return sorted({
            w.spec.model for w in self.workers.values()
            if w.health.status == HEALTHY and (roles is None or w.spec.role in roles)
        })

    def num_index_blocks(self, worker_id: str) -> int:
        worker = self.workers.get(worker_id)
        if worker is None:
            return 0
        index = self.indexes.get(worker.spec.block_size)
        if index is None:
            return 0
        return sum(index.num_blocks(key) for key in index.workers() if key[0] == worker_id)

    # -- health --------------------------------------------------------------------

    def on_health_change(self, worker_id: str, status: str) -> None:
        """A worker came up or went down: start or stop its events, drop its entries."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        if status == HEALTHY:
            worker.breaker.reset()
            self._start_events(worker)
            return
        # Not eligible from now on; its entries go once its feed has stopped, so the
        # feed cannot refill them in between.
        task = asyncio.get_running_loop().create_task(self._retire(worker))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _retire(self, worker: Worker) -> None:
        await self._stop_events(worker)
        if self.workers.get(worker.spec.worker_id) is worker and worker.health.status != HEALTHY:
            self._forget(worker)

    def _start_events(self, worker: Worker) -> None:
        spec = worker.spec
        if spec.events_endpoint is None or worker.event_subscriber is not None:
            return
        subscriber = EventSubscriber(
            self.index_for(spec.block_size), spec.worker_id, spec.events_endpoint, spec.replay_endpoint,
            replay_timeout_s=self.replay_timeout_s, context=self._context,
        )
        worker.event_subscriber = subscriber
        subscriber.start()

    async def _stop_events(self, worker: Worker) -> None:
        subscriber, worker.event_subscriber = worker.event_subscriber, None
        if subscriber is not None:
            await subscriber.stop()
            for name in EVENT_COUNTERS:
                worker.retired_event_stats[name] += getattr(subscriber.stats, name)

    def _forget(self, worker: Worker) -> None:
        worker_id = worker.spec.worker_id
        index = self.indexes.get(worker.spec.block_size)
        if index is not None:
            for key in [key for key in index.workers() if key[0] == worker_id]:
                index.remove_worker(key)
        for listener in self._forget_listeners:
            listener(worker_id)

    def _forget_load_reports(self, worker_id: str) -> None:
        for key in [key for key in self.aggregator.reports() if key[0] == worker_id]:
            self.aggregator.remove(key)

    # -- lifecycle -----------------------------------------------------------------

    async def close(self) -> None:
        """Stops every probe and feed; the registry cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait([self._sweeper])
        await self._monitor.close()
        for worker in list(self.workers.values()):
            await self._stop_events(worker)
            if worker.load_subscriber is not None:
                await worker.load_subscriber.stop()
                worker.load_subscriber = None
        if self._stopping:
            await asyncio.wait(list(self._stopping))
        self._context.term()
