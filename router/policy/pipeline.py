"""`Policy`: one named routing policy, run as filters -> weighted scorers -> picker.

The router calls `rank` once per request on its hot path (after the lookup step and
`LoadTracker.fill`), tries the ranked candidates in order, and reports what happened
through `on_dispatch` (the request was sent to a candidate) and `on_finish` (it ended).
`reconfigure` swaps weights and thresholds at runtime (`PATCH /admin/config`) without
losing state that must outlive a configuration: the random source, the round-robin
position, the approximate prefix trees (see `PolicyState`).

`rank` writes `Candidate.scores` (one entry per scorer) and `Candidate.score` (the
weighted sum) on every candidate that passed the filters, so `POST /admin/route` can
show why a worker won. It never raises for an empty input: it returns [] when no
candidate passes, and the router answers 503.

Pure and synchronous; one owner (the router's event loop) calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from router.policy.base import Candidate, PluginBase, PolicyState, RouteRequest
from router.policy.config import PolicyConfig, load_config


@dataclass(frozen=True, slots=True)
class Pipeline:
    """The plugins of one policy under one config."""

    filters: tuple[PluginBase, ...]
    scorers: tuple[PluginBase, ...]
    picker: PluginBase


Assembly = Callable[[PolicyConfig, PolicyState], Pipeline]


def _overrides(plugin: PluginBase, hook: str) -> bool:
    return getattr(type(plugin), hook) is not getattr(PluginBase, hook)


class Policy:
    """A named policy: its pipeline, its config and the state that outlives configs."""

    def __init__(self, name: str, assembly: Assembly, config: PolicyConfig | Mapping[str, Any] | None = None) -> None:
        self.name = name
        self._assembly = assembly
        config = load_config(config)
        self._state = PolicyState(config.seed)
        self.reconfigure(config)

    def reconfigure(self, config: PolicyConfig | Mapping[str, Any]) -> None:
        """Applies new weights and thresholds; validated first (`PolicyConfigError`)."""
        config = load_config(config)
        self._state.reseed(config.seed)
        pipeline = self._assembly(config, self._state)
        plugins = (*pipeline.filters, *pipeline.scorers, pipeline.picker)
        # Assigned together, after the assembly succeeded: a bad config changes nothing.
        self.config = config
        self.pipeline = pipeline
        self._filters = [plugin.filter for plugin in pipeline.filters]  # type: ignore[attr-defined]
        self._scorers = [(s.name, s.weight, s.score) for s in pipeline.scorers]  # type: ignore[attr-defined]
        self._pick = pipeline.picker.pick  # type: ignore[attr-defined]
        self._dispatch_hooks = [p.on_dispatch for p in plugins if _overrides(p, "on_dispatch")]
        self._finish_hooks = [p.on_finish for p in plugins if _overrides(p, "on_finish")]
        self._removal_hooks = [p.on_worker_removed for p in plugins if _overrides(p, "on_worker_removed")]

    def rank(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        """The candidates that pass every filter, best first; [] when none passes."""
        for keep in self._filters:
            candidates = keep(request, candidates)
            if not candidates:
                return []
        for candidate in candidates:
            if candidate.scores:
                candidate.scores = {}  # fresh: a caller may hold the previous dict
            candidate.score = 0.0
        scorers = self._scorers
        if scorers:
            totals = [0.0] * len(candidates)
            for name, weight, score in scorers:
                values = score(request, candidates)
                for candidate, value in zip(candidates, values):
                    candidate.scores[name] = value
                totals = [total + weight * value for total, value in zip(totals, values)]
            for candidate, total in zip(candidates, totals):
                candidate.score = total
        return self._pick(request, candidates)

    def on_dispatch(self, request: RouteRequest, candidate: Candidate) -> None:
        """The router sent `request` to `candidate` (once per attempt that was sent)."""
        for hook in self._dispatch_hooks:
            hook(request, candidate)

    def on_finish(self, request_id: str) -> None:
        for hook in self._finish_hooks:
            hook(request_id)

    def on_worker_removed(self, worker_id: str) -> None:
        """Forgets per-worker state (every dp rank of `worker_id`)."""
        for hook in self._removal_hooks:
            hook(worker_id)

    def describe(self) -> dict[str, Any]:
        """Name, plugins with their weights and thresholds, and the full config."""
        pipeline = self.pipeline
        return {
            "name": self.name,
            "filters": [{"name": f.name, **f.describe()} for f in pipeline.filters],
            "scorers": [{"name": s.name, **s.describe()} for s in pipeline.scorers],
            "picker": {"name": pipeline.picker.name, **pipeline.picker.describe()},
            "config": self.config.to_dict(),
        }
