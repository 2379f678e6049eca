"""Decode-side bookkeeping of remote prefills: deadlines, completions, fallbacks, releases.

Owns `RemotePrefills`, which an engine's owner (the sim's step loop, the torch
engine's thread) runs beside its `worker.scheduler.Scheduler`, and `RemoteCounters`.
It turns the scheduler's admitted remote tasks into `RemoteRequest`s (what the
engine hands to `worker.disagg.DecodeLink` to enqueue) with a deadline, and applies
what comes back: the KV arrived (`on_ready`), the job could not be queued
(`on_failed`), the deadline passed (`expire`: prefill locally), the client went away
(`on_abort`). Pure and synchronous; the clock is passed in.

Invariants:
- every remote-prefilling request ends in exactly one of: completed, fallen back,
  aborted; a late notification for one that fell back or was aborted is ignored;
- a prefill worker writes a job's blocks only before the job's deadline (its transfer
  timeout), so the blocks are not touched by this side before the deadline plus
  `grace_s` unless the KV arrived: a request falls back to local prefill then, and the
  blocks of one aborted while remote-prefilling are held until then, so no block is
  written twice or reused while a late write may land.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from worker.scheduler import RemoteTask, Scheduler


@dataclass(frozen=True, slots=True)
class RemoteRequest:
    """What the decode worker asks a prefill worker for (the job's engine-side fields)."""

    request_id: str
    token_ids: list[int]
    num_cached_tokens: int
    block_ids: list[int]
    timeout_s: float


@dataclass(slots=True)
class RemoteCounters:
    """Totals since the engine started, for /metrics."""

    num_requested: int = 0
    num_completed: int = 0
    num_fallback_deadline: int = 0
    num_fallback_unqueued: int = 0
    num_aborted: int = 0
    num_remote_tokens: int = 0  # prompt tokens whose KV came from prefill workers

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


class RemotePrefills:
    """See the module docstring."""

    def __init__(self, scheduler: Scheduler, timeout_s: float, grace_s: float = 0.5) -> None:
        if timeout_s <= 0 or grace_s < 0:
            raise ValueError("remote prefill timeout must be > 0 and the grace >= 0")
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.counters = RemoteCounters()
        # request id -> (job deadline + grace, first token filled remotely, tokens with KV once filled)
        self._pending: dict[str, tuple[float, int, int]] = {}
        self._releases: dict[str, float] = {}  # held request id -> when to free its blocks

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take_requests(self, now: float) -> list[RemoteRequest]:
        """The scheduler's newly admitted remote tasks, now with deadlines."""
        requests = []
        for task in self.scheduler.take_remote_tasks():
            requests.append(self._track(task, now))
        return requests

    def _track(self, task: RemoteTask, now: float) -> RemoteRequest:
        request = task.request
        num_filled = task.num_cached_tokens + len(task.block_ids) * self.scheduler.pool.block_size
        self._pending[request.request_id] = (now + self.timeout_s + self.grace_s, task.num_cached_tokens, num_filled)
        self.counters.num_requested += 1
        prompt = request.token_ids[: request.num_prompt_tokens]
        return RemoteRequest(request.request_id, prompt, task.num_cached_tokens, list(task.block_ids), self.timeout_s)

    def on_ready(self, request_id: str) -> bool:
        """The KV of `request_id` arrived: it runs now. False if it no longer waited for it."""
        entry = self._pending.pop(request_id, None)
        if entry is None or not self.scheduler.complete_remote(request_id, entry[2]):
            return False
        self.counters.num_completed += 1
        self.counters.num_remote_tokens += entry[2] - entry[1]
        return True

    def on_failed(self, request_id: str) -> bool:
        """The job could not be queued (queue down, duplicate): prefill locally now."""
        if self._pending.pop(request_id, None) is None:
            return False
        self.counters.num_fallback_unqueued += 1
        return self.scheduler.fallback_remote(request_id)

    def apply(self, event: str, request_id: str) -> None:
        """An engine's queued disaggregation event: "ready" (`on_ready`), "failed"
        (`on_failed`) or "release" (a `hold_blocks` request's blocks are done with)."""
        if event == "ready":
            self.on_ready(request_id)
        elif event == "failed":
            self.on_failed(request_id)
        elif event == "release":
            self.scheduler.release(request_id)
        else:
            raise ValueError(f"unknown remote prefill event {event!r}")

    def on_abort(self, request_id: str) -> None:
        """Call after `Scheduler.abort`: a remote-prefilling request's blocks are held until
        its deadline plus the grace, then freed by `expire`."""
        entry = self._pending.pop(request_id, None)
        if entry is not None and request_id in self.scheduler.held:
            self._releases[request_id] = entry[0]
            self.counters.num_aborted += 1

    def expire(self, now: float) -> list[str]:
        """Falls back the requests past their deadline and frees due held blocks;
        returns the request ids that fell back."""
        expired = [rid for rid, (deadline, _, _) in self._pending.items() if deadline <= now]
        for request_id in expired:
            del self._pending[request_id]
            self.scheduler.fallback_remote(request_id)
        self.counters.num_fallback_deadline += len(expired)
        for request_id in [rid for rid, due in self._releases.items() if due <= now]:
            del self._releases[request_id]
            self.scheduler.release(request_id)
        return expired

    def next_due(self) -> float | None:
        """The earliest deadline or release time, for an idle owner's wait."""
        times = [deadline for deadline, _, _ in self._pending.values()] + list(self._releases.values())
        return min(times, default=None)

    def release_all(self) -> None:
        """Frees every held block now (the engine is stopping)."""
        for request_id in list(self._releases):
            self.scheduler.release(request_id)
        self._releases.clear()
