"""Picker `cache-aware`: cache affinity with an imbalance guard (the `cache_aware` policy).

The semantics of SGLang's cache-aware router, on kvgate's own approximate trees:

1. load = in-flight requests (`Candidate.num_requests`: the router's prediction or
   the worker's report, whichever is larger). The fleet is imbalanced when
   `max_load - min_load > balance_abs_threshold` and
   `max_load > min_load * balance_rel_threshold`; then the least loaded goes first.
2. Otherwise, if the best approximate match rate exceeds `cache_threshold`, the best
   matching candidate goes first (ties: least loaded, then random).
3. Otherwise (no worth-while match) the least loaded goes first (ties random).

The rest of the ranking, for retries, follows the same order.

Consumes: `scores["approx-prefix"]`, `Candidate.num_requests`. Produces: every
candidate, ranked. Config: `cache_threshold`, `balance_abs_threshold`,
`balance_rel_threshold`, `seed`.
"""

from __future__ import annotations

import random

from router.policy.base import Candidate, PluginBase, PolicyState, RouteRequest, register_picker
from router.policy.config import PolicyConfig

MATCH_SCORE = "approx-prefix"


@register_picker("cache-aware")
class CacheAwarePicker(PluginBase):
    def __init__(
        self,
        rng: random.Random,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 16,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.rng = rng
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> CacheAwarePicker:
        return cls(state.rng, config.cache_threshold, config.balance_abs_threshold, config.balance_rel_threshold)

    def is_imbalanced(self, loads: list[int]) -> bool:
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold

    def pick(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        if len(candidates) <= 1:
            return list(candidates)
        random_ = self.rng.random
        loads = [c.num_requests for c in candidates]
        indices = range(len(candidates))
        if not self.is_imbalanced(loads):
            matches = [c.scores.get(MATCH_SCORE, 0.0) for c in candidates]
            if max(matches) > self.cache_threshold:
                order = sorted(indices, key=lambda i: (-matches[i], loads[i], random_()))
                return [candidates[i] for i in order]
        return [candidates[i] for i in sorted(indices, key=lambda i: (loads[i], random_()))]

    def describe(self) -> dict[str, object]:
        return {
            "cache_threshold": self.cache_threshold,
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
        }
