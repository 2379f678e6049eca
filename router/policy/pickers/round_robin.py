"""Picker `round-robin`: each request starts one step further along the worker list.

Candidates are ordered by `(worker_id, dp_rank)`, so the rotation does not depend on
the order the router lists them in; the ranking is that order rotated to start at the
next position, so a retry goes to the following worker. The position survives a
reconfiguration (it lives in the policy's state).

Consumes: candidate keys. Produces: every candidate, rotated. Config: none.
"""

from __future__ import annotations

import itertools

from router.policy.base import Candidate, PluginBase, PolicyState, RouteRequest, register_picker
from router.policy.config import PolicyConfig

POSITION_STATE = "round-robin-position"


@register_picker("round-robin")
class RoundRobinPicker(PluginBase):
    def __init__(self, counter: itertools.count | None = None) -> None:
        self._counter = counter if counter is not None else itertools.count()

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> RoundRobinPicker:
        counter = state.get_or_create(POSITION_STATE, itertools.count)
        assert isinstance(counter, itertools.count)
        return cls(counter)

    def pick(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda c: (c.worker_id, c.dp_rank))
        start = next(self._counter) % len(ordered)
        return ordered[start:] + ordered[:start]
