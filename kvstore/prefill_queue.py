"""The global prefill queue contract: one `PrefillQueue` protocol, three implementations.

Owns the protocol, its configuration (`QueueConfig`), its counters (`QueueCounters`)
and its boundary error (`QueueUnavailable`). The implementations are
`kvstore.redis_queue.RedisPrefillQueue` (Redis Streams, shared by a fleet),
`kvstore.memory_queue.MemoryPrefillQueue` (in-process, for `kvgate up` without Redis)
and `kvstore.http_queue.HttpPrefillQueue` (a worker process's handle on a queue that
another process serves over HTTP with `kvstore.queue_server.QueueServer`, as `kvgate up`
does with its in-process one); `open_prefill_queue()` picks one from a URL.

The contract all three keep (tests/integration/test_prefill_queue.py checks it on each):
- One queue per model; jobs are delivered oldest first to one consumer of the
  prefill-worker group at a time.
- `enqueue` returns False, and stores nothing, when the same (model, request id) was
  enqueued within `dedupe_ttl_s`: the request is prefilled once.
- A queue keeps at most about `max_len` unfinished jobs: the oldest are trimmed.
- A claimed job stays in the queue until `ack`; one left unacked for
  `idle_timeout_s` is delivered again to the next consumer that claims.
- `renew` is the holder's heartbeat: it restarts the job's idle clock, so a job
  renewed more often than every `idle_timeout_s` is never delivered again. It
  leaves the delivery count as it is, and it is True only while the job is still
  pending with that very delivery (same consumer, same `num_deliveries`): once the
  job was acked, reclaimed (even by the same consumer name), trimmed, expired or
  dead-lettered it returns False and changes nothing.
- A job about to be delivered more than `max_deliveries` times goes to the
  dead-letter list instead, with the reason; a job past its deadline is dropped
  (acked, counted in `num_expired`) and never returned.
- `depth` counts the unfinished jobs: waiting plus claimed and not yet acked.
- Every operation either completes within about `op_timeout_s` or raises
  `QueueUnavailable`, so callers fall back to local prefill.

Called by decode workers (enqueue), prefill workers (claim, renew, ack), the router's
disaggregation decider (depth) and `/health` and metrics (is_available, counters).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

from kvstore.prefill_job import ClaimedJob, DeadLetter, PrefillJob


class QueueUnavailable(Exception):
    """The queue's backing store cannot be reached now: fall back, try again later."""


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """Knobs shared by both implementations; validated on construction."""

    max_len: int = 10_000
    idle_timeout_s: float = 30.0
    max_deliveries: int = 3
    dedupe_ttl_s: float = 600.0
    dead_letter_max_len: int = 10_000
    key_prefix: str = "kvgate"
    group: str = "prefill-workers"
    op_timeout_s: float = 0.5
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("max_len", "max_deliveries", "dead_letter_max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"QueueConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("idle_timeout_s", "dedupe_ttl_s", "op_timeout_s", "backoff_initial_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"QueueConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("QueueConfig.backoff_max_s must be >= backoff_initial_s")
        for name in ("key_prefix", "group"):
            if not getattr(self, name):
                raise ValueError(f"QueueConfig.{name} must not be empty")


@dataclass(slots=True)
class QueueCounters:
    """Monotonic totals since the queue object was created, for metrics and /health."""

    num_enqueued: int = 0
    num_duplicates: int = 0
    num_delivered: int = 0
    num_reclaimed: int = 0
    num_acked: int = 0
    num_expired: int = 0
    num_dead_lettered: int = 0
    num_unavailable: int = 0
    num_renewed: int = 0

    def snapshot(self) -> dict[str, int]:
        """A copy, keyed by field name."""
        return asdict(self)


@runtime_checkable
class PrefillQueue(Protocol):
    """What decode workers, prefill workers and the router use; see the module doc."""

    config: QueueConfig
    counters: QueueCounters

    @property
    def is_available(self) -> bool:
        """False while the backing store is unreachable (operations raise then)."""
        ...

    async def start(self) -> None:
        """Connect (never raises: an unreachable store only makes it unavailable)."""
        ...

    async def close(self) -> None:
        """Release connections and background tasks; the queue is unusable after."""
        ...

    async def enqueue(self, job: PrefillJob) -> bool:
        """Add `job` to its model's queue; False if its request id is a duplicate."""
        ...

    async def claim(self, model: str, consumer: str, timeout_s: float) -> ClaimedJob | None:
        """The next live job for `consumer`, waiting up to `timeout_s`; None if none came."""
        ...

    async def ack(self, claimed: ClaimedJob) -> bool:
        """Mark the job done (its KV reached D); False if it was no longer pending."""
        ...

    async def renew(self, claimed: ClaimedJob) -> bool:
        """Restart the idle clock of a job `claimed.consumer` still holds (a heartbeat while it runs);
        False, changing nothing, once the job is no longer pending with that consumer (acked,
        reclaimed by another, trimmed, dead-lettered)."""
        ...

    async def depth(self, model: str) -> int:
        """Unfinished jobs of `model`: waiting plus claimed and not yet acked."""
        ...

    async def dead_letters(self, model: str, limit: int = 100) -> list[DeadLetter]:
        """The oldest `limit` dead-lettered jobs of `model`, oldest first."""
        ...


def open_prefill_queue(
    url: str | None, config: QueueConfig | None = None, *, token: str | None = None
) -> PrefillQueue:
    """The queue that `url` names.

    None or empty: the in-process queue. `http://` or `https://`: the queue another
    process serves with `kvstore.queue_server.QueueServer`, reached with
    `kvstore.http_queue.HttpPrefillQueue` and `token` as its bearer token (used by
    HTTP URLs only). Anything else (`redis://`, `rediss://`, `unix://`): Redis.
    """
    config = config or QueueConfig()
    # Imported here: the implementations import this module for the protocol's types.
    if not url:
        from kvstore.memory_queue import MemoryPrefillQueue

        return MemoryPrefillQueue(config)
    if url.startswith(("http://", "https://")):
        from kvstore.http_queue import HttpPrefillQueue

        return HttpPrefillQueue(url, config, token=token)
    from kvstore.redis_queue import RedisPrefillQueue

    return RedisPrefillQueue(url, config)
