"""Scorer `approx-prefix`: the share of the prompt the router sent to a worker before.

The event-free cousin of `prefix-match`: instead of the prefix index (the workers'
truth, from KV events), it asks the policy's own `ApproxPrefixTrees`, into which
`on_dispatch` inserts every routed prompt. It works with engines that publish no
events, at the price of guessing: it does not see evictions beyond its own LRU bound.

value = leading blocks found in the worker's tree / (num_prompt_tokens // block_size).

Consumes: `RouteRequest.hashes_by_block_size` (computed here if the lookup step did
not run for that block size), `Candidate.block_size` and key. Produces:
`scores["approx-prefix"]` in [0, 1]; on dispatch, the prompt inserted into the chosen
worker's tree. Config: `prefix_weight`, `approx_tree_max_blocks` (nodes per worker).
"""

from __future__ import annotations

from router.policy.approx_tree import ApproxPrefixTrees
from router.policy.base import Candidate, PolicyState, RouteRequest, ScorerBase, register_scorer
from router.policy.config import PolicyConfig
from router.policy.lookup import request_hashes

TREES_STATE = "approx-prefix-trees"


@register_scorer("approx-prefix")
class ApproxPrefixScorer(ScorerBase):
    higher_is_better = True
    weight_field = "prefix_weight"

    def __init__(self, weight: float = 1.0, trees: ApproxPrefixTrees | None = None) -> None:
        super().__init__(weight)
        self.trees = trees if trees is not None else ApproxPrefixTrees(1 << 16)

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> ApproxPrefixScorer:
        trees = state.get_or_create(TREES_STATE, lambda: ApproxPrefixTrees(config.approx_tree_max_blocks))
        assert isinstance(trees, ApproxPrefixTrees)
        if trees.max_blocks != config.approx_tree_max_blocks:
            trees.resize(config.approx_tree_max_blocks)
        return cls(config.prefix_weight, trees)

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]:
        num_tokens = request.num_prompt_tokens
        values = []
        for candidate in candidates:
            num_full_blocks = num_tokens // candidate.block_size
            tree = self.trees.get(candidate.key)
            if tree is None or num_full_blocks <= 0:
                values.append(0.0)
                continue
            num_matched = tree.match(request_hashes(request, candidate.block_size))
            values.append(min(1.0, num_matched / num_full_blocks))
        return values

    def on_dispatch(self, request: RouteRequest, candidate: Candidate) -> None:
        self.trees.insert(candidate.key, request_hashes(request, candidate.block_size))

    def on_worker_removed(self, worker_id: str) -> None:
        self.trees.remove_worker(worker_id)

    def describe(self) -> dict[str, object]:
        return {"weight": self.weight, "max_blocks": self.trees.max_blocks}
