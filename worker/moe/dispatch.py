"""Dispatch and combine: moving routed tokens to the ranks holding their experts and
bringing the weighted expert outputs back.

Owns `plan_dispatch` (pure: which rows go to which rank), `ExpertDispatcher` (runs a
plan over an `AllToAllBackend`) and the in-flight objects `PendingDispatch` and
`PendingCombine`, whose `wait()` a Dual Batch Overlap scheduler may defer.

Each token is sent at most once to each rank, however many of its top-k experts that
rank holds; with it travel its top-k expert ids and router weights, masked (id -1,
weight 0) where the expert lives elsewhere, packed into the same row
(`worker.moe.payload`), so a dispatch is one transfer: one latency, one turn on the
link. It is started with `start_all_to_all_v`, so a backend that can defer the count
exchange (`CommStreamBackend`) lets the caller yield before the ranks have lined up.
The expert rank returns one float32 row per received row, already weighted and summed
over its local experts; combine sends these rows back along the reverse split and
sums them per origin token.

Invariants: sent rows are grouped by destination rank in ascending order and, within a
rank, by ascending token index; the combine rows come back in exactly that order.
Callers: `worker.moe.layer.ExpertParallelMoE`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from worker.moe.a2a import AllToAllBackend, AllToAllHandle
from worker.moe.payload import RowLayout, pack_rows, unpack_rows
from worker.moe.placement import ExpertPlacement


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """Where each row of one dispatch came from and how the exchange was split."""

    token_index: torch.Tensor  # int64 [num_sent]: origin token of each sent row
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    num_tokens: int  # tokens on this rank before dispatch


@dataclass(frozen=True, slots=True)
class DispatchedTokens:
    """The rows this rank received: hidden states plus the routing that applies here."""

    hidden: torch.Tensor  # [num_recv, hidden]
    expert_ids: torch.Tensor  # int64 [num_recv, k]: global ids, -1 where held elsewhere
    weights: torch.Tensor  # float32 [num_recv, k]: router weights, 0 where held elsewhere
    plan: DispatchPlan


def plan_dispatch(
    expert_ids: torch.Tensor, rank_table: torch.Tensor, ep_size: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """expert_ids [T, k] -> (token_index [M], dest_rank [M], send_counts [ep_size]).

    Row m of the send buffer is token `token_index[m]` bound for rank `dest_rank[m]`.
    """
    dest = rank_table[expert_ids]  # [T, k]
    ranks = torch.arange(ep_size, device=expert_ids.device)
    wanted = (dest.unsqueeze(-1) == ranks).any(dim=1)  # [T, ep_size]
    # nonzero() on the transpose lists (rank, token) pairs in lexicographic order.
    pairs = wanted.t().nonzero()
    send_counts = wanted.sum(dim=0).tolist()
    return pairs[:, 1], pairs[:, 0], send_counts


def _recv_hooks(handles: tuple[AllToAllHandle, ...]) -> tuple[Callable[[], object], ...]:
    # NOTE: `recv_hook` is optional on handles; torch.distributed handles have none.
    hooks = (getattr(h, "recv_hook", None) for h in handles)
    return tuple(h for h in hooks if h is not None)


class PendingDispatch:
    """A started dispatch; `wait` returns the `DispatchedTokens` this rank received.

    With a `layout`, `handles` is one transfer of packed rows (hidden, ids, weights);
    if that handle is a `CountedHandle` (started before the counts were exchanged),
    the plan's `recv_counts` are taken from it at `wait`. Without a layout, `handles`
    is three transfers, one per field, under a complete plan.
    """

    __slots__ = ("_handles", "_plan", "_layout")

    def __init__(
        self, handles: tuple[AllToAllHandle, ...], plan: DispatchPlan, layout: RowLayout | None = None
    ) -> None:
        if len(handles) != (1 if layout is not None else 3):
            raise ValueError(f"a {'packed' if layout else 'field-wise'} dispatch cannot have {len(handles)} handles")
        self._handles = handles
        self._plan = plan
        self._layout = layout

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)

    def recv_hooks(self) -> tuple[Callable[[], object], ...]:
        """The handles' receive hooks (backends that post receives separately), if any."""
        return _recv_hooks(self._handles)

    def wait(self) -> DispatchedTokens:
        if self._layout is None:
            hidden, expert_ids, weights = (h.wait() for h in self._handles)
            return DispatchedTokens(hidden, expert_ids, weights, self._plan)
        (handle,) = self._handles
        hidden, expert_ids, weights = unpack_rows(handle.wait(), self._layout)
        recv_counts = getattr(handle, "recv_counts", None)
        plan = self._plan if recv_counts is None else replace(self._plan, recv_counts=recv_counts())
        return DispatchedTokens(hidden, expert_ids, weights, plan)


