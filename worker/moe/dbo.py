"""Dual Batch Overlap: whether a step is split into two micro-batches, and running it.

Owns `DboConfig` (the `--enable-dbo`, `--dbo-decode-token-threshold`,
`--dbo-prefill-token-threshold` knobs), `can_split` (this rank's pure decision),
`agree_split` (the DP-wide decision, one small all-reduce) and `dbo_forward` (run a
model over a split batch as two micro-batch threads, `worker.moe.ubatch`).

Split rule: a decode-only batch splits from `dbo_decode_token_threshold` tokens, a
batch with any prefill from `dbo_prefill_token_threshold`. All DP ranks must agree,
because the micro-batches' collectives have to pair up across ranks: if one rank
cannot split, none does; when all can, every rank pads its batch to the largest
token count and splits it at the same point, so the two micro-batches are never empty.

Invariants: every rank of the group calls `agree_split` once per step, in the same
order relative to the MoE collectives; after it, either all ranks run `dbo_forward`
with the same `UBatchSplit` or all run the model plainly.
Callers: EP worker steps, tests, `bench/dbo.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from worker.moe.ubatch import run_ubatches


@dataclass(frozen=True, slots=True)
class DboConfig:
    """Dual Batch Overlap settings (validated at construction, naming the bad field)."""

    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512

    def __post_init__(self) -> None:
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2 (two non-empty micro-batches), got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class UBatchSplit:
    """How every rank splits this step: pad to `num_tokens_padded`, cut at `split_at`."""

    num_tokens_padded: int
    split_at: int


def can_split(num_tokens: int, has_prefill: bool, config: DboConfig) -> bool:
    """This rank's own answer: is its batch large enough to micro-batch?"""
    if not config.enable_dbo:
        return False
    threshold = config.dbo_prefill_token_threshold if has_prefill else config.dbo_decode_token_threshold
    return num_tokens >= threshold


def agree_split(
    num_tokens: int,
    has_prefill: bool,
    config: DboConfig,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> UBatchSplit | None:
    """The DP-wide decision: a `UBatchSplit` on every rank, or None on every rank.

    One all-reduce (MAX) over [cannot_split, num_tokens]: any rank that cannot split
    vetoes, and the largest token count is what everyone pads to. Without an
    initialised process group the rank decides alone.
    """
    cannot = 0 if can_split(num_tokens, has_prefill, config) else 1
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        # NCCL reduces only CUDA tensors, hence the device.
        votes = torch.tensor([cannot, num_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
        cannot, max_tokens = votes.tolist()
    else:
        max_tokens = num_tokens
    if cannot:
        return None
    return UBatchSplit(num_tokens_padded=max_tokens, split_at=max_tokens // 2)


def dbo_forward(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, split: UBatchSplit) -> torch.Tensor:
    """Run `model` (row-independent over x [T, ...]) as two overlapped micro-batches.

    x is zero-padded to `split.num_tokens_padded` rows, the halves run in alternating
    threads that yield at the MoE layers' transfers, and the first T rows of the
    concatenated result are returned.
    """
    num_tokens = x.shape[0]
    if num_tokens > split.num_tokens_padded:
        raise ValueError(f"batch has {num_tokens} tokens, more than the agreed {split.num_tokens_padded}")
    if num_tokens < split.num_tokens_padded:
        pad = x.new_zeros((split.num_tokens_padded - num_tokens, *x.shape[1:]))
        x = torch.cat([x, pad])
    halves = (x[: split.split_at], x[split.split_at :])
    outs, _ = run_ubatches([lambda h=h: model(h) for h in halves])
    return torch.cat(outs)[:num_tokens]


def maybe_dbo_forward(
    model: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    has_prefill: bool,
    config: DboConfig,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, bool]:
    """One step: agree on the split with the other ranks, then run split or plain.

    Returns (output, whether the step was micro-batched).
    """
    if not config.enable_dbo:
        return model(x), False
    split = agree_split(x.shape[0], has_prefill, config, group, device=x.device)
    if split is None:
        return model(x), False
    return dbo_forward(model, x, split), True
