"""The router's link to the global prefill queue: one task polling depths for the decider.

Owns the router's `PrefillQueue` handle and the background task that, every
`poll_interval_s`, asks the queue for the depth of each model that has a registered
`prefill` worker and hands the answers to the `router.disagg.PrefillDecider`. A depth
that cannot be read (`QueueUnavailable`, or no answer within `_POLL_TIMEOUT_S`) makes
the model's depth unknown, so the decider falls back to local prefill with the reason
"queue_unavailable"; the queue reconnects by itself (`kvstore.redis_link`,
`kvstore.reconnect`) and the next poll that succeeds makes decisions remote again.

Invariants: the request path never awaits the queue, only this task does; the task
survives any error of a single poll; the queue is started and closed here only if
this monitor opened it (`owns_queue`): an injected queue (`kvgate up`) belongs to its
caller. Opened and closed by the app's cleanup context (`router.app`), through
`router.gateway.Gateway`; read at scrape time by `router.metrics` and by `/health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvstore.prefill_queue import PrefillQueue, QueueUnavailable
from router.disagg import PrefillDecider
from router.registry import WorkerRegistry

log = logging.getLogger("kvgate.router.prefill")

# NOTE: every queue operation is bounded by the queue's own op_timeout_s; this only
# keeps one hung poll from stalling the others forever.
_POLL_TIMEOUT_S = 2.0


class PrefillQueueMonitor:
    """See the module docstring."""

    def __init__(
        self, queue: PrefillQueue, decider: PrefillDecider, registry: WorkerRegistry,
        interval_s: float, *, owns_queue: bool,
    ) -> None:
        self.queue = queue
        self.decider = decider
        self.registry = registry
        self.interval_s = interval_s
        self.owns_queue = owns_queue
        self.num_polls = 0
        self.num_failed_polls = 0
        self.num_outages = 0  # times the queue became unavailable (at start included)
        self._was_available: bool | None = None  # None: before the first poll
        self._task: asyncio.Task[None] | None = None

    @property
    def is_available(self) -> bool:
        return self.decider.is_queue_available

    async def start(self) -> None:
        if self.owns_queue:
            await self.queue.start()  # never raises: an unreachable store starts unavailable
        await self._poll_safely()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-prefill-poller")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.owns_queue:
            await self.queue.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._poll_safely()

    async def _poll_safely(self) -> None:
        try:
            await self.poll()
        except Exception:  # an unexpected answer must not end depth polling for good
            if self._was_available is not False:  # once per outage, not once per poll
                log.exception("prefill queue: depth poll failed")
            for model in self.decider.polled_depths():
                self.decider.set_unknown(model)
            self._set_available(False)

    async def poll(self) -> None:
        """One round: every model with a prefill worker, concurrently."""
        models = {w.spec.model for w in self.registry.workers.values() if w.spec.role == "prefill"}
        self.decider.keep_models(models)
        results = await asyncio.gather(*(self._poll_model(model) for model in models))
        self._set_available(all(results) and self.queue.is_available)

    async def _poll_model(self, model: str) -> bool:
        decider = self.decider
        token = decider.begin_poll(model)
        self.num_polls += 1
        try:
            async with asyncio.timeout(_POLL_TIMEOUT_S):
                depth = await self.queue.depth(model)
        except (QueueUnavailable, TimeoutError):
            self.num_failed_polls += 1
            decider.set_unknown(model)
            return False
        decider.set_depth(model, depth, token)
        return True

    def _set_available(self, available: bool) -> None:
        was_available, self._was_available = self._was_available, available
        self.decider.is_queue_available = available
        if available == was_available:
            return
        if not available:
            self.num_outages += 1
            log.warning("prefill queue unavailable: prefill falls back to local until it answers again")
        elif was_available is False:
            log.info("prefill queue available again")
