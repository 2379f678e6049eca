"""Picker `max-score`: highest `Candidate.score` first; equal scores in random order.

The random tie-break matters: on an idle fleet with an empty cache every score is
equal, and a fixed order would send every such request to the same worker.

Consumes: `Candidate.score`. Produces: every candidate, by descending score. Config:
`seed` (the tie-break's random source; None seeds from the OS).
"""

from __future__ import annotations

import random

from router.policy.base import Candidate, PluginBase, PolicyState, RouteRequest, rank_by_score, register_picker
from router.policy.config import PolicyConfig


@register_picker("max-score")
class MaxScorePicker(PluginBase):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> MaxScorePicker:
        return cls(state.rng)

    def pick(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        if len(candidates) <= 1:
            return list(candidates)
        return rank_by_score(candidates, self.rng)
