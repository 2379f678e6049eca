"""Keeping one worker registered with a kvgate router through its admin API.

Owns the client side of `POST /admin/workers` (register; re-posting the identical
body is the heartbeat the router expects) and `DELETE /admin/workers/{id}`
(deregister), with the admin bearer token. Callers: `kvgate worker` (register at
start, deregister at exit) and `kvgate sidecar` (the same, plus `withdraw()` when its
engine dies and `resume()` when it comes back).

Invariants:
- At most one heartbeat task runs; `withdraw()` stops it before deleting, so a late
  heartbeat can never re-register a worker that was just deregistered.
- A router that is down only delays registration: every interval tries again, and
  only changes of outcome are logged.
- `close()` is idempotent and always closes the HTTP session.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote

import aiohttp

logger = logging.getLogger(__name__)


class Registrar:
    """Keeps one worker registered: POST now and every interval, DELETE on withdraw or close."""

    def __init__(self, router_url: str, body: dict[str, Any], token: str | None, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self._base = router_url.rstrip("/")
        self._body = body
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._interval_s = interval_s
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self.registered: bool | None = None  # the last attempt's outcome; None before any
        self.num_registrations = 0  # successful POSTs, heartbeats included
        self.num_deregistrations = 0

    @property
    def worker_id(self) -> str:
        return self._body["worker_id"]

    @property
    def body(self) -> dict[str, Any]:
        return dict(self._body)

    @property
    def is_active(self) -> bool:
        """True while the heartbeat runs."""
        return self._task is not None

    def start(self) -> None:
        """Opens the session and starts heartbeating (the first POST is immediate)."""
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=min(5.0, self._interval_s * 2))
            self._session = aiohttp.ClientSession(timeout=timeout)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="router-registration")

    def resume(self, body: dict[str, Any] | None = None) -> None:
        """Registers again (with `body` when given) after a `withdraw()`."""
        if self._task is not None:
            return
        if body is not None:
            self._body = body
        self.start()

    async def withdraw(self) -> None:
        """Stops heartbeating and deregisters (best effort, bounded by the session timeout)."""
        await self._stop_heartbeat()
        if self._session is None:
            return
        url = f"{self._base}/admin/workers/{quote(self.worker_id, safe='')}"
        try:
            async with self._session.delete(url, headers=self._headers) as response:
                if response.status in (200, 204, 404):
                    self.num_deregistrations += 1
                    logger.info("deregistered %s from the router at %s", self.worker_id, self._base)
                else:
                    logger.warning("deregistering from %s: HTTP %d", self._base, response.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("cannot deregister from %s: %s", self._base, exc)
        self.registered = None

    async def close(self) -> None:
        """Deregisters if registered, then closes the session. Idempotent."""
        if self._session is None:
            return
        if self._task is not None or self.registered:
            await self.withdraw()
        session, self._session = self._session, None
        await session.close()

    async def _stop_heartbeat(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    async def _run(self) -> None:
        assert self._session is not None
        while True:
            await self._register(self._session)
            await asyncio.sleep(self._interval_s)

    async def _register(self, session: aiohttp.ClientSession) -> None:
        url = f"{self._base}/admin/workers"
        try:
            async with session.post(url, json=self._body, headers=self._headers) as response:
                ok, detail = response.status in (200, 201), f"HTTP {response.status}: {(await response.text())[:200]}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        if ok != self.registered:
            if ok:
                logger.info("registered %s with the router at %s", self.worker_id, self._base)
            else:
                logger.warning("cannot register with the router at %s (%s); retrying", self._base, detail)
        self.registered = ok
        self.num_registrations += ok
