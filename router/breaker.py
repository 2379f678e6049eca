"""A per-worker circuit breaker: stop sending to a worker that keeps failing, probe it later.

Owns one worker's breaker state. The proxy records the outcome of every attempt it
makes on a worker (`record_success` / `record_failure`); the candidate builder asks
`allows()` before offering the worker to the policy and calls `on_dispatch()` when
the worker was picked. Pure and synchronous, with an injectable clock.

What counts as a failure is decided by the caller and is exactly: a transport error
(connect refused or reset, timeout, broken stream) or a 5xx answer. A 4xx answer is
the client's fault and a 429 is back-pressure: both count as successes of the
transport, so an overloaded or strict worker is never cut off by this breaker.

States:
- closed: every request allowed; `failure_threshold` consecutive failures open it.
- open: nothing allowed until `open_s` has passed since it opened, then half-open.
- half-open: one trial request at a time; its success closes the breaker, its
  failure opens it again for another `open_s`. A trial whose outcome never comes
  (the client went away first) stops blocking others after `open_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 5
    open_s: float = 5.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError("breaker failure_threshold must be at least 1")
        if self.open_s <= 0:
            raise ValueError("breaker open_s must be positive")


class CircuitBreaker:
    """See the module docstring."""

    __slots__ = ("config", "_clock", "_state", "_num_failures", "_opened_at", "_trial_started_at", "num_opened")

    def __init__(self, config: BreakerConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock
        self._state = CLOSED
        self._num_failures = 0  # consecutive, while closed
        self._opened_at = 0.0
        self._trial_started_at: float | None = None
        self.num_opened = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self.config.open_s:
            return HALF_OPEN
        return self._state

    @property
    def num_failures(self) -> int:
        return self._num_failures

    def allows(self) -> bool:
        """Whether a new request may be sent to the worker now."""
        if self._state == CLOSED:
            return True
        if self.state != HALF_OPEN:
            return False
        started = self._trial_started_at
        return started is None or self._clock() - started >= self.config.open_s

    def on_dispatch(self) -> None:
        """The worker was picked: in half-open, this request is the one trial."""
        if self._state != CLOSED and self.state == HALF_OPEN:
            self._state = HALF_OPEN
            self._trial_started_at = self._clock()

    def record_success(self) -> None:
        self._state = CLOSED
        self._num_failures = 0
        self._trial_started_at = None

    def record_failure(self) -> None:
        if self._state == CLOSED:
            self._num_failures += 1
            if self._num_failures >= self.config.failure_threshold:
                self._open()
        elif self._state == HALF_OPEN:
            self._open()
        # NOTE: failures of requests sent before the breaker opened change nothing.

    def reset(self) -> None:
        """Back to closed (a worker re-registered or came back healthy)."""
        self.record_success()

    def _open(self) -> None:
        self._state = OPEN
        self._opened_at = self._clock()
        self._trial_started_at = None
        self._num_failures = 0
        self.num_opened += 1

    def describe(self) -> dict[str, object]:
        return {"state": self.state, "num_failures": self._num_failures, "num_opened": self.num_opened}
