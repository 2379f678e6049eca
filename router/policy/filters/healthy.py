"""Filter `healthy`: only workers the health checker currently considers up.

Consumes: `Candidate.healthy` (set by the router from active health checks and the
circuit breaker). Produces: the healthy candidates, in their order. Config: none.
"""

from __future__ import annotations

from router.policy.base import Candidate, PluginBase, RouteRequest, register_filter


@register_filter("healthy")
class HealthyFilter(PluginBase):
    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        return [candidate for candidate in candidates if candidate.healthy]