class PendingCombine:
    """A started combine; `wait` returns float32 [num_tokens, hidden], summed per token."""

    __slots__ = ("_handle", "_plan")

    def __init__(self, handle: AllToAllHandle, plan: DispatchPlan) -> None:
        self._handle = handle
        self._plan = plan

    def is_completed(self) -> bool:
        return self._handle.is_completed()

    def recv_hooks(self) -> tuple[Callable[[], object], ...]:
        """The handle's receive hook (backends that post receives separately), if any."""
        return _recv_hooks((self._handle,))

    def wait(self) -> torch.Tensor:
        rows = self._handle.wait()
        out = rows.new_zeros((self._plan.num_tokens, rows.shape[1]))
        return out.index_add_(0, self._plan.token_index, rows)


class ExpertDispatcher:
    """Runs dispatch and combine for one rank of an EP group."""

    def __init__(self, backend: AllToAllBackend, placement: ExpertPlacement) -> None:
        if placement.ep_size != backend.world_size:
            raise ValueError(
                f"placement.ep_size ({placement.ep_size}) must equal the backend's world_size ({backend.world_size})"
            )
        self.backend = backend
        self.placement = placement
        self._rank_table = placement.rank_table()

    def dispatch(self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> PendingDispatch:
        """Start sending each token of hidden [T, H] to the ranks of its expert_ids [T, k].

        The count exchange and the row transfer both run behind the handle where the
        backend can do that (`CommStreamBackend`); otherwise this blocks for the counts.
        """
        table = self._rank_table.to(expert_ids.device)
        token_index, dest_rank, send_counts = plan_dispatch(expert_ids, table, self.placement.ep_size)
        # recv_counts are filled in from the handle once the counts are exchanged.
        plan = DispatchPlan(token_index, send_counts, [], hidden.shape[0])
        sent_ids = expert_ids.index_select(0, token_index)
        elsewhere = table[sent_ids] != dest_rank.unsqueeze(1)
        sent_ids = sent_ids.masked_fill(elsewhere, -1)
        sent_weights = weights.float().index_select(0, token_index).masked_fill(elsewhere, 0.0)
        fields = (hidden.index_select(0, token_index), sent_ids, sent_weights)
        # One transfer, not three: each pays the link's latency and its turn on the link.
        layout = RowLayout.of(fields)
        handle = self.backend.start_all_to_all_v(pack_rows(fields, layout), send_counts)
        return PendingDispatch((handle,), plan, layout)

    def combine(self, expert_out: torch.Tensor, plan: DispatchPlan) -> PendingCombine:
        """Start returning expert_out [num_recv, H] (float32, weighted) to the origin ranks."""
        if expert_out.shape[0] != sum(plan.recv_counts):
            raise ValueError(f"expert_out has {expert_out.shape[0]} rows, dispatch received {sum(plan.recv_counts)}")
        handle = self.backend.all_to_all(expert_out.float(), plan.recv_counts, plan.send_counts)
        return PendingCombine(handle, plan)
