"""Active health checks: each worker's `GET /health`, probed on a timer, through a small state machine.

Owns `HealthState` (pure: consecutive passes and failures -> healthy or not) and
`HealthMonitor` (the asyncio edge: one probe task per worker, with its own small
HTTP session so probes never queue behind proxied traffic). The registry starts and
stops a worker's task and receives every change of state through `on_change`.

States: `unknown` until the first probe answers, then `healthy` or `unhealthy`.
- unknown: the first pass makes it healthy, the first failure unhealthy.
- healthy: `fail_threshold` consecutive failures make it unhealthy.
- unhealthy: `pass_threshold` consecutive passes make it healthy.
Only a healthy worker is in rotation. A probe passes on a 200 within `timeout_s`.

NOTE: with the defaults (probe every 1 s, 1 s timeout, 2 failures) a worker that dies
right after a passing probe leaves rotation within 3 s (the next probe starts 1 s
later, and two probes each fail within their 1 s timeout at worst), inside the 5 s
the gateway promises. Transport errors seen while
proxying open the worker's circuit breaker sooner than that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

logger = logging.getLogger(__name__)

UNKNOWN = "unknown"
HEALTHY = "healthy"
UNHEALTHY = "unhealthy"


@dataclass(frozen=True, slots=True)
class HealthConfig:
    interval_s: float = 1.0
    timeout_s: float = 1.0
    fail_threshold: int = 2
    pass_threshold: int = 2

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("health interval_s and timeout_s must be positive")
        if self.fail_threshold < 1 or self.pass_threshold < 1:
            raise ValueError("health fail_threshold and pass_threshold must be at least 1")


class HealthState:
    """One worker's health, from the outcomes of its probes (see the module docstring)."""

    __slots__ = ("config", "status", "num_passes", "num_failures", "last_error", "last_probe_at", "num_probes")

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self.status = UNKNOWN
        self.num_passes = 0  # consecutive
        self.num_failures = 0  # consecutive
        self.last_error: str | None = None
        self.last_probe_at: float | None = None
        self.num_probes = 0

    @property
    def is_healthy(self) -> bool:
        return self.status == HEALTHY

    def record(self, ok: bool, error: str | None = None, now: float | None = None) -> str | None:
        """Counts one probe outcome; returns the new status when it changed, else None."""
        self.num_probes += 1
        self.last_probe_at = time.monotonic() if now is None else now
        if ok:
            self.num_passes += 1
            self.num_failures = 0
            self.last_error = None
        else:
            self.num_failures += 1
            self.num_passes = 0
            self.last_error = error
        new_status = self._next_status(ok)
        if new_status == self.status:
            return None
        self.status = new_status
        return new_status

    def _next_status(self, ok: bool) -> str:
        if self.status == UNKNOWN:
            return HEALTHY if ok else UNHEALTHY
        if self.status == HEALTHY and self.num_failures >= self.config.fail_threshold:
            return UNHEALTHY
        if self.status == UNHEALTHY and self.num_passes >= self.config.pass_threshold:
            return HEALTHY
        return self.status

    def describe(self) -> dict[str, object]:
        return {
            "status": self.status,
            "consecutive_passes": self.num_passes,
            "consecutive_failures": self.num_failures,
            "last_error": self.last_error,
            "num_probes": self.num_probes,
        }


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float) -> tuple[bool, str | None]:
    """One `GET {url}/health`: (True, None) on a 200 in time, else (False, why)."""
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            await response.read()
            if response.status == 200:
                return True, None
            return False, f"/health answered {response.status}"
    except TimeoutError:
        return False, f"/health timed out after {timeout_s:g} s"
    except aiohttp.ClientError as exc:
        return False, f"{type(exc).__name__}: {exc}"


ChangeCallback = Callable[[str, str], None]
"""`on_change(worker_id, new_status)`, called on the event loop after every transition."""


class HealthMonitor:
    """Runs one probe loop per watched worker; see the module docstring."""

    def __init__(self, config: HealthConfig, on_change: ChangeCallback) -> None:
        self.config = config
        self._on_change = on_change
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def watch(self, worker_id: str, url: str, state: HealthState) -> None:
        """Starts probing a worker now, then every `interval_s`; replaces an older watch."""
        self.unwatch_nowait(worker_id)
        session = self._ensure_session()
        self._tasks[worker_id] = asyncio.create_task(
            self._loop(session, worker_id, url, state), name=f"health {worker_id}"
        )

    def unwatch_nowait(self, worker_id: str) -> asyncio.Task[None] | None:
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        return task

    async def unwatch(self, worker_id: str) -> None:
        task = self.unwatch_nowait(worker_id)
        if task is not None:
            await asyncio.wait([task])

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self, session: aiohttp.ClientSession, worker_id: str, url: str, state: HealthState) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            ok, error = await probe(session, url, self.config.timeout_s)
            changed = state.record(ok, error)
            if changed is not None:
                if changed == UNHEALTHY:
                    logger.warning("worker %s is unhealthy: %s", worker_id, error)
                else:
                    logger.info("worker %s is %s", worker_id, changed)
                try:
                    self._on_change(worker_id, changed)
                except Exception:  # a listener's bug must not stop the probes
                    logger.exception("health listener failed for worker %s", worker_id)
            await asyncio.sleep(max(0.0, self.config.interval_s - (loop.time() - started)))
