"""The expert-parallel MoE layer: one rank's share of `worker.models.moe.MoE`.

Owns `ExpertParallelMoE`, which holds the router (`gate`) and the shared expert in
full (they are replicated on every rank) but only this rank's routed experts, per
`ExpertPlacement`. A forward pass routes locally, dispatches each token to the ranks
holding its top-k experts, runs the local experts over what arrived, and combines the
weighted results back onto the tokens' own rank; the shared expert runs while the
combine is in flight.

The staged methods (`start_dispatch`, `run_experts`, `start_combine`) are public so a
micro-batch scheduler can interleave two batches; `forward` runs them in order,
with DBO yield points (`worker.moe.ubatch`) after each transfer is started.
Parameter names match `MoE`'s (`gate.*`, `experts.<global id>.*`, `shared_expert.*`),
so a full checkpoint loads through `shard_state_dict`.

Invariants: every rank of the group calls `forward` (or the staged methods) the same
number of times in the same order, even with zero tokens; with EP size 1 the output
equals `MoE`'s for the same weights (up to float32 summation order).
Callers: EP worker processes, tests, the DBO benchmark.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.config import ModelConfig
from worker.models.layers import GatedMLP
from worker.models.moe import MoE
from worker.moe.a2a import AllToAllBackend
from worker.moe.dispatch import DispatchedTokens, DispatchPlan, ExpertDispatcher, PendingCombine, PendingDispatch
from worker.moe.placement import ExpertPlacement
from worker.moe.ubatch import dbo_yield_after_start


class ExpertParallelMoE(nn.Module):
    """Replicated router and shared expert, sharded routed experts, all-to-all between."""

    def __init__(
        self, config: ModelConfig, backend: AllToAllBackend, placement: ExpertPlacement | None = None
    ) -> None:
        super().__init__()
        placement = placement or ExpertPlacement(config.num_experts, backend.world_size)
        if placement.num_experts != config.num_experts:
            raise ValueError(
                f"placement.num_experts ({placement.num_experts}) must equal config.num_experts ({config.num_experts})"
            )
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.local_experts = placement.local_experts(backend.rank)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleDict(
            {str(e): GatedMLP(config.hidden_size, config.moe_intermediate_size) for e in self.local_experts}
        )
        self.shared_expert = (
            GatedMLP(config.hidden_size, config.shared_expert_intermediate_size)
            if config.shared_expert_intermediate_size
            else None
        )
        self.dispatcher = ExpertDispatcher(backend, placement)

    @classmethod
    def from_moe(
        cls,
        config: ModelConfig,
        moe: MoE,
        backend: AllToAllBackend,
        placement: ExpertPlacement | None = None,
    ) -> ExpertParallelMoE:
        """This rank's shard of a full single-rank `MoE` (weights copied)."""
        layer = cls(config, backend, placement).to(next(moe.parameters()).dtype)
        layer.load_state_dict(layer.shard_state_dict(moe.state_dict()))
        return layer

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keep the entries of a full `MoE` state dict that this rank holds."""
        local = {str(e) for e in self.local_experts}
        return {k: v for k, v in full.items() if not k.startswith("experts.") or k.split(".")[1] in local}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k])."""
        # NOTE: identical to MoE.route, so EP and single-rank pick the same experts.
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, expert_ids

    def start_dispatch(self, x: torch.Tensor) -> PendingDispatch:
        """Route x [T, hidden] and start sending it to the expert ranks."""
        weights, expert_ids = self.route(x)
        return self.dispatcher.dispatch(x, weights, expert_ids)

    def run_experts(self, tokens: DispatchedTokens) -> torch.Tensor:
        """float32 [num_recv, hidden]: each received row through its local experts, weighted."""
        hidden = tokens.hidden
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        num_local = len(self.local_experts)
        local_ids = tokens.expert_ids.flatten() - self.local_experts.start
        # Slots for experts held elsewhere (-1) sort last, into a bin no expert reads.
        local_ids = torch.where(tokens.expert_ids.flatten() < 0, num_local, local_ids)
        order = local_ids.argsort(stable=True)
        counts = torch.bincount(local_ids, minlength=num_local + 1).tolist()
        row_of = order // self.top_k
        weight_of = tokens.weights.flatten()[order]
        start = 0
        for expert_id, count in zip(self.local_experts, counts):
            if count:
                rows = row_of[start : start + count]
                y = self.experts[str(expert_id)](hidden.index_select(0, rows)).float()
                out.index_add_(0, rows, y * weight_of[start : start + count, None])
            start += count
        return out

    def start_combine(self, expert_out: torch.Tensor, plan: DispatchPlan) -> PendingCombine:
        """Start returning `run_experts`' rows to the ranks the tokens came from."""
        return self.dispatcher.combine(expert_out, plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Yield points (no-ops without DBO): the other micro-batch computes while
        # this one's dispatch, then its combine, is in flight.
        dispatch = self.start_dispatch(x)
        dbo_yield_after_start(dispatch)
        tokens = dispatch.wait()
        pending = self.start_combine(self.run_experts(tokens), tokens.plan)
        dbo_yield_after_start(pending)
        shared = self.shared_expert(x).float() if self.shared_expert is not None else None
        out = pending.wait()
        if shared is not None:
            out += shared
        return out.to(x.dtype)
