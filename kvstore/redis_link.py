"""One Redis connection pool with bounded calls, availability and self-healing.

Owns the `redis.asyncio` client of a Redis-backed queue and the answer to "can we
reach Redis now?". Every call runs under a deadline (`op_timeout_s`, plus the block
time of a blocking read); a connection error or a timeout marks the link down and
raises `QueueUnavailable`. While down, calls fail at once without touching the
network, and one background task probes Redis with exponential backoff until it
answers, then marks the link up again and runs the owner's `on_up` hook.

Invariants: at most one probe task at a time; the client never retries on its own
(redis-py's default retries would multiply the caller's wait).

Called by `kvstore.redis_queue.RedisPrefillQueue` only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.prefill_queue import QueueConfig, QueueCounters, QueueUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

# BusyLoadingError (Redis still loading its AOF after a restart) is a ConnectionError.
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError)


class RedisLink:
    """A `redis.asyncio.Redis` behind bounded calls; see the module doc."""

    def __init__(
        self,
        url: str,
        config: QueueConfig,
        counters: QueueCounters,
        on_up: Callable[[], None] = lambda: None,
    ) -> None:
        self.url = url
        self._config = config
        self._counters = counters
        self._on_up = on_up
        # NOTE: no socket timeout here: each call's deadline is enforced around it, and
        # redis-py drops a connection whose read was cancelled.
        self.client: redis.Redis = redis.Redis.from_url(
            url,
            socket_timeout=None,
            socket_connect_timeout=config.op_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
        )
        self._is_up = True
        self._probe: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def is_up(self) -> bool:
        return self._is_up and not self._closed

    async def start(self) -> None:
        """Ping once; on failure the link goes down and starts probing."""
        try:
            await self.call(lambda client: client.ping())
        except QueueUnavailable:
            pass

    async def close(self) -> None:
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
            self._probe = None
        await self.client.aclose()

    async def call(self, command: Callable[[redis.Redis], Awaitable[T]], extra_s: float = 0.0) -> T:
        """Run `command(client)` within `op_timeout_s + extra_s`, or raise QueueUnavailable."""
        if not self.is_up:
            self._counters.num_unavailable += 1
            raise QueueUnavailable(f"redis at {self.url} is unreachable; reconnecting in the background")
        try:
            async with asyncio.timeout(self._config.op_timeout_s + extra_s):
                return await command(self.client)
        except _UNREACHABLE as exc:
            self._mark_down(exc)
            self._counters.num_unavailable += 1
            raise QueueUnavailable(f"redis at {self.url} is unreachable: {exc or type(exc).__name__}") from exc

    def _mark_down(self, exc: BaseException) -> None:
        if self._closed:
            return
        if self._is_up:
            log.warning("prefill queue: redis at %s unreachable (%r); reconnecting", self.url, exc)
        self._is_up = False
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        # Connections opened before the outage are dead: drop them all so no caller
        # trips over a stale one after Redis comes back.
        await self.client.connection_pool.disconnect(inuse_connections=True)
        delay_s = self._config.backoff_initial_s
        while not self._closed:
            await asyncio.sleep(delay_s)
            if await self._answers():
                self._is_up = True
                log.info("prefill queue: redis at %s is reachable again", self.url)
                self._on_up()
                return
            delay_s = min(delay_s * 2, self._config.backoff_max_s)

    async def _answers(self) -> bool:
        try:
            async with asyncio.timeout(self._config.op_timeout_s):
                await self.client.ping()
            return True
        except _UNREACHABLE:
            await self.client.connection_pool.disconnect(inuse_connections=True)
            return False


def as_str(value: Any) -> str:
    """A Redis reply element (bytes with decode_responses=False) as str."""
    return value.decode() if isinstance(value, bytes) else str(value)
