"""Worker load reports: the wire type, the router's latest-report table, and its subscriber.

Workers (and sidecars, from an engine's Prometheus metrics) publish a `LoadReport`
per step or tick as ZMQ `[topic, msgpack]`. The router keeps only the latest report
per `(worker_id, dp_rank)` in a `LoadAggregator`, which the routing scorers read.

Invariants:
- A report older (by its own `timestamp`, the worker's clock) than the one held for
  the same worker is ignored, so a reordered or replayed report never rolls load back.
- Staleness is judged by when the report *arrived*, on the router's monotonic clock,
  so clock skew between machines cannot make a live worker look stale or vice versa.
- `LoadReport` only grows at the end; unknown map keys are ignored on decode.

`LoadAggregator` is a synchronous core owned by the router's event loop;
`LoadSubscriber` is the asyncio edge that feeds it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Annotated

import msgspec
import zmq
import zmq.asyncio

from indexer.background import BackgroundLoop

logger = logging.getLogger(__name__)

WorkerKey = tuple[str, int]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class LoadReport(msgspec.Struct, frozen=True, gc=False):
    """One worker's (one DP rank's) load at `timestamp` (seconds since the epoch)."""

    worker_id: Annotated[str, msgspec.Meta(min_length=1)]
    dp_rank: _Count
    timestamp: float
    num_running: _Count
    num_waiting: _Count
    num_kv_blocks_used: _Count
    num_kv_blocks_total: _Count
    num_prefill_tokens: _Count  # prompt tokens of requests still in prefill

    @property
    def worker(self) -> WorkerKey:
        return (self.worker_id, self.dp_rank)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]; 0 for a worker reporting no blocks."""
        if self.num_kv_blocks_total == 0:
            return 0.0
        return min(1.0, self.num_kv_blocks_used / self.num_kv_blocks_total)


class MalformedReport(ValueError):
    """A payload that is not a valid `LoadReport`."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LoadReport)


def encode_report(report: LoadReport) -> bytes:
    return _encoder.encode(report)


def decode_report(payload: bytes) -> LoadReport:
    """The report in `payload`; raises `MalformedReport` if it is not one."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise MalformedReport(str(exc)) from None


class LoadAggregator:
    """The latest fresh `LoadReport` of every worker."""

    def __init__(self, max_age_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        if max_age_s <= 0:
            raise ValueError("max_age_s must be positive")
        self.max_age_s = max_age_s
        self._clock = clock
        self._latest: dict[WorkerKey, tuple[LoadReport, float]] = {}
        self.num_updates = 0
        self.num_out_of_order = 0

    def update(self, report: LoadReport) -> bool:
        """Holds `report` unless a newer one is already held; True if it was taken."""
        held = self._latest.get(report.worker)
        if held is not None and report.timestamp < held[0].timestamp:
            self.num_out_of_order += 1
            return False
        self._latest[report.worker] = (report, self._clock())
        self.num_updates += 1
        return True

    def get(self, worker: WorkerKey) -> LoadReport | None:
        """The worker's latest report, or None when there is none or it is stale."""
        held = self._latest.get(worker)
        if held is None or self._is_stale(held[1]):
            return None
        return held[0]

    def reports(self) -> dict[WorkerKey, LoadReport]:
        """Every fresh report, by worker."""
        return {worker: report for worker, (report, at) in self._latest.items() if not self._is_stale(at)}

    def remove(self, worker: WorkerKey) -> None:
        self._latest.pop(worker, None)

    def _is_stale(self, received_at: float) -> bool:
        return self._clock() - received_at > self.max_age_s


class LoadSubscriber(BackgroundLoop):
    """An asyncio SUB on one load endpoint that feeds a `LoadAggregator`."""

    def __init__(
        self,
        aggregator: LoadAggregator,
        endpoint: str,
        topic: str = "load",
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.aggregator = aggregator
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._context = context
        self.num_reports = 0
        self.num_malformed = 0

    async def run(self) -> None:
        """Receives reports until cancelled; the socket is closed on the way out."""
        owned = self._context is None
        context = zmq.asyncio.Context() if owned else self._context
        assert context is not None
        sock = context.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            sock.connect(self.endpoint)
            while True:
                self.handle(await sock.recv_multipart())
        finally:
            sock.close(linger=0)
            if owned:
                context.term()

    def handle(self, frames: list[bytes]) -> None:
        """Feeds one `[topic, payload]` message to the aggregator; counts bad ones."""
        if len(frames) != 2:
            self.num_malformed += 1
            return
        try:
            report = decode_report(frames[1])
        except MalformedReport as exc:
            self.num_malformed += 1
            logger.debug("malformed load report from %s: %s", self.endpoint, exc)
            return
        self.num_reports += 1
        self.aggregator.update(report)

    def task_name(self) -> str:
        return f"load-subscriber {self.endpoint}"
