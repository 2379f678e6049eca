"""The all-to-all backend interface that expert parallelism talks through, and its
single-process implementation.

Owns `AllToAllBackend` (what dispatch/combine need from a transport), `AllToAllHandle`
(an exchange in flight), `CountedHandle` (one whose receive counts arrive with it),
`KnownCountsHandle` and `SingleProcessBackend` (EP size 1: every exchange is the
identity, already complete).

The interface is split in two on purpose. `exchange_counts` is a small blocking step
(each rank learns how many rows every peer will send it). `all_to_all` then only
*starts* the bulk transfer and returns a handle; the caller may run other work
(another micro-batch, the shared expert) and call `handle.wait()` when it needs the
rows. A Dual Batch Overlap scheduler yields between the start and the wait; a kernel
library with its own receive hooks (DeepEP) fits the same shape as another backend.
`start_all_to_all_v` joins the two for a dispatch: by default it blocks for the counts
and starts the rows; a backend that can also defer the count exchange
(`worker.moe.a2a_stream.CommStreamBackend`) returns at once, so a micro-batch that
yields right after it loses no compute time to the ranks lining up.

Invariants: on every rank the calls happen in the same order (they are collectives);
`send_counts[r]` rows go to rank r, in rank order; the result holds `recv_counts[r]`
rows from rank r, in rank order.
Callers: `worker.moe.dispatch`; implementations: this module, `worker.moe.a2a_torch`,
and the wrappers `worker.moe.a2a_emulated` and `worker.moe.a2a_stream`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, Sequence

import torch


class AllToAllHandle(Protocol):
    """An all-to-all that has been started; `wait` blocks until its result is ready."""

    def is_completed(self) -> bool: ...

    def wait(self) -> torch.Tensor: ...


class CountedHandle(Protocol):
    """A started exchange whose receive counts were not known when it was started."""

    def is_completed(self) -> bool: ...

    def wait(self) -> torch.Tensor: ...

    def recv_counts(self) -> list[int]: ...


class KnownCountsHandle:
    """A `CountedHandle` over a plain handle whose receive counts are already known."""

    __slots__ = ("_inner", "_recv_counts")

    def __init__(self, inner: AllToAllHandle, recv_counts: list[int]) -> None:
        self._inner = inner
        self._recv_counts = recv_counts

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def wait(self) -> torch.Tensor:
        return self._inner.wait()

    def recv_counts(self) -> list[int]:
        return self._recv_counts

    def __getattr__(self, name: str):
        # NOTE: optional handle attributes (a backend's `recv_hook`) stay visible.
        return getattr(self._inner, name)


class CompletedHandle:
    """A handle whose result is already known (local exchanges, empty transfers)."""

    __slots__ = ("_result",)

    def __init__(self, result: torch.Tensor) -> None:
        self._result = result

    def is_completed(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        return self._result


class AllToAllBackend(ABC):
    """A group of `world_size` ranks exchanging variable-length row blocks."""

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @abstractmethod
    def exchange_counts(self, send_counts: Sequence[int]) -> list[int]:
        """Blocking: given how many rows this rank sends to each rank, return how many
        rows it receives from each rank."""

    @abstractmethod
    def all_to_all(
        self, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> AllToAllHandle:
        """Start sending `rows` (dim 0 split by `send_counts`); the handle yields the
        `sum(recv_counts)` received rows, same trailing shape and dtype."""

    def start_all_to_all_v(self, rows: torch.Tensor, send_counts: Sequence[int]) -> CountedHandle:
        """Start sending `rows` without knowing the receive counts yet: the counts are
        exchanged first, then the rows. This default blocks for the count exchange;
        a backend that can run both behind the handle overrides it."""
        recv_counts = self.exchange_counts(send_counts)
        return KnownCountsHandle(self.all_to_all(rows, send_counts, recv_counts), recv_counts)


class WrappedBackend(AllToAllBackend, ABC):
    """A backend that adds something around `inner` (link emulation, a stream, a meter):
    same rank and group, its own `exchange_counts` and `all_to_all`."""

    def __init__(self, inner: AllToAllBackend) -> None:
        self.inner = inner

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size


def check_counts(backend: AllToAllBackend, rows: torch.Tensor, send_counts: Sequence[int]) -> None:
    """Raise ValueError when `send_counts` does not describe `rows` for this group."""
    if len(send_counts) != backend.world_size:
        raise ValueError(f"send_counts must have {backend.world_size} entries, got {len(send_counts)}")
    if any(c < 0 for c in send_counts) or sum(send_counts) != rows.shape[0]:
        raise ValueError(f"send_counts {list(send_counts)} do not split {rows.shape[0]} rows")


class SingleProcessBackend(AllToAllBackend):
    """EP size 1: this rank holds every expert, so every row comes straight back."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def exchange_counts(self, send_counts: Sequence[int]) -> list[int]:
        if len(send_counts) != 1:
            raise ValueError(f"send_counts must have 1 entry, got {len(send_counts)}")
        return [int(send_counts[0])]

    def all_to_all(
        self, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> AllToAllHandle:
        check_counts(self, rows, send_counts)
        if list(recv_counts) != list(send_counts):
            raise ValueError(f"recv_counts {list(recv_counts)} must equal send_counts {list(send_counts)}")
        return CompletedHandle(rows)
