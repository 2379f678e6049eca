"""An emulated interconnect: an all-to-all backend wrapper that adds transfer time.

Owns `EmulatedLinkBackend`, which wraps any `AllToAllBackend` and makes each bulk
transfer take `latency_s + bytes / bytes_per_s` on a single serial link per rank (a
transfer starts when the previous one has left the link), and `LinkStats`, the link
time and bytes it has charged. Bytes counted are the larger of what this rank sends to
and receives from *other* ranks (rows kept on the rank cost nothing).

The delay is served in `wait()` with `time.sleep`, which releases the GIL, so the other
micro-batch thread computes meanwhile: on a machine whose cores are too few or too
busy for real transfers to overlap, this measures the DBO schedule itself.

Invariants: the wrapped backend's results are returned unchanged; `exchange_counts`
costs `latency_s` only; `bytes_per_s = inf` charges nothing for bytes.
Callers: `bench/dbo.py`, tests.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from worker.moe.a2a import AllToAllBackend, AllToAllHandle, WrappedBackend


@dataclass(slots=True)
class LinkStats:
    """What the emulated link has charged since the last `reset`."""

    num_transfers: int = 0
    num_bytes: int = 0
    busy_s: float = 0.0


class DelayedHandle:
    """A wrapped handle whose result is released no earlier than `ready_at`."""

    __slots__ = ("_inner", "_ready_at")

    def __init__(self, inner: AllToAllHandle, ready_at: float) -> None:
        self._inner = inner
        self._ready_at = ready_at

    def is_completed(self) -> bool:
        return time.monotonic() >= self._ready_at and self._inner.is_completed()

    def wait(self) -> torch.Tensor:
        result = self._inner.wait()
        remaining = self._ready_at - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        return result


class EmulatedLinkBackend(WrappedBackend):
    """`inner` with transfers slowed to `bytes_per_s` plus `latency_s` each."""

    def __init__(self, inner: AllToAllBackend, bytes_per_s: float = math.inf, latency_s: float = 0.0) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be positive, got {bytes_per_s}")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        super().__init__(inner)
        self.bytes_per_s = bytes_per_s
        self.latency_s = latency_s
        self.stats = LinkStats()
        self._link_free_at = 0.0

    def reset_stats(self) -> LinkStats:
        """Return the stats so far and start counting afresh."""
        stats, self.stats = self.stats, LinkStats()
        return stats

    def exchange_counts(self, send_counts: Sequence[int]) -> list[int]:
        recv = self.inner.exchange_counts(send_counts)
        if self.latency_s:
            time.sleep(self.latency_s)
        return recv

    def all_to_all(
        self, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> AllToAllHandle:
        handle = self.inner.all_to_all(rows, send_counts, recv_counts)
        row_bytes = rows.element_size() * math.prod(rows.shape[1:])
        me = self.rank
        num_rows = max(sum(send_counts) - send_counts[me], sum(recv_counts) - recv_counts[me])
        num_bytes = num_rows * row_bytes
        duration = self.latency_s + num_bytes / self.bytes_per_s
        # One serial link: a transfer queues behind the ones still on it.
        start = max(time.monotonic(), self._link_free_at)
        self._link_free_at = start + duration
        self.stats.num_transfers += 1
        self.stats.num_bytes += num_bytes
        self.stats.busy_s += duration
        return DelayedHandle(handle, self._link_free_at)
