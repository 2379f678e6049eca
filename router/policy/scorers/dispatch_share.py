"""Scorer `dispatch-share`: how far a worker is above its fair share of recent requests (a cost).

Why: prefix affinity is sticky. When a prompt prefix is hot everywhere, or when
conversations keep returning to the worker that holds them, a worker that already
holds the prefix wins every request for which it is not momentarily busier, and at
light load it rarely is: the in-flight signals (`load`) see nothing to push against.
The fleet then serves everything from a few workers, leaving the others' KV caches
unused (fewer distinct prefixes cached in all) and the favoured workers exposed to the
next burst. This scorer sees the imbalance that in-flight load cannot: it counts the
requests each worker was sent recently.

State: an exponentially decayed count of dispatches per worker (each dispatch counts
1, halving every `share_half_life` dispatches fleet-wide; O(1) per dispatch). For each
candidate, share = its count / the mean count of the candidates, and

    value = clip((share - 1) / share_tolerance, 0, 1)

so a worker at or under its fair share scores 0, and one `share_tolerance` over it
scores 1: with `share_weight` >= `prefix_weight` it then loses to an idle worker even
on a full prefix match, so no worker stays much above its share while another is idle.

The value is scaled by the evidence, `total / (total + share_warmup * candidates)`:
a handful of requests says nothing about shares, and a conversation's second turn
must still find the worker holding its first (prefix affinity comes first until the
counts show a real imbalance).

Consumes: candidate keys; `on_dispatch` (the chosen worker). Produces:
`scores["dispatch-share"]` in [0, 1]. Config: `share_weight`, `share_tolerance`
(fraction over the fair share that scores 1), `share_half_life` (dispatches),
`share_warmup` (dispatches per candidate before the term has most of its weight).
"""

from __future__ import annotations

from router.policy.base import Candidate, PolicyState, RouteRequest, ScorerBase, WorkerKey, register_scorer
from router.policy.config import PolicyConfig

COUNTS_STATE = "dispatch-share-counts"
_RESCALE_ABOVE = 1e200  # counts are kept in growing units; rescaled long before overflow


class DispatchCounts:
    """Exponentially decayed dispatch counts per worker, in O(1) per dispatch.

    Rather than decaying every count at each dispatch, each new dispatch adds a unit
    that grows by 2**(1/half_life) per dispatch; ratios between counts are what the
    decay would give. All counts are divided down when the unit gets large.
    """

    def __init__(self, half_life: int) -> None:
        self.half_life = half_life
        self._growth = 2.0 ** (1.0 / half_life)
        self._unit = 1.0
        self.counts: dict[WorkerKey, float] = {}

    def add(self, worker: WorkerKey) -> None:
        self._unit *= self._growth
        self.counts[worker] = self.counts.get(worker, 0.0) + self._unit
        if self._unit > _RESCALE_ABOVE:
            scale = 1.0 / self._unit
            self._unit = 1.0
            self.counts = {key: count * scale for key, count in self.counts.items()}

    def set_half_life(self, half_life: int) -> None:
        self.half_life = half_life
        self._growth = 2.0 ** (1.0 / half_life)

    def remove_worker(self, worker_id: str) -> None:
        for key in [key for key in self.counts if key[0] == worker_id]:
            del self.counts[key]


@register_scorer("dispatch-share")
class DispatchShareScorer(ScorerBase):
    higher_is_better = False
    weight_field = "share_weight"

    def __init__(
        self, weight: float = -1.0, tolerance: float = 0.1, counts: DispatchCounts | None = None, warmup: int = 8
    ) -> None:
        super().__init__(weight)
        self.tolerance = tolerance
        self.warmup = warmup
        self.counts = counts if counts is not None else DispatchCounts(512)

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> DispatchShareScorer:
        counts = state.get_or_create(COUNTS_STATE, lambda: DispatchCounts(config.share_half_life))
        assert isinstance(counts, DispatchCounts)
        if counts.half_life != config.share_half_life:
            counts.set_half_life(config.share_half_life)
        return cls(-config.share_weight, config.share_tolerance, counts, config.share_warmup)

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]:
        get = self.counts.counts.get
        counts = [get((c.worker_id, c.dp_rank), 0.0) for c in candidates]
        total = sum(counts)
        if total <= 0.0:
            return [0.0] * len(candidates)
        # (count / mean - 1) / tolerance, with the mean taken over the candidates,
        # clipped to [0, 1], then scaled by how much evidence the counts hold.
        scale = len(candidates) / (total * self.tolerance)
        offset = 1.0 / self.tolerance
        evidence = total / (total + self.warmup * len(candidates))
        values = []
        for count in counts:
            value = count * scale - offset
            values.append(0.0 if value <= 0.0 else evidence if value >= 1.0 else value * evidence)
        return values

    def on_dispatch(self, request: RouteRequest, candidate: Candidate) -> None:
        self.counts.add((candidate.worker_id, candidate.dp_rank))

    def on_worker_removed(self, worker_id: str) -> None:
        self.counts.remove_worker(worker_id)

    def describe(self) -> dict[str, object]:
        return {
            "weight": self.weight, "tolerance": self.tolerance, "half_life": self.counts.half_life,
            "warmup": self.warmup,
        }
