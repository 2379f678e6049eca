"""Filter `busy`: skip workers over a KV-usage or waiting-queue threshold, while any is under.

A worker is busy when its reported `kv_usage` exceeds `busy_max_kv_usage` or its
reported `num_waiting` exceeds `busy_max_waiting`. NOTE: if every candidate is busy,
all of them are kept: the fleet is saturated, failing the request would not help, and
the scorers still rank the least bad first. Reported values only: they lag by at most
one load-report interval, which is what a threshold on a worker's own state needs (the
scorers weigh the router's fresher predictions).

Consumes: `Candidate.kv_usage`, `Candidate.num_waiting`. Produces: the candidates under
both thresholds (or all of them, see above), in their order. Config:
`busy_max_kv_usage` (fraction, 1.0 disables it), `busy_max_waiting` (requests).
"""

from __future__ import annotations

from router.policy.base import Candidate, PluginBase, PolicyState, RouteRequest, register_filter
from router.policy.config import PolicyConfig


@register_filter("busy")
class BusyFilter(PluginBase):
    def __init__(self, max_kv_usage: float = 1.0, max_waiting: int = 1 << 30) -> None:
        self.max_kv_usage = max_kv_usage
        self.max_waiting = max_waiting

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> BusyFilter:
        return cls(config.busy_max_kv_usage, config.busy_max_waiting)

    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        max_kv_usage, max_waiting = self.max_kv_usage, self.max_waiting
        idle = [c for c in candidates if c.kv_usage <= max_kv_usage and c.num_waiting <= max_waiting]
        return idle or candidates

    def describe(self) -> dict[str, object]:
        return {"max_kv_usage": self.max_kv_usage, "max_waiting": self.max_waiting}
