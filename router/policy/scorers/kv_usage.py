"""Scorer `kv-usage`: how full a worker's KV cache is (a cost).

value = max(reported kv_usage, predicted_blocks / num_kv_blocks_total), capped at 1:
the report is the worker's truth as of its last tick, the prediction adds the blocks of
requests dispatched since. A full cache means evictions (lost prefixes) and preemption,
so its weight enters the score negated.

Consumes: `Candidate.kv_usage`, `predicted_blocks`, `num_kv_blocks_total`. Produces:
`scores["kv-usage"]` in [0, 1]. Config: `kv_usage_weight`.
"""

from __future__ import annotations

from router.policy.base import Candidate, RouteRequest, ScorerBase, register_scorer


def kv_fill(candidate: Candidate) -> float:
    """The candidate's KV usage, reported or predicted, whichever is larger, in [0, 1]."""
    usage = candidate.kv_usage
    if candidate.num_kv_blocks_total > 0:
        predicted = candidate.predicted_blocks / candidate.num_kv_blocks_total
        if predicted > usage:
            usage = predicted
    return 1.0 if usage > 1.0 else usage


@register_scorer("kv-usage")
class KVUsageScorer(ScorerBase):
    higher_is_better = False
    weight_field = "kv_usage_weight"

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]:
        return [kv_fill(candidate) for candidate in candidates]
