"""Picker `softmax`: sample candidates with probability proportional to exp(score / T).

The first candidate is drawn from the softmax of the scores at temperature `T`, the
second from the softmax of the rest, and so on. That ranking is drawn in one sort: by
`score / T + g` with `g` independent standard Gumbel noise (the Gumbel-top-k trick).
Low `T` approaches `max-score`; high `T` approaches `random`. Sampling spreads requests
whose best scores are close instead of always sending them to the same worker.

Consumes: `Candidate.score`. Produces: every candidate, in sampled order. Config:
`temperature` (> 0), `seed`.
"""

from __future__ import annotations

import math
import random

from router.policy.base import Candidate, PluginBase, PolicyState, RouteRequest, register_picker
from router.policy.config import PolicyConfig


@register_picker("softmax")
class SoftmaxPicker(PluginBase):
    def __init__(self, temperature: float, rng: random.Random) -> None:
        if temperature <= 0:
            raise ValueError("softmax temperature must be positive")
        self.temperature = temperature
        self.rng = rng

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> SoftmaxPicker:
        return cls(config.temperature, state.rng)

    def pick(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        if len(candidates) <= 1:
            return list(candidates)
        inverse_t = 1.0 / self.temperature
        random_, log = self.rng.random, math.log
        # Gumbel noise needs u in (0, 1); random() is in [0, 1), so only 0 is replaced.
        keys = [c.score * inverse_t - log(-log(random_() or 1e-300)) for c in candidates]
        order = sorted(range(len(candidates)), key=keys.__getitem__, reverse=True)
        return [candidates[i] for i in order]

    def describe(self) -> dict[str, object]:
        return {"temperature": self.temperature}
