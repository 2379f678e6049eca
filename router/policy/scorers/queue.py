"""Scorer `queue`: how many requests wait at a worker, relative to the longest queue (a cost).

waiting = max(reported num_waiting, predicted_requests - num_running): the report's
queue plus the requests the router sent since that the worker has not reported yet.
value = waiting / max(queue_floor, longest waiting among the candidates), so the
longest queue scores 1 and short queues stay near 0 while every queue is short.

Consumes: `Candidate.num_waiting`, `num_running`, `predicted_requests`. Produces:
`scores["queue"]` in [0, 1]. Config: `queue_weight`, `queue_floor` (requests).
"""

from __future__ import annotations

from router.policy.base import Candidate, PolicyState, RouteRequest, ScorerBase, register_scorer
from router.policy.config import PolicyConfig


@register_scorer("queue")
class QueueScorer(ScorerBase):
    higher_is_better = False
    weight_field = "queue_weight"

    def __init__(self, weight: float = -1.0, floor: int = 4) -> None:
        super().__init__(weight)
        self.floor = floor

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> QueueScorer:
        return cls(-config.queue_weight, config.queue_floor)

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]:
        waiting = [max(c.num_waiting, c.predicted_requests - c.num_running) for c in candidates]
        scale = max(self.floor, max(waiting))
        return [n / scale for n in waiting]

    def describe(self) -> dict[str, object]:
        return {"weight": self.weight, "floor": self.floor}
