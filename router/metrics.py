"""The router's Prometheus metrics, in a registry of its own per app.

Owns every metric `GET /metrics` shows. Event metrics (requests by route and status,
router overhead, TTFT, request duration, routing decisions by policy and worker,
prefix blocks, retries, upstream errors, prefill decisions) are updated by the
handlers, the routing core and the proxy through `GatewayMetrics`. Everything that is
state rather than an event (worker health and load, index size, KV event counters,
in-flight requests) is read from the registry at scrape time, so it costs nothing per
request and can never drift from the truth; so is the prefill queue's state (depth
per model, availability, outages), read from its
`router.prefill_poller.PrefillQueueMonitor` when disaggregation is active.

NOTE: the event metrics are plain ints and lists, not prometheus_client children: an
update is a dict lookup and an increment, with none of the locks prometheus_client
takes for threads, because only the event loop's thread ever updates them (this runs
several times per request). A collector turns them into metric families at scrape time.
A route's counts and durations live in one `RouteMetrics`, found with one lookup.

Invariants: one `CollectorRegistry` per app (tests run many apps in one process);
counters only go up (retired event subscribers' counts are kept by the registry).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from router.registry import EVENT_COUNTERS, WorkerRegistry

if TYPE_CHECKING:
    from router.prefill_poller import PrefillQueueMonitor

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_FAST_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
_SLOW_BUCKETS = (1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_EVENT_METRICS = {
    "num_batches": ("kvgate_kv_event_batches", "KV event batches applied to the index"),
    "num_events": ("kvgate_kv_events_applied", "KV events applied to the index"),
    "num_gaps": ("kvgate_kv_event_gaps", "gaps in a worker's KV event sequence"),
    "num_replays": ("kvgate_kv_event_replays", "KV event batches recovered through replay"),
    "num_resyncs": ("kvgate_kv_event_resyncs", "times a worker's index entries were cleared for lost events"),
    "num_malformed": ("kvgate_kv_events_malformed", "malformed KV event messages skipped"),
}
assert set(_EVENT_METRICS) == set(EVENT_COUNTERS)


class _Histogram:
    """Bucket counts (not cumulative), a count and a sum."""

    __slots__ = ("bounds", "counts", "num", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.num = 0
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.num += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        buckets, running = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            running += count
            buckets.append((bound, running))
        return buckets


class RouteMetrics:
    """One route's answers by status and its request durations; handlers hold it bound."""

    __slots__ = ("by_status", "durations")

    def __init__(self) -> None:
        self.by_status: dict[int, int] = {}
        self.durations = _Histogram(_SLOW_BUCKETS)

    def observe(self, status: int, duration_s: float) -> None:
        by_status = self.by_status
        by_status[status] = by_status.get(status, 0) + 1
        self.durations.observe(duration_s)


