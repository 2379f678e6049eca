"""The mixture-of-experts feed-forward: softmax router, top-k experts, optional shared expert.

Owns `MoE`, the FFN of every decoder layer of `worker.models.transformer`. For each
token the router (`gate`, a linear map to `num_experts` logits) gives a softmax over
experts; the token goes to its `num_experts_per_tok` most likely experts, whose
outputs are summed weighted by those probabilities (renormalized to sum to 1 when
`norm_topk_prob`). A shared expert, when configured, sees every token and is added.

Computation is grouped by expert: each expert runs once per step over the tokens
routed to it (so its cost grows with the batch, not with a per-token loop). Routing is
computed in float32 so ties break the same way whatever the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.config import ModelConfig
from worker.models.layers import GatedMLP


class MoE(nn.Module):
    """Top-k routed experts plus an optional always-on shared expert."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        self.shared_expert = (
            GatedMLP(config.hidden_size, config.shared_expert_intermediate_size)
            if config.shared_expert_intermediate_size
            else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k])."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, expert_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.route(x)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat_ids = expert_ids.flatten()
        # Sorting the (token, slot) pairs by expert makes each expert's tokens contiguous.
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        weight_of = weights.flatten()[order]
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                tokens = token_of[start : start + count]
                y = expert(x.index_select(0, tokens)).float() * weight_of[start : start + count, None]
                out.index_add_(0, tokens, y)
            start += count
        if self.shared_expert is not None:
            out += self.shared_expert(x).float()
        return out.to(x.dtype)
