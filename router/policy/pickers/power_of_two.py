"""Picker `power-of-two`: draw two candidates at random, the better scored one first.

The classic "power of two choices": almost the balance of always picking the least
loaded worker, without every router herding onto the same one. The rest of the
ranking (for retries) follows by descending score.

Consumes: `Candidate.score` (the `power_of_two` policy scores negated load). Produces:
every candidate: the better of the two drawn, the other one, then the rest by score.
Config: `seed`.
"""

from __future__ import annotations

import random

from router.policy.base import Candidate, PluginBase, PolicyState, RouteRequest, rank_by_score, register_picker
from router.policy.config import PolicyConfig


@register_picker("power-of-two")
class PowerOfTwoPicker(PluginBase):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> PowerOfTwoPicker:
        return cls(state.rng)

    def pick(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        if len(candidates) <= 1:
            return list(candidates)
        first, second = self.rng.sample(range(len(candidates)), 2)
        a, b = candidates[first], candidates[second]
        if b.score > a.score:
            a, b = b, a
        rest = [c for i, c in enumerate(candidates) if i != first and i != second]
        return [a, b, *rank_by_score(rest, self.rng)]
