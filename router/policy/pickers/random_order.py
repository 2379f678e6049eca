"""Picker `random`: every candidate in uniformly random order (a baseline).

Consumes: nothing but the candidates. Produces: a random permutation. Config: `seed`.
"""

from __future__ import annotations

import random

from router.policy.base import Candidate, PluginBase, PolicyState, RouteRequest, register_picker
from router.policy.config import PolicyConfig


@register_picker("random")
class RandomPicker(PluginBase):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> RandomPicker:
        return cls(state.rng)

    def pick(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        ranked = list(candidates)
        self.rng.shuffle(ranked)
        return ranked
