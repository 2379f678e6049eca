"""Routing policies: filters -> weighted scorers -> picker, assembled by name.

The router's hot path, per request: build `Candidate`s, `LoadTracker.fill`, then
`fill_matches` (the lookup step), then `policy.rank` (ranked best first). See `base`
for the vocabulary, `assembly` for what each named policy is made of.
"""

from router.policy.assembly import DEFAULT_POLICY, POLICY_NAMES, build_policy
from router.policy.base import Candidate, PolicyState, RouteRequest, WorkerKey
from router.policy.config import PolicyConfig, PolicyConfigError, load_config
from router.policy.lookup import fill_matches, request_hashes
from router.policy.pipeline import Pipeline, Policy

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "Candidate",
    "Pipeline",
    "Policy",
    "PolicyConfig",
    "PolicyConfigError",
    "PolicyState",
    "RouteRequest",
    "WorkerKey",
    "build_policy",
    "fill_matches",
    "load_config",
    "request_hashes",
]
