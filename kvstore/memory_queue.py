"""The in-process prefill queue: the `PrefillQueue` contract without Redis.

Owns, per model, an ordered table of unfinished jobs (waiting and claimed), the
dead-letter list and the de-duplication window. It serves `kvgate up` on one machine,
where decode and prefill workers share one event loop's process, and it is the
reference the Redis implementation is tested against (same conformance suite).

Invariants:
- Every unfinished job is in `_Stream.entries`, in enqueue order; a waiting one is
  also in `waiting`, a claimed one in `pending` (ordered by last delivery or renewal,
  so its first entry is the one idle longest).
- State changes happen in synchronous methods, never across an `await`; the only
  await is the wait for new jobs. Always available: nothing here can be unreachable.

Called through `kvstore.prefill_queue.open_prefill_queue()` or directly by tests.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import count

from kvstore.prefill_job import ClaimedJob, DeadLetter, PrefillJob
from kvstore.prefill_queue import QueueConfig, QueueCounters


@dataclass(slots=True)
class _Entry:
    entry_id: str
    job: PrefillJob
    num_deliveries: int = 0
    consumer: str = ""
    delivered_at: float = 0.0


@dataclass(slots=True)
class _Stream:
    """One model's queue."""

    entries: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    waiting: deque[str] = field(default_factory=deque)
    pending: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    dead: deque[DeadLetter] = field(default_factory=deque)
    # request id -> monotonic expiry; the TTL is constant, so expiries are in order.
    seen: OrderedDict[str, float] = field(default_factory=OrderedDict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class MemoryPrefillQueue:
    """`PrefillQueue` in process memory (see `kvstore.prefill_queue` for the contract)."""

    def __init__(self, config: QueueConfig | None = None) -> None:
        self.config = config or QueueConfig()
        self.counters = QueueCounters()
        self._streams: dict[str, _Stream] = {}
        self._entry_ids = count(1)
        self._closed = False

    @property
    def is_available(self) -> bool:
        return not self._closed

    async def start(self) -> None:
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        for stream in self._streams.values():
            stream.arrived.set()

    async def enqueue(self, job: PrefillJob) -> bool:
        stream = self._stream(job.model)
        if not self._may_remember(stream, job.request_id):
            self.counters.num_duplicates += 1
            return False
        entry = _Entry(entry_id=f"{next(self._entry_ids)}-0", job=job)
        stream.entries[entry.entry_id] = entry
        stream.waiting.append(entry.entry_id)
        self._trim(stream)
        self.counters.num_enqueued += 1
        stream.arrived.set()
        return True

    async def claim(self, model: str, consumer: str, timeout_s: float) -> ClaimedJob | None:
        stream = self._stream(model)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while not self._closed:
            claimed = self._take(stream, consumer)
            if claimed is not None:
                return claimed
            remaining = end - loop.time()
            if remaining <= 0:
                return None
            stream.arrived.clear()
            # Wake up at least every idle timeout: a claimed job may have gone idle.
            wait_s = min(remaining, self.config.idle_timeout_s)
            try:
                await asyncio.wait_for(stream.arrived.wait(), wait_s)
            except TimeoutError:
                pass
        return None

    async def ack(self, claimed: ClaimedJob) -> bool:
        stream = self._stream(claimed.job.model)
        entry = stream.pending.pop(claimed.entry_id, None)
        if entry is None:
            return False
        del stream.entries[claimed.entry_id]
        self.counters.num_acked += 1
        return True

    async def renew(self, claimed: ClaimedJob) -> bool:
        stream = self._stream(claimed.job.model)
        entry = stream.pending.get(claimed.entry_id)
        if entry is None or (entry.consumer, entry.num_deliveries) != (claimed.consumer, claimed.num_deliveries):
            return False
        entry.delivered_at = time.monotonic()
        stream.pending.move_to_end(claimed.entry_id)
        self.counters.num_renewed += 1
        return True

    async def depth(self, model: str) -> int:
        return len(self._stream(model).entries)

    async def dead_letters(self, model: str, limit: int = 100) -> list[DeadLetter]:
        return list(self._stream(model).dead)[:limit]

    def _stream(self, model: str) -> _Stream:
        stream = self._streams.get(model)
        if stream is None:
            stream = self._streams[model] = _Stream()
        return stream

    def _may_remember(self, stream: _Stream, request_id: str) -> bool:
        """Record `request_id` unless it is already in the de-duplication window."""
        now = time.monotonic()
        while stream.seen and next(iter(stream.seen.values())) <= now:
            stream.seen.popitem(last=False)
        if request_id in stream.seen:
            return False
        stream.seen[request_id] = now + self.config.dedupe_ttl_s
        return True

    def _trim(self, stream: _Stream) -> None:
        """Drop the oldest unfinished jobs beyond `max_len` (as XADD MAXLEN does)."""
        while len(stream.entries) > self.config.max_len:
            entry_id, _ = stream.entries.popitem(last=False)
            stream.pending.pop(entry_id, None)
            # A trimmed waiting id stays in `waiting`; `_next_waiting` skips it.

    def _take(self, stream: _Stream, consumer: str) -> ClaimedJob | None:
        """Deliver the next live job (idle claimed ones first), dropping dead ones."""
        while True:
            entry = self._next_idle(stream) or self._next_waiting(stream)
            if entry is None:
                return None
            claimed = self._deliver(stream, entry, consumer)
            if claimed is not None:
                return claimed

    def _next_idle(self, stream: _Stream) -> _Entry | None:
        if not stream.pending:
            return None
        oldest = next(iter(stream.pending.values()))
        if time.monotonic() - oldest.delivered_at < self.config.idle_timeout_s:
            return None
        self.counters.num_reclaimed += 1
        return oldest

    def _next_waiting(self, stream: _Stream) -> _Entry | None:
        while stream.waiting:
            entry = stream.entries.get(stream.waiting.popleft())
            if entry is not None:
                return entry
        return None

    def _deliver(self, stream: _Stream, entry: _Entry, consumer: str) -> ClaimedJob | None:
        """Hand `entry` to `consumer`, or retire it (expired, delivered too often)."""
        entry.num_deliveries += 1
        if entry.num_deliveries > self.config.max_deliveries:
            reason = f"delivered {entry.num_deliveries} times without ack (limit {self.config.max_deliveries})"
            self._retire(stream, entry)
            self._dead_letter(stream, entry, reason)
            return None
        if entry.job.is_expired():
            self._retire(stream, entry)
            self.counters.num_expired += 1
            return None
        entry.consumer = consumer
        entry.delivered_at = time.monotonic()
        stream.pending.pop(entry.entry_id, None)
        stream.pending[entry.entry_id] = entry
        self.counters.num_delivered += 1
        return ClaimedJob(entry.job, entry.entry_id, consumer, entry.num_deliveries)

    def _retire(self, stream: _Stream, entry: _Entry) -> None:
        stream.pending.pop(entry.entry_id, None)
        del stream.entries[entry.entry_id]

    def _dead_letter(self, stream: _Stream, entry: _Entry, reason: str) -> None:
        stream.dead.append(DeadLetter(entry.entry_id, reason, entry.num_deliveries, entry.job))
        while len(stream.dead) > self.config.dead_letter_max_len:
            stream.dead.popleft()
        self.counters.num_dead_lettered += 1
