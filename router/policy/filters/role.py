"""Filter `role`: client requests go to workers that decode (`both` or `decode`).

A `prefill`-only worker never answers a client: it only fills KV blocks for a decode
worker through the prefill queue, so it is never a candidate here.

Consumes: `Candidate.role`. Produces: the candidates whose role is `both` or `decode`,
in their order. Config: none.
"""

from __future__ import annotations

from router.policy.base import Candidate, PluginBase, RouteRequest, register_filter

SERVING_ROLES = frozenset({"both", "decode"})


@register_filter("role")
class RoleFilter(PluginBase):
    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        return [candidate for candidate in candidates if candidate.role in SERVING_ROLES]
