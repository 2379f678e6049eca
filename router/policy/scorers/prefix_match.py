"""Scorer `prefix-match`: the share of the prompt's full blocks a worker already caches.

value = matched_blocks / (num_prompt_tokens // block_size), at that worker's block
size; 0 for a prompt shorter than one block (nothing can be cached). A benefit: its
weight enters the score positive.

Consumes: `Candidate.matched_blocks` (from the lookup step), `Candidate.block_size`,
`RouteRequest.num_prompt_tokens`. Produces: `scores["prefix-match"]` in [0, 1].
Config: `prefix_weight`.
"""

from __future__ import annotations

from router.policy.base import Candidate, RouteRequest, ScorerBase, register_scorer


@register_scorer("prefix-match")
class PrefixMatchScorer(ScorerBase):
    higher_is_better = True
    weight_field = "prefix_weight"

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]:
        num_tokens = request.num_prompt_tokens
        values = []
        for candidate in candidates:
            num_full_blocks = num_tokens // candidate.block_size
            if num_full_blocks <= 0 or candidate.matched_blocks <= 0:
                values.append(0.0)
            else:
                values.append(min(1.0, candidate.matched_blocks / num_full_blocks))
        return values
