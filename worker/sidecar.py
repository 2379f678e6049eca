"""The sidecar: makes an external engine (vLLM, SGLang) a kvgate worker without changing it.

Owns one engine's life as the router sees it: it probes the engine's `/health`, learns
its model from `/v1/models` and its block size from `/metrics`, registers it through
the router's admin API (`worker.registration`), scrapes `/metrics` into `LoadReport`s
(`worker.prom_scrape`) that it publishes on its own ZMQ endpoint, and optionally
relays the engine's KV events (`worker.event_relay`). Caller: `kvgate sidecar`
(`worker.sidecar_cmd`), which also serves `describe()` on the sidecar's `/health`.

States: `starting` (engine not yet seen healthy) -> `healthy` (registered,
heartbeating, reporting load) -> `unhealthy` (`fail_threshold` probes failed in a row;
still registered; the relay forgets the engine's history) -> `down` (unhealthy for
`deregister_after_s`: deregistered). A passing probe in `starting` or `down`
re-learns the model and block size and registers again; in `unhealthy` it just
returns to `healthy`. The router itself clears a worker's index entries when it turns
unhealthy there or is deregistered.

Invariants: one task owns the state (`_watch`); load is only published while
`healthy`; a missing or unknown metric is logged once, never fatal.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from worker.event_relay import EventRelay
from worker.kv_publisher import LoadPublisher
from worker.prom_scrape import MetricsParseError, read_load, to_reports
from worker.registration import Registrar

logger = logging.getLogger("kvgate.sidecar")

STARTING, HEALTHY, UNHEALTHY, DOWN = "starting", "healthy", "unhealthy", "down"
DEFAULT_BLOCK_SIZE = 16  # vLLM's default


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    engine_url: str
    router_url: str
    events_endpoint: str | None = None  # the engine's KV events PUB
    replay_endpoint: str | None = None  # the engine's replay ROUTER
    worker_id: str | None = None
    role: str = "both"
    model: str | None = None  # None: learned from /v1/models
    block_size: int | None = None  # None: learned from /metrics, else 16
    num_kv_blocks: int | None = None  # where the engine's metrics give no count
    relay: bool = False
    relay_endpoint: str = "tcp://127.0.0.1:5567"
    relay_replay_endpoint: str = "tcp://127.0.0.1:5568"
    load_endpoint: str = "tcp://127.0.0.1:5569"
    topic: str = ""
    advertise_host: str | None = None  # replaces a wildcard host in bound endpoints
    advertise_url: str | None = None  # the URL the router uses (default: engine_url)
    router_token: str | None = None
    heartbeat_interval_s: float = 2.0
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    fail_threshold: int = 2
    deregister_after_s: float = 10.0
    scrape_interval_s: float = 0.1
    replay_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "health_interval_s", "health_timeout_s", "scrape_interval_s",
                     "replay_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.deregister_after_s < 0 or self.fail_threshold < 1:
            raise ValueError("deregister_after_s must be >= 0 and fail_threshold >= 1")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError("block_size must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.relay and not self.events_endpoint:
            raise ValueError("relay needs the engine's events endpoint")
        for name in ("engine_url", "router_url"):
            url = URL(getattr(self, name))
            if url.scheme not in ("http", "https") or not url.host:
                raise ValueError(f"{name} must be an absolute http(s) URL")


def default_worker_id(engine_url: str) -> str:
    """`<hostname>-<engine port>`: stable across sidecar restarts, unique per engine on a host."""
    url = URL(engine_url)
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{socket.gethostname()}-{url.port}")


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("sidecar task %s failed", task.get_name(), exc_info=task.exception())


class EngineError(Exception):
    """The engine answered something the sidecar cannot use."""


class Sidecar:
    """See the module docstring. `start()` binds its sockets; `close()` deregisters and stops."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.worker_id = config.worker_id or default_worker_id(config.engine_url)
        self.state = STARTING
        self.model: str | None = None
        self.block_size: int | None = None
        self.num_scrapes = 0
        self.num_scrape_failures = 0
        self.num_reports = 0
        self._engine = config.engine_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._load: LoadPublisher | None = None
        self.relay: EventRelay | None = None
        self.registrar: Registrar | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._num_failures = 0
        self._unhealthy_since = 0.0
        self._logged: set[str] = set()
        self.registered = asyncio.Event()  # set on every (re-)registration; for callers to wait on

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Binds the load (and relay) sockets, then starts probing; ZMQ errors raise here."""
        self._load = LoadPublisher(self.config.load_endpoint)
        if self.config.relay:
            assert self.config.events_endpoint is not None
            self.relay = EventRelay(
                self.config.events_endpoint, self.config.replay_endpoint,
                self.config.relay_endpoint, self.config.relay_replay_endpoint,
                topic=self.config.topic, replay_timeout_s=self.config.replay_timeout_s,
            )
            try:
                self.relay.start()
            except BaseException:
                self._load.close()
                raise
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s))
        self._tasks = [
            asyncio.create_task(self._watch(), name="sidecar-watch"),
            asyncio.create_task(self._scrape_loop(), name="sidecar-scrape"),
        ]
        for task in self._tasks:
            task.add_done_callback(_log_failure)

    async def close(self) -> None:
        """Stops probing, deregisters, closes every socket and session."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if self.registrar is not None:
            await self.registrar.close()
        if self.relay is not None:
            await self.relay.close()
        if self._load is not None:
            self._load.close()
        if self._session is not None:
            await self._session.close()

    @property
    def load_endpoint(self) -> str | None:
        return self._advertised(self._load.bound_endpoint) if self._load is not None else None

    def describe(self) -> dict[str, Any]:
        body = self.registrar.body if self.registrar is not None else None
        return {
            "worker_id": self.worker_id, "state": self.state, "engine_url": self._engine,
            "model": self.model, "block_size": self.block_size,
            "registered": bool(self.registrar and self.registrar.is_active and self.registrar.registered),
            "registration": body,
            "num_scrapes": self.num_scrapes, "num_scrape_failures": self.num_scrape_failures,
            "num_load_reports": self.num_reports,
            "relay": None if self.relay is None else {
                "last_seq": self.relay.stats.last_seq, "num_forwarded": self.relay.stats.num_forwarded,
                "num_gaps": self.relay.stats.num_gaps, "num_lost": self.relay.stats.num_lost,
                "num_restarts": self.relay.stats.num_restarts,
            },
        }

    # -- engine health and registration --------------------------------------------

    async def _watch(self) -> None:
        while True:
            await self._on_probe(await self._probe())
            await asyncio.sleep(self.config.health_interval_s)

    async def _probe(self) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"{self._engine}/health") as response:
                await response.read()
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _on_probe(self, ok: bool) -> None:
        if ok:
            self._num_failures = 0
            if self.state in (STARTING, DOWN):
                await self._register()
            elif self.state == UNHEALTHY:
                logger.info("engine %s is healthy again", self._engine)
                if self.relay is not None:
                    await self.relay.catch_up()
                self.state = HEALTHY
            return
        self._num_failures += 1
        now = time.monotonic()
        if self.state == HEALTHY and self._num_failures >= self.config.fail_threshold:
            logger.warning("engine %s is unhealthy (%d probes failed)", self._engine, self._num_failures)
            self.state, self._unhealthy_since = UNHEALTHY, now
            if self.relay is not None:
                self.relay.engine_lost()
        elif self.state == UNHEALTHY and now - self._unhealthy_since >= self.config.deregister_after_s:
            logger.warning("engine %s down for %.1f s: deregistering %s", self._engine,
                           now - self._unhealthy_since, self.worker_id)
            assert self.registrar is not None
            await self.registrar.withdraw()
            self.registered.clear()
            self.state = DOWN

    async def _register(self) -> None:
        try:
            self.model = self.config.model or await self._learn_model()
            self.block_size = await self._learn_block_size()
        except EngineError as exc:
            self._log_once(f"learn:{exc}", "engine %s is up but %s; retrying", self._engine, exc)
            return
        if self.relay is not None:
            await self.relay.catch_up()
        body = self._registration()
        if self.registrar is None:
            self.registrar = Registrar(self.config.router_url, body, self.config.router_token,
                                       self.config.heartbeat_interval_s)
            self.registrar.start()
        else:
            self.registrar.resume(body)
        self.state = HEALTHY
        self.registered.set()
        logger.info("engine %s serves %s (block size %d): registering %s", self._engine, self.model,
                    self.block_size, self.worker_id)

    async def _learn_model(self) -> str:
        body = await self._get_json("/v1/models")
        models = body.get("data") if isinstance(body, dict) else None
        if not isinstance(models, list) or not models or not isinstance(models[0], dict):
            raise EngineError("/v1/models lists no model")
        model = models[0].get("id")
        if not isinstance(model, str) or not model:
            raise EngineError("/v1/models gives a model without an id")
        return model

    async def _learn_block_size(self) -> int:
        engine_size = None
        try:
            engine_size = read_load(await self._get_text("/metrics")).block_size
        except (EngineError, MetricsParseError) as exc:
            self._log_once("block-size-scrape", "cannot read the block size from %s/metrics: %s", self._engine, exc)
        configured = self.config.block_size
        if engine_size is not None and configured is not None and engine_size != configured:
            self._log_once("block-size-differs", "--block-size %d differs from the engine's %d: using the engine's",
                           configured, engine_size)
        if engine_size is None and configured is None:
            self._log_once("block-size-default", "the engine reports no block size: assuming %d "
                           "(pass --block-size if it uses another)", DEFAULT_BLOCK_SIZE)
        return engine_size or configured or DEFAULT_BLOCK_SIZE

    def _registration(self) -> dict[str, Any]:
        """The admin API's worker body for the engine."""
        if self.relay is not None:
            events, replay = self.relay.bound_endpoint, self.relay.bound_replay_endpoint
        else:
            events, replay = self.config.events_endpoint, self.config.replay_endpoint
        return {
            "worker_id": self.worker_id,
            "url": self.config.advertise_url or self._engine,
            "role": self.config.role,
            "model": self.model,
            "events_endpoint": self._advertised(events),
            "replay_endpoint": self._advertised(replay) if events else None,
            "load_endpoint": self.load_endpoint,
            "block_size": self.block_size,
        }

    def _advertised(self, endpoint: str | None) -> str | None:
        """`endpoint` with a wildcard host replaced by one the router can reach."""
        if endpoint is None or not endpoint.startswith("tcp://"):
            return endpoint
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if host in ("*", "0.0.0.0", "[::]", "::"):
            host = self.config.advertise_host or socket.gethostname()
        return f"tcp://{host}{sep}{port}"

    # -- load ----------------------------------------------------------------------

    async def _scrape_loop(self) -> None:
        while True:
            if self.state == HEALTHY:
                await self._scrape()
            await asyncio.sleep(self.config.scrape_interval_s)

    async def _scrape(self) -> None:
        self.num_scrapes += 1
        try:
            load = read_load(await self._get_text("/metrics"))
        except (EngineError, MetricsParseError) as exc:
            self.num_scrape_failures += 1
            self._log_once("scrape-failed", "scraping %s/metrics failed (logged once): %s", self._engine, exc)
            return
        for name in load.missing:
            self._log_once(f"missing:{name}", "engine %s exports no %s: reporting it as 0", self._engine, name)
        assert self._load is not None
        for report in to_reports(load, self.worker_id, time.time(), self.config.num_kv_blocks):
            self.num_reports += self._load.publish(report)

    # -- HTTP ----------------------------------------------------------------------

    async def _get_text(self, path: str) -> str:
        assert self._session is not None
        try:
            async with self._session.get(f"{self._engine}{path}") as response:
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
            raise EngineError(f"GET {path}: {type(exc).__name__}: {exc}") from None
        if response.status != 200:
            raise EngineError(f"GET {path}: HTTP {response.status}")
        return text

    async def _get_json(self, path: str) -> Any:
        text = await self._get_text(path)
        try:
            return json.loads(text)
        except ValueError:
            raise EngineError(f"GET {path}: not JSON") from None

    def _log_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(message, *args)
