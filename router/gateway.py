"""One router app's live state: the validated config and every object a request touches.

Owns `GatewayConfig` (all that `kvgate router` configures) and `Gateway`, built inside
the app's cleanup context (`router.app`) because its registry, probes, feeds,
upstream session and prefill queue poller need the running loop; `Gateway.start()`
starts the poller, `Gateway.close()` releases them all. Handlers reach it through the
typed `GATEWAY` app key (the admin sub-app through `request.config_dict`).

Disaggregation (`router.disagg`) is active when the gateway has a prefill queue: one
it opened from `DisaggConfig.prefill_queue_url`, or one its caller handed in.

Invariants: `num_in_flight` counts requests between admission and their last byte;
request ids are unique within the process (the load tracker keys on them).
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field

from aiohttp import web

from indexer.load import LoadAggregator, LoadReport
from indexer.tokenizer import Tokenizer
from kvstore.prefill_queue import PrefillQueue, open_prefill_queue
from router.breaker import BreakerConfig
from router.disagg import DisaggConfig, PrefillDecider
from router.errors import Unauthorized
from router.health import HealthConfig
from router.load_tracker import LoadTracker
from router.metrics import GatewayMetrics
from router.policy import Policy
from router.policy.config import PolicyConfig
from router.prefill_poller import PrefillQueueMonitor
from router.proxy import Forwarder, ProxyConfig
from router.registry import WorkerRegistry
from router.requests import RequestLimits
from router.routing import RoutingCore
from router.upstream import UpstreamPool
from router.worker_spec import WorkerSpec


@dataclass(frozen=True)
class GatewayConfig:
    """Everything `kvgate router` configures; validated by `build_app`."""

    workers: tuple[WorkerSpec, ...] = ()
    policy: str = "kv"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    tokenizer: str = "byte"
    limits: RequestLimits = field(default_factory=RequestLimits)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    max_concurrent_requests: int = 4096
    api_keys: tuple[str, ...] = ()
    admin_token: str | None = None
    forward_token_ids: bool = True
    load_max_age_s: float = 2.0
    replay_timeout_s: float = 1.0
    worker_expiry_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be at least 1")
        if self.load_max_age_s <= 0 or self.replay_timeout_s <= 0 or self.worker_expiry_s <= 0:
            raise ValueError("load_max_age_s, replay_timeout_s and worker_expiry_s must be positive")


class TrackedAggregator(LoadAggregator):
    """The latest reports, each also handed to the load tracker as its new baseline."""

    def __init__(self, tracker: LoadTracker, max_age_s: float) -> None:
        super().__init__(max_age_s=max_age_s)
        self._tracker = tracker

    def update(self, report: LoadReport) -> bool:
        taken = super().update(report)
        if taken:
            self._tracker.apply_report(report)
        return taken


class Gateway:
    """The live state of one app, built in its cleanup context (see the module docstring)."""

    def __init__(
        self, config: GatewayConfig, tokenizer: Tokenizer, policy: Policy, prefill_queue: PrefillQueue | None = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.limits = config.limits
        self.forward_token_ids = config.forward_token_ids
        self.max_concurrent_requests = config.max_concurrent_requests
        self.tracker = LoadTracker(max_report_age_s=config.load_max_age_s)
        self.aggregator = TrackedAggregator(self.tracker, config.load_max_age_s)
        self.registry = WorkerRegistry(
            self.aggregator, health_config=config.health, breaker_config=config.breaker,
            replay_timeout_s=config.replay_timeout_s, expiry_s=config.worker_expiry_s,
        )
        self.num_in_flight = 0
        self.disagg = PrefillDecider(
            config.disagg, is_enabled=prefill_queue is not None or bool(config.disagg.prefill_queue_url)
        )
        self.prefill_monitor = self._prefill_monitor(config.disagg, prefill_queue)
        self.metrics = GatewayMetrics(self.registry, lambda: self.num_in_flight, self.prefill_monitor)
        self.core = RoutingCore(self.registry, self.aggregator, self.tracker, policy, self.metrics, self.disagg)
        self.pool = UpstreamPool(config.proxy.connect_timeout_s, config.proxy.read_timeout_s)
        self.forwarder = Forwarder(self.pool, config.proxy, self.metrics)
        self.started_at = int(time.time())
        self._authorized = frozenset(f"Bearer {key}" for key in config.api_keys)
        self._request_ids = itertools.count()
        self._request_prefix = f"kvg-{os.getpid():x}-{self.started_at:x}-"

    def _prefill_monitor(self, config: DisaggConfig, injected: PrefillQueue | None) -> PrefillQueueMonitor | None:
        if injected is not None:
            return PrefillQueueMonitor(injected, self.disagg, self.registry, config.poll_interval_s, owns_queue=False)
        if not config.prefill_queue_url:
            return None
        queue = open_prefill_queue(config.prefill_queue_url, token=config.prefill_queue_token)
        return PrefillQueueMonitor(queue, self.disagg, self.registry, config.poll_interval_s, owns_queue=True)

    async def start(self) -> None:
        """Starts what needs the gateway built first (the prefill queue poller)."""
        if self.prefill_monitor is not None:
            await self.prefill_monitor.start()

    def authorize(self, request: web.Request) -> None:
        if self._authorized and request.headers.get("Authorization") not in self._authorized:
            raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)")

    def next_request_id(self) -> str:
        return self._request_prefix + str(next(self._request_ids))

    async def close(self) -> None:
        if self.prefill_monitor is not None:
            await self.prefill_monitor.close()
        await self.registry.close()
        await self.pool.close()


GATEWAY = web.AppKey("gateway", Gateway)
CONFIG = web.AppKey("gateway_config", GatewayConfig)
