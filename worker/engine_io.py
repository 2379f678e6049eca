"""What an engine sends out besides tokens: its KV events, its load reports, its token rate.

Owns `EnginePublishers`, the pair of ZMQ publishers an engine opens from its (events,
replay, load) endpoints, with the load-report throttle, `TokenRate`, the sliding
window behind `EngineStats.generation_tokens_per_s`, and `EngineOutlets`, the part of
an engine around its core that both engines share: its state, its publishers and the
hand-off of remote prefills to `worker.disagg`. `worker.sim.SimEngine` and
`worker.torch_engine.TorchEngine` each own one of the first two and derive from the
third; nothing else calls them.

Invariants:
- `open()` binds every configured publisher or none: a bind error closes the ones
  already bound before it propagates. `close()` is idempotent and safe before `open()`.
- A load report is built (`make_report()`) only when a load publisher is open. It is
  sent when forced, when `load_interval_s` (if set) has passed since the last one, or
  when its `load_key` differs from the last sent one's and `min_load_interval_s` has
  passed since then.
- Both classes are used from one thread at a time (the sim's event loop or the torch
  engine thread); the clock is injectable so tests can drive them exactly.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from indexer.events import KVEvent
from indexer.load import LoadReport
from worker.api import GenerateRequest
from worker.kv_publisher import KVEventPublisher, LoadPublisher
from worker.remote_prefill import RemoteCounters, RemotePrefills, RemoteRequest

Clock = Callable[[], float]

RATE_WINDOW_S = 5.0


def load_key(report: LoadReport) -> tuple[int, ...]:
    """The fields of a report whose change makes it worth sending early (not the timestamp)."""
    return (report.num_running, report.num_waiting, report.num_kv_blocks_used, report.num_prefill_tokens)


class EnginePublishers:
    """An engine's KV event publisher and load publisher (either may be absent)."""

    def __init__(
        self,
        events_endpoint: str | None = None,
        replay_endpoint: str | None = None,
        load_endpoint: str | None = None,
        *,
        min_load_interval_s: float,
        load_interval_s: float | None = None,
        data_parallel_rank: int | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """`load_interval_s=None`: `may_report` never reports unchanged load on its own,
        the caller forces a report on its own timer instead (the sim's timer task).
        `data_parallel_rank`: set on every KV event batch (a DP rank's engine)."""
        self._endpoints = (events_endpoint, replay_endpoint, load_endpoint)
        self._data_parallel_rank = data_parallel_rank
        self._min_load_interval_s = min_load_interval_s
        self._load_interval_s = load_interval_s
        self._clock = clock
        self.kv_publisher: KVEventPublisher | None = None
        self.load_publisher: LoadPublisher | None = None
        self._last_load: tuple[int, ...] = ()
        self._last_load_at = 0.0

    def open(self) -> None:
        """Binds the configured publishers; ZMQ errors raise here, with nothing left open."""
        events_endpoint, replay_endpoint, load_endpoint = self._endpoints
        try:
            if events_endpoint is not None:
                self.kv_publisher = KVEventPublisher(
                    events_endpoint, replay_endpoint, data_parallel_rank=self._data_parallel_rank
                ).start()
            if load_endpoint is not None:
                self.load_publisher = LoadPublisher(load_endpoint)
        except BaseException:
            self.close()
            raise

    def publish_events(self, events: list[KVEvent]) -> None:
        """Publishes one step's KV events (nothing for an empty step or without a publisher)."""
        if events and self.kv_publisher is not None:
            self.kv_publisher.publish(events)

    def may_report(self, make_report: Callable[[], LoadReport], *, force: bool = False) -> bool:
        """Publishes `make_report()` if forced or due (see the module docstring); True if sent."""
        if self.load_publisher is None:
            return False
        report = make_report()
        load = load_key(report)
        now = self._clock()
        since = now - self._last_load_at
        due = self._load_interval_s is not None and since >= self._load_interval_s
        changed = load != self._last_load and since >= self._min_load_interval_s
        if not (force or due or changed):
            return False
        self.load_publisher.publish(report)
        self._last_load, self._last_load_at = load, now
        return True

    def close(self) -> None:
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        if self.load_publisher is not None:
            self.load_publisher.close()


class TokenRate:
    """Tokens generated per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = RATE_WINDOW_S, *, clock: Clock = time.monotonic) -> None:
        assert window_s > 0, "the rate window must be positive"
        self._window_s = window_s
        self._clock = clock
        self._steps: deque[tuple[float, int]] = deque()  # (when, num_tokens), oldest first

    def add(self, num_tokens: int) -> None:
        """Records one step's tokens (zero too) and forgets steps older than the window."""
        now = self._clock()
        self._steps.append((now, num_tokens))
        while self._steps and self._steps[0][0] < now - self._window_s:
            self._steps.popleft()

    def per_second(self) -> float:
        """Tokens in the window divided by its full length (a young engine reads low)."""
        since = self._clock() - self._window_s
        return sum(n for t, n in self._steps if t >= since) / self._window_s


class EngineOutlets:
    """An engine's state, publishers and remote-prefill hand-off (see the module doc).

    A subclass sets `_state`, `_publishers` and `remote` in its constructor, and
    delivers disaggregation events to its owner thread in `_remote_event`.
    """

    _state: str
    _publishers: EnginePublishers
    remote: RemotePrefills
    _remote_handler: Callable[[list[RemoteRequest]], None] | None = None

    @property
    def is_alive(self) -> bool:
        return self._state == "running"

    @property
    def kv_publisher(self) -> KVEventPublisher | None:
        return self._publishers.kv_publisher

    @property
    def load_publisher(self) -> LoadPublisher | None:
        return self._publishers.load_publisher

    @property
    def remote_counters(self) -> RemoteCounters:
        return self.remote.counters

    def set_remote_handler(self, handler: Callable[[list[RemoteRequest]], None]) -> None:
        """Where remote prefills go (a `DecodeLink`, called on the event loop), set before
        `start`; without one, every prefill is local."""
        self._remote_handler = handler

    def remote_ready(self, request_id: str) -> None:
        """The KV of `request_id` arrived (any thread)."""
        self._remote_event("ready", request_id)

    def remote_failed(self, request_id: str) -> None:
        """The job of `request_id` could not be queued: prefill it locally (any thread)."""
        self._remote_event("failed", request_id)

    def release(self, request_id: str) -> None:
        """Frees the blocks a `hold_blocks` request kept after finishing (any thread)."""
        self._remote_event("release", request_id)

    def _remote_event(self, event: str, request_id: str) -> None:
        """Hands `RemotePrefills.apply(event, request_id)` to the engine's owner."""
        raise NotImplementedError

    def _wants_remote(self, request: GenerateRequest) -> bool:
        return request.remote_prefill and self._remote_handler is not None

    def _take_remote_requests(self, now: float) -> list[RemoteRequest]:
        """The remote prefills admitted since the last call (owner thread), for the handler."""
        requests = self.remote.take_requests(now)
        assert not requests or self._remote_handler is not None, "remote prefill admitted without a handler"
        return requests