class GatewayMetrics:
    """See the module docstring."""

    def __init__(
        self, registry: WorkerRegistry, num_in_flight: Callable[[], int],
        prefill_monitor: PrefillQueueMonitor | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.routes: dict[str, RouteMetrics] = {}  # route -> its counts and durations
        self.overhead = _Histogram(_FAST_BUCKETS)
        self.ttft = _Histogram(_SLOW_BUCKETS)
        self.decisions: dict[tuple[str, str], int] = {}  # (policy, worker) -> count
        self.retries: dict[str, int] = {}  # reason -> count
        self.upstream_errors: dict[tuple[str, str], int] = {}  # (worker, kind) -> count
        self.prefill_decisions: dict[tuple[str, str], int] = {}  # (remote|local, reason) -> count
        self.num_matched_blocks = 0
        self.num_prompt_blocks = 0
        self.registry.register(_EventCollector(self))
        self.registry.register(_StateCollector(registry, num_in_flight, self))
        if prefill_monitor is not None:
            self.registry.register(_PrefillQueueCollector(prefill_monitor))

    def route(self, route: str) -> RouteMetrics:
        """The metrics of `route`, created on first use (handlers look it up once per request)."""
        metrics = self.routes.get(route)
        if metrics is None:
            metrics = self.routes[route] = RouteMetrics()
        return metrics

    def observe_request(self, route: str, status: int, duration_s: float) -> None:
        self.route(route).observe(status, duration_s)

    def observe_overhead(self, seconds: float) -> None:
        self.overhead.observe(seconds)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_decision(self, policy: str, worker_id: str, num_matched: int, num_blocks: int) -> None:
        key = (policy, worker_id)
        decisions = self.decisions
        decisions[key] = decisions.get(key, 0) + 1
        self.num_matched_blocks += num_matched
        self.num_prompt_blocks += num_blocks

    def observe_prefill(self, decision: str, reason: str) -> None:
        key = (decision, reason)
        self.prefill_decisions[key] = self.prefill_decisions.get(key, 0) + 1

    def observe_retry(self, reason: str) -> None:
        self.retries[reason] = self.retries.get(reason, 0) + 1

    def observe_upstream_error(self, worker_id: str, kind: str) -> None:
        key = (worker_id, kind)
        self.upstream_errors[key] = self.upstream_errors.get(key, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EventCollector(Collector):
    """`GatewayMetrics`' counts as metric families, at scrape time."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        m = self._metrics
        yield _counter("kvgate_requests", "requests answered, by route and status", ["route", "status"],
                       {(route, str(status)): n for route, r in m.routes.items() for status, n in r.by_status.items()})
        yield _counter("kvgate_routing_decisions", "requests routed, by policy and worker", ["policy", "worker"],
                       m.decisions)
        yield _counter("kvgate_retries", "attempts retried on another worker, by reason", ["reason"],
                       {(reason,): n for reason, n in m.retries.items()})
        yield _counter("kvgate_upstream_errors", "failed attempts on a worker, by kind", ["worker", "kind"],
                       m.upstream_errors)
        yield _counter("kvgate_disagg_decisions", "prefill decisions of dispatched attempts, by decision and reason",
                       ["decision", "reason"], m.prefill_decisions)
        yield _counter("kvgate_prefix_matched_blocks", "prompt blocks already cached on the chosen worker", [],
                       {(): m.num_matched_blocks})
        yield _counter("kvgate_prefix_prompt_blocks", "full prompt blocks of routed requests", [],
                       {(): m.num_prompt_blocks})
        yield _histogram("kvgate_router_overhead_seconds", "time from a request's arrival to its dispatch to a worker",
                         [], {(): m.overhead})
        yield _histogram("kvgate_ttft_seconds", "time from a streamed request's arrival to its first byte to the client",
                         [], {(): m.ttft})
        yield _histogram("kvgate_request_duration_seconds", "time from a request's arrival to its last byte", ["route"],
                         {(route, ): r.durations for route, r in m.routes.items()})


def _counter(name: str, text: str, labels: list[str], values: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


def _histogram(name: str, text: str, labels: list[str], histograms: dict) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, text, labels=labels)
    for key, histogram in sorted(histograms.items()):
        family.add_metric(list(key), histogram.cumulative(), histogram.total)
    return family


class _StateCollector(Collector):
    """Registry state as metrics, read at scrape time."""

    def __init__(self, registry: WorkerRegistry, num_in_flight: Callable[[], int], metrics: GatewayMetrics) -> None:
        self._registry = registry
        self._num_in_flight = num_in_flight
        self._metrics = metrics

    def describe(self) -> list:
        return []  # dynamic: nothing to check against other collectors' names up front

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from self._worker_gauges()
        yield from self._event_counters()
        yield from self._index_gauges()
        in_flight = GaugeMetricFamily("kvgate_in_flight_requests", "requests the router is serving now")
        in_flight.add_metric([], self._num_in_flight())
        yield in_flight
        matched, total = self._metrics.num_matched_blocks, self._metrics.num_prompt_blocks
        hit_rate = GaugeMetricFamily("kvgate_prefix_hit_rate", "matched / total prompt blocks of routed requests")
        hit_rate.add_metric([], matched / total if total else 0.0)
        yield hit_rate

    def _worker_gauges(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily("kvgate_worker_healthy", "1 when a worker passes its health checks", labels=["worker"])
        eligible = GaugeMetricFamily("kvgate_worker_eligible", "1 when a worker is in rotation", labels=["worker"])
        in_flight = GaugeMetricFamily("kvgate_worker_in_flight", "requests in flight per worker", labels=["worker"])
        blocks = GaugeMetricFamily("kvgate_worker_index_blocks", "KV blocks indexed per worker", labels=["worker"])
        hit_rate = GaugeMetricFamily("kvgate_worker_prefix_hit_rate", "prefix hit rate per worker", labels=["worker"])
        for worker_id, worker in self._registry.workers.items():
            healthy.add_metric([worker_id], 1.0 if worker.health.is_healthy else 0.0)
            eligible.add_metric([worker_id], 1.0 if worker.is_eligible else 0.0)
            in_flight.add_metric([worker_id], worker.num_in_flight)
            blocks.add_metric([worker_id], self._registry.num_index_blocks(worker_id))
            hit_rate.add_metric([worker_id], worker.prefix_hit_rate)
        yield from (healthy, eligible, in_flight, blocks, hit_rate)

    def _event_counters(self) -> Iterator[CounterMetricFamily]:
        families = {
            name: CounterMetricFamily(metric, help_text, labels=["worker"])
            for name, (metric, help_text) in _EVENT_METRICS.items()
        }
        for worker_id, worker in self._registry.workers.items():
            for name, value in worker.event_stats().items():
                families[name].add_metric([worker_id], value)
        yield from families.values()

    def _index_gauges(self) -> Iterator[GaugeMetricFamily]:
        blocks = GaugeMetricFamily("kvgate_index_blocks", "distinct blocks in the prefix index", labels=["block_size"])
        entries = GaugeMetricFamily("kvgate_index_entries", "(block, worker) entries in the prefix index", labels=["block_size"])
        size = GaugeMetricFamily("kvgate_index_bytes", "estimated memory of the prefix index", labels=["block_size"])
        dropped = GaugeMetricFamily(
            "kvgate_index_dropped_stores", "stored blocks the index refused (malformed or unknown parent)",
            labels=["block_size", "reason"],
        )
        for block_size, index in sorted(self._registry.indexes.items()):
            stats = index.stats()
            label = str(block_size)
            blocks.add_metric([label], stats.num_blocks)
            entries.add_metric([label], stats.num_entries)
            size.add_metric([label], stats.num_bytes)
            dropped.add_metric([label, "malformed"], stats.num_malformed)
            dropped.add_metric([label, "unknown_parent"], stats.num_unknown_parent)
        yield from (blocks, entries, size, dropped)


class _PrefillQueueCollector(Collector):
    """The prefill queue as the router sees it, read at scrape time."""

    def __init__(self, monitor: PrefillQueueMonitor) -> None:
        self._monitor = monitor

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        monitor = self._monitor
        depth = GaugeMetricFamily(
            "kvgate_prefill_queue_depth", "last polled depth of the prefill queue, per model with a prefill worker",
            labels=["model"],
        )
        for model, value in sorted(monitor.decider.polled_depths().items()):
            if value is not None:
                depth.add_metric([model], value)
        yield depth
        available = GaugeMetricFamily("kvgate_prefill_queue_available", "1 while the prefill queue answers")
        available.add_metric([], 1.0 if monitor.is_available else 0.0)
        yield available
        yield _counter("kvgate_prefill_queue_unavailable", "times the prefill queue became unreachable", [],
                       {(): monitor.num_outages})
        yield _counter("kvgate_prefill_queue_polls", "depth polls of the prefill queue", [], {(): monitor.num_polls})
        yield _counter("kvgate_prefill_queue_poll_failures", "depth polls that found the prefill queue unreachable",
                       [], {(): monitor.num_failed_polls})
