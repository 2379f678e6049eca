"""Filter `serves-model`: only workers serving the request's model.

Consumes: `RouteRequest.model` (already mapped from any alias by the router) and
`Candidate.model`; names must be equal. Produces: the matching candidates, in their
order. Config: none.
"""

from __future__ import annotations

from router.policy.base import Candidate, PluginBase, RouteRequest, register_filter


@register_filter("serves-model")
class ServesModelFilter(PluginBase):
    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        model = request.model
        return [candidate for candidate in candidates if candidate.model == model]
