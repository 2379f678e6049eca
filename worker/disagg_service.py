"""A worker's disaggregation role, assembled: the queue, the KV port, the decode or prefill half.

Owns `DisaggService`, which `kvgate worker --role decode|prefill` adds to its app:
it opens the global prefill queue (`kvstore.prefill_queue.open_prefill_queue`), starts
the KV port (`KVIngress` for decode, `KVEgress` for prefill) and runs
`worker.disagg.DecodeLink` or `PrefillLoop` after the engine has started, closing
them before it stops (an aiohttp cleanup context); it reports the queue's state on
`/health` and its counters on `/metrics` (`DisaggCollector`).

Invariants: an unreachable queue never stops the worker: a decode worker prefills
locally while it is down, a prefill worker retries with backoff; `/health` stays 200
and says so. Role `both` runs none of this (aggregated serving).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.prefill_queue import PrefillQueue
from worker.disagg import DecodeLink, DisaggEngine, KVEgress, KVIngress, PrefillLoop

logger = logging.getLogger(__name__)


class DisaggService:
    """See the module docstring."""

    def __init__(
        self, role: str, queue: PrefillQueue, engine: DisaggEngine, *, model: str, worker_id: str,
        block_size: int, ingress: Callable[[], Awaitable[KVIngress]] | None = None,
        egress: Callable[[], KVEgress] | None = None, max_jobs: int = 8,
    ) -> None:
        if role not in ("decode", "prefill"):
            raise ValueError(f"role must be decode or prefill, got {role!r}")
        if (ingress if role == "decode" else egress) is None:
            raise ValueError(f"a {role} worker needs its KV port")
        self.role = role
        self.queue = queue
        self.engine = engine
        self._model, self._worker_id, self._block_size, self._max_jobs = model, worker_id, block_size, max_jobs
        self._make_ingress, self._make_egress = ingress, egress
        self.link: DecodeLink | PrefillLoop | None = None

    async def start(self) -> None:
        """Connects to the queue (never raises for an unreachable one) and starts the role's half."""
        await self.queue.start()
        if self.role == "decode":
            assert self._make_ingress is not None
            self.link = DecodeLink(
                self.queue, await self._make_ingress(), self.engine,
                model=self._model, worker_id=self._worker_id, block_size=self._block_size,
            )
        else:
            assert self._make_egress is not None
            loop = PrefillLoop(
                self.queue, self._make_egress(), self.engine, model=self._model,
                consumer=self._worker_id, block_size=self._block_size, max_jobs=self._max_jobs,
            )
            loop.start()
            self.link = loop
        logger.info("%s worker %s: prefill queue %s", self.role, self._worker_id,
                    "reachable" if self.queue.is_available else "unreachable for now")

    async def close(self) -> None:
        if self.link is not None:
            await self.link.close()
        await self.queue.close()

    async def cleanup_ctx(self, app: web.Application) -> AsyncIterator[None]:
        """Add to the worker app after the engine's context: starts after it, stops before it."""
        await self.start()
        yield
        await self.close()

    def status(self) -> dict[str, Any]:
        """The `/health` detail."""
        return {"role": self.role, "prefill_queue": {"available": self.queue.is_available}}

    def counters(self) -> dict[str, int]:
        values = self.link.counters.snapshot() if self.link is not None else {}
        return values | self.engine.remote_counters.snapshot()


class DisaggCollector(Collector):
    """`kvgate_worker_disagg_*` counters and the queue's availability, read at scrape time."""

    def __init__(self, service: DisaggService) -> None:
        self._service = service

    def collect(self) -> list[Metric]:
        metrics: list[Metric] = [
            GaugeMetricFamily(
                "kvgate_worker_prefill_queue_available", "1 while the global prefill queue is reachable",
                value=int(self._service.queue.is_available),
            )
        ]
        for name, value in self._service.counters().items():
            doc = f"Disaggregation total: {name.removeprefix('num_').replace('_', ' ')}"
            metrics.append(CounterMetricFamily(f"kvgate_worker_disagg_{name.removeprefix('num_')}", doc, value=value))
        for name, value in self._service.queue.counters.snapshot().items():
            doc = f"Prefill queue operations by this worker: {name.removeprefix('num_').replace('_', ' ')}"
            metrics.append(CounterMetricFamily(f"kvgate_worker_prefill_queue_{name.removeprefix('num_')}", doc, value=value))
        return metrics
