"""Which EP rank holds which expert: `ExpertPlacement`, a pure value type.

Owns the static map from global expert id to the expert-parallel rank that holds it.
Experts are split into contiguous blocks, one per rank; when `num_experts` is not a
multiple of `ep_size` the first `num_experts % ep_size` ranks hold one extra expert.

Invariants (checked at construction, naming the bad field): `ep_size >= 1`,
`num_experts >= ep_size` (every rank holds at least one expert).
Callers: `worker.moe.dispatch` (destination rank of each routed token) and
`worker.moe.layer` (which experts a rank builds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Contiguous, near-even split of `num_experts` experts over `ep_size` ranks."""

    num_experts: int
    ep_size: int

    def __post_init__(self) -> None:
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {self.ep_size}")
        if self.num_experts < self.ep_size:
            raise ValueError(f"num_experts must be >= ep_size ({self.ep_size}), got {self.num_experts}")

    def num_local_experts(self, rank: int) -> int:
        """How many experts `rank` holds."""
        self._check_rank(rank)
        base, extra = divmod(self.num_experts, self.ep_size)
        return base + (1 if rank < extra else 0)

    def first_expert(self, rank: int) -> int:
        """Global id of the first expert `rank` holds."""
        self._check_rank(rank)
        base, extra = divmod(self.num_experts, self.ep_size)
        return rank * base + min(rank, extra)

    def local_experts(self, rank: int) -> range:
        """Global ids of the experts `rank` holds, in ascending order."""
        first = self.first_expert(rank)
        return range(first, first + self.num_local_experts(rank))

    def rank_of(self, expert_id: int) -> int:
        """The rank that holds global expert `expert_id`."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert_id must be in [0, {self.num_experts}), got {expert_id}")
        return next(r for r in range(self.ep_size) if expert_id in self.local_experts(r))

    def rank_table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 [num_experts]: entry e is the rank holding expert e (for vectorised lookups)."""
        table = torch.empty(self.num_experts, dtype=torch.int64)
        for rank in range(self.ep_size):
            experts = self.local_experts(rank)
            table[experts.start : experts.stop] = rank
        return table.to(device)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank must be in [0, {self.ep_size}), got {rank}")
