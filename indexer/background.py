"""`BackgroundLoop`: start and stop an object's `run()` coroutine as one asyncio task.

Used by the event and load subscribers. `start()` is idempotent while the task runs;
`stop()` cancels it, waits for it to finish (closing its sockets on the way out) and
logs a failure it ended with, so a crashed loop is never silent.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


class BackgroundLoop:
    """Mixin: `start()` / `stop()` around the subclass's `run()`, named `task_name()`."""

    _task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        raise NotImplementedError

    def task_name(self) -> str:
        return type(self).__name__

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=self.task_name())
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # wait() rather than await: a cancellation of stop() itself still propagates.
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s had failed: %r", self.task_name(), task.exception())
