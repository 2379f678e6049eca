"""Scorers: one value in [0, 1] per candidate, weighted into `Candidate.score`.
Importing this package registers every scorer in `router.policy.base.SCORERS`."""

from router.policy.scorers.approx_prefix import ApproxPrefixScorer
from router.policy.scorers.dispatch_share import DispatchShareScorer
from router.policy.scorers.kv_usage import KVUsageScorer
from router.policy.scorers.load import LoadScorer
from router.policy.scorers.prefix_match import PrefixMatchScorer
from router.policy.scorers.queue import QueueScorer

__all__ = ["ApproxPrefixScorer", "DispatchShareScorer", "KVUsageScorer", "LoadScorer", "PrefixMatchScorer", "QueueScorer"]
