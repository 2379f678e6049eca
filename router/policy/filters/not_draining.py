"""Filter `not-draining`: a draining worker finishes what it has but takes nothing new.

Consumes: `Candidate.draining` (set by `POST /admin/workers/{id}/drain`). Produces: the
candidates that are not draining, in their order. Config: none.
"""

from __future__ import annotations

from router.policy.base import Candidate, PluginBase, RouteRequest, register_filter


@register_filter("not-draining")
class NotDrainingFilter(PluginBase):
    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        return [candidate for candidate in candidates if not candidate.draining]
