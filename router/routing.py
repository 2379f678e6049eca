"""The routing step of one request: candidates, lookup, policy ranking, and dispatch bookkeeping.

Owns the glue between the registry and the policy: `RoutingCore.route` builds one
`Candidate` per registered worker serving the request's model (health, draining,
breaker, latest fresh `LoadReport`, the `LoadTracker`'s prediction), fills matched
blocks with the lookup step (one `find_matches` per block size in use), and asks the
current `Policy` for its ranking. The proxy then reports each attempt back through
`dispatch` / `first_token` / `record_outcome` / `finish`, which keep the load tracker,
the policy's hooks, the breaker, the per-worker counters and the decision metrics in
step. `dispatch` also asks the disaggregation decider (`router.disagg`), when it is
active, whether the attempt's worker prefills locally or remotely, and leaves the
answer in `Decision.prefill` for the proxy. `POST /admin/route` calls `route` (and
`PrefillDecider.decide`, which reads only) alone: it changes no state.

Pure and synchronous (no I/O, no logging): it runs on every request.

Invariants: every `dispatch` is followed by exactly one `finish` for the same
candidate (the proxy's `finally`), so predicted load and in-flight counts return to
zero; the policy is swapped whole (`set_policy`), never mutated mid-request.
"""

from __future__ import annotations

from dataclasses import dataclass

from indexer.load import LoadAggregator
from router.disagg import PrefillDecider, PrefillDecision
from router.errors import ModelNotFound, NoEligibleWorker
from router.load_tracker import LoadTracker
from router.metrics import GatewayMetrics
from router.policy import Policy
from router.policy.base import Candidate, RouteRequest
from router.policy.lookup import fill_matches
from router.registry import Worker, WorkerRegistry
from router.requests import ParsedRequest


@dataclass(slots=True)
class Decision:
    request: RouteRequest
    ranked: list[Candidate]
    candidates: list[Candidate]  # every candidate considered, ranked or filtered out
    policy_name: str
    worker: Worker | None = None  # the worker of the attempt in progress
    prefill: PrefillDecision | None = None  # the attempt's; None while disaggregation is off
    client_gone: bool = False


class RoutingCore:
    """See the module docstring."""

    def __init__(
        self,
        registry: WorkerRegistry,
        aggregator: LoadAggregator,
        tracker: LoadTracker,
        policy: Policy,
        metrics: GatewayMetrics,
        disagg: PrefillDecider,
    ) -> None:
        self.registry = registry
        self.aggregator = aggregator
        self.tracker = tracker
        self.policy = policy
        self.metrics = metrics
        self.disagg = disagg
        registry.add_forget_listener(tracker.remove_worker)
        registry.add_forget_listener(self._on_worker_forgotten)

    def set_policy(self, policy: Policy) -> None:
        self.policy = policy

    def _on_worker_forgotten(self, worker_id: str) -> None:
        self.policy.on_worker_removed(worker_id)

    # -- one request ---------------------------------------------------------------

    def route(self, parsed: ParsedRequest, request_id: str) -> Decision:
        """The ranked candidates for `parsed`; raises 404 for an unknown model, 503 for none."""
        request = RouteRequest(request_id, parsed.model, parsed.token_ids, len(parsed.token_ids), parsed.max_tokens)
        candidates = self.candidates(parsed.model)
        if not candidates:
            raise ModelNotFound(f"the model {parsed.model!r} does not exist", param="model")
        self._fill_matches(request, candidates)
        policy = self.policy
        ranked = policy.rank(request, candidates)
        if not ranked:
            raise NoEligibleWorker(f"no healthy worker can serve the model {parsed.model!r} now")
        return Decision(request, ranked, candidates, policy.name)

    def candidates(self, model: str) -> list[Candidate]:
        """One candidate per registered worker of `model` (at its DP rank), with its state and load."""
        get_report = self.aggregator.get
        candidates = []
        for worker in self.registry.workers.values():
            spec = worker.spec
            if spec.model != model:
                continue
            candidate = Candidate(
                spec.worker_id, spec.dp_rank, spec.url, spec.role, model, spec.block_size,
                worker.health.is_healthy and worker.breaker.allows(), worker.draining,
            )
            report = get_report((spec.worker_id, spec.dp_rank))
            if report is not None:
                candidate.apply_report(report)
            candidates.append(candidate)
        self.tracker.fill(candidates)
        return candidates

    def _fill_matches(self, request: RouteRequest, candidates: list[Candidate]) -> None:
        indexes = self.registry.indexes
        first_size = candidates[0].block_size
        if all(c.block_size == first_size for c in candidates):
            fill_matches(self.registry.index_for(first_size), request, candidates)
            return
        for block_size in {c.block_size for c in candidates}:
            index = indexes.get(block_size) or self.registry.index_for(block_size)
            fill_matches(index, request, [c for c in candidates if c.block_size == block_size])

    # -- attempts (called by the proxy) ----------------------------------------------

    def is_eligible(self, candidate: Candidate) -> bool:
        worker = self.registry.workers.get(candidate.worker_id)
        return worker is not None and worker.is_eligible

    def dispatch(self, decision: Decision, candidate: Candidate) -> None:
        request = decision.request
        block_size = candidate.block_size
        num_blocks = len(request.hashes_by_block_size.get(block_size, ()))
        matched = candidate.matched_blocks
        worker = decision.worker = self.registry.workers.get(candidate.worker_id)
        if worker is not None:
            worker.breaker.on_dispatch()
            worker.num_requests += 1
            worker.num_in_flight += 1
            worker.num_matched_blocks += matched
            worker.num_prompt_blocks += num_blocks
        num_prefill_tokens = max(0, request.num_prompt_tokens - matched * block_size)
        if self.disagg.is_enabled and self._decide_prefill(decision, candidate).is_remote:
            num_prefill_tokens = 0  # a prefill worker computes it: the worker only decodes
        total_tokens = request.num_prompt_tokens + request.max_tokens
        num_new_blocks = max(0, -(-total_tokens // block_size) - matched)
        self.tracker.on_dispatch(request.request_id, candidate.key, num_prefill_tokens, num_new_blocks)
        self.policy.on_dispatch(request, candidate)
        self.metrics.observe_decision(decision.policy_name, candidate.worker_id, matched, num_blocks)

    def _decide_prefill(self, decision: Decision, candidate: Candidate) -> PrefillDecision:
        prefill = decision.prefill = self.disagg.decide(decision.request, candidate, decision.candidates)
        self.disagg.on_dispatch(candidate.model, prefill)
        self.metrics.observe_prefill(prefill.label, prefill.reason)
        return prefill

    def first_token(self, decision: Decision) -> None:
        self.tracker.on_first_token(decision.request.request_id)

    def record_outcome(self, decision: Decision, ok: bool) -> None:
        """The attempt's transport and status outcome, for the breaker (see `router.breaker`)."""
        worker = decision.worker
        if worker is None:
            return
        if ok:
            worker.breaker.record_success()
        else:
            worker.num_failures += 1
            worker.breaker.record_failure()

    def finish(self, decision: Decision, candidate: Candidate) -> None:
        request_id = decision.request.request_id
        self.tracker.on_finish(request_id)
        self.policy.on_finish(request_id)
        worker, decision.worker = decision.worker, None
        if worker is not None:
            worker.num_in_flight -= 1
