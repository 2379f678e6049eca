"""Reachability of one remote queue backend, and the probe that restores it.

Owns the answer to "can we reach the backend now?" for a client that talks to a
queue over the network, and why not. The owner calls `mark_down(reason)` when a call
gets no usable answer; from then on `is_up` is False, so the owner fails its calls
at once without touching the network, and one background task runs the owner's
`probe` (a coroutine that returns when the backend answers and raises when not),
with exponential backoff (`backoff_initial_s`, doubling, at most `backoff_max_s`),
until it succeeds; then the link is up again and `on_up` runs.

Invariants: at most one probe task at a time; one probe runs at most
`probe_timeout_s`; nothing is probed after `close()`; `reason` says why the link is
down (the last probe's failure) and is empty while it is up.

Called by `kvstore.http_queue.HttpPrefillQueue`. `kvstore.redis_link.RedisLink` keeps
the same behaviour for Redis with a loop of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class Reconnector:
    """Up/down state of one backend plus its backoff probe; see the module doc."""

    def __init__(
        self,
        name: str,
        probe: Callable[[], Awaitable[None]],
        *,
        probe_timeout_s: float,
        backoff_initial_s: float,
        backoff_max_s: float,
        on_up: Callable[[], None] = lambda: None,
    ) -> None:
        self.name = name
        self.reason = ""
        self._probe = probe
        self._probe_timeout_s = probe_timeout_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._on_up = on_up
        self._is_up = True
        self._closed = False
        self._task: asyncio.Task[None] | None = None

    @property
    def is_up(self) -> bool:
        return self._is_up and not self._closed

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def check(self) -> bool:
        """Probe once now; on failure mark the link down (which starts probing)."""
        error = await self._try_probe()
        if error is not None:
            self.mark_down(error)
        return error is None

    def mark_down(self, reason: str) -> None:
        """Record that the backend did not answer; start probing unless already probing."""
        if self._closed:
            return
        if self._is_up:
            log.warning("%s is unreachable (%s); reconnecting", self.name, reason)
        self._is_up = False
        self.reason = reason
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _probe_until_up(self) -> None:
        delay_s = self._backoff_initial_s
        while not self._closed:
            await asyncio.sleep(delay_s)
            error = await self._try_probe()
            if error is None:
                self._is_up = True
                self.reason = ""
                log.info("%s is reachable again", self.name)
                self._on_up()
                return
            self.reason = error
            delay_s = min(delay_s * 2, self._backoff_max_s)

    async def _try_probe(self) -> str | None:
        """None when the probe succeeded, else why it failed."""
        try:
            async with asyncio.timeout(self._probe_timeout_s):
                await self._probe()
        except TimeoutError:
            return f"no answer within {self._probe_timeout_s:g} s"
        except Exception as exc:  # whatever a probe trips over means "not yet", with its reason
            return str(exc) or type(exc).__name__
        return None
