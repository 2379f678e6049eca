"""The router's own prediction of every worker's load, corrected by the workers' reports.

Load reports arrive every 20-100 ms; a burst of requests in between would all see the
same stale numbers and pile onto one worker. So the router counts what it sends: per
worker key `(worker_id, dp_rank)`, the requests in flight, the prefill tokens not yet
answered by a first token, and the KV blocks held until the stream ends.

- `on_dispatch(request_id, worker, num_prefill_tokens, num_blocks)`: the request was
  sent. `num_prefill_tokens` = prompt tokens the worker must compute (prompt minus the
  matched prefix); `num_blocks` = KV blocks it will newly take (the router passes
  ceil((prompt + max_tokens) / block_size) - matched blocks). Re-dispatching a request
  id (a retry on another worker) first finishes its previous dispatch.
- `on_first_token(request_id)`: its prefill tokens stop counting. Idempotent.
- `on_finish(request_id)`: everything it counted stops counting. Idempotent; unknown
  ids are ignored (the router calls it on every exit path).

Reconciliation with reports. For each quantity X (requests, prefill tokens, blocks):

    predicted X = max(own X, report X + delta X)

- own X: the sum over this router's requests in flight to the worker.
- report X: the latest applied report (running + waiting, prefill tokens, blocks
  used); it includes load this router did not send (other routers, direct clients).
- delta X: what this router did to the worker *since that report was applied*:
  dispatches add, first tokens and finishes subtract. It restarts at 0 with every
  report.

NOTE: this never counts a request twice. A request the report includes was dispatched
before the report was applied, so its dispatch is not in delta; a request dispatched
after the report was applied cannot be in it (the worker produced the report before
the request existed for the router), so it is counted in delta only. The max with own
covers the one thing a report can miss: a request already sent but not yet received
by the worker when it reported (its later first token or finish would otherwise push
`report + delta` below the truth). `report + delta` is clamped at 0.

A report older (by its timestamp) than the one held is ignored; a report is dropped
once `max_report_age_s` (router clock) passes without a newer one, and own X alone is
used until the next one.

Pure and synchronous; owned by the router's event loop (the proxy calls the `on_*`
hooks, the load subscriber `apply_report`, the routing step `fill`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from indexer.load import LoadReport
from router.policy.base import Candidate

WorkerKey = tuple[str, int]


@dataclass(slots=True)
class _InFlight:
    worker: WorkerKey
    num_prefill_tokens: int  # 0 once the first token came
    num_blocks: int


@dataclass(slots=True)
class _WorkerLoad:
    num_requests: int = 0  # own
    num_prefill_tokens: int = 0
    num_blocks: int = 0
    report: LoadReport | None = None
    report_received_at: float = 0.0
    delta_requests: int = 0
    delta_prefill_tokens: int = 0
    delta_blocks: int = 0

    def add(self, num_requests: int, num_prefill_tokens: int, num_blocks: int) -> None:
        self.num_requests += num_requests
        self.num_prefill_tokens += num_prefill_tokens
        self.num_blocks += num_blocks
        self.delta_requests += num_requests
        self.delta_prefill_tokens += num_prefill_tokens
        self.delta_blocks += num_blocks


@dataclass(frozen=True, slots=True)
class PredictedLoad:
    """A worker's predicted load (see the module docstring for how it is reconciled)."""

    num_requests: int
    num_prefill_tokens: int
    num_blocks: int


_IDLE = PredictedLoad(0, 0, 0)


class LoadTracker:
    """Per-worker predicted load: the router's own counts, reconciled with reports."""

    def __init__(self, max_report_age_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        if max_report_age_s <= 0:
            raise ValueError("max_report_age_s must be positive")
        self.max_report_age_s = max_report_age_s
        self._clock = clock
        self._workers: dict[WorkerKey, _WorkerLoad] = {}
        self._requests: dict[str, _InFlight] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def workers(self) -> list[WorkerKey]:
        return list(self._workers)

    # -- the router's own requests -------------------------------------------------

    def on_dispatch(self, request_id: str, worker: WorkerKey, num_prefill_tokens: int, num_blocks: int) -> None:
        if num_prefill_tokens < 0 or num_blocks < 0:
            raise ValueError("num_prefill_tokens and num_blocks must be >= 0")
        if request_id in self._requests:
            self.on_finish(request_id)
        self._requests[request_id] = _InFlight(worker, num_prefill_tokens, num_blocks)
        self._load(worker).add(1, num_prefill_tokens, num_blocks)

    def on_first_token(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None or request.num_prefill_tokens == 0:
            return
        self._load(request.worker).add(0, -request.num_prefill_tokens, 0)
        request.num_prefill_tokens = 0

    def on_finish(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._load(request.worker).add(-1, -request.num_prefill_tokens, -request.num_blocks)

    # -- reports -------------------------------------------------------------------

    def apply_report(self, report: LoadReport) -> bool:
        """Takes a worker's report as the new base; False if an older one was passed."""
        load = self._load(report.worker)
        held = load.report
        if held is not None and report.timestamp < held.timestamp:
            return False
        load.report = report
        load.report_received_at = self._clock()
        load.delta_requests = load.delta_prefill_tokens = load.delta_blocks = 0
        return True

    def remove_worker(self, worker_id: str) -> None:
        """Forgets every dp rank of `worker_id` and its requests in flight."""
        for key in [key for key in self._workers if key[0] == worker_id]:
            del self._workers[key]
        for request_id in [rid for rid, r in self._requests.items() if r.worker[0] == worker_id]:
            del self._requests[request_id]

    # -- predictions ---------------------------------------------------------------

    def load(self, worker: WorkerKey) -> PredictedLoad:
        load = self._workers.get(worker)
        if load is None:
            return _IDLE
        report = load.report
        if report is None or self._clock() - load.report_received_at > self.max_report_age_s:
            return PredictedLoad(load.num_requests, load.num_prefill_tokens, load.num_blocks)
        return PredictedLoad(
            max(load.num_requests, report.num_running + report.num_waiting + load.delta_requests),
            max(load.num_prefill_tokens, report.num_prefill_tokens + load.delta_prefill_tokens),
            max(load.num_blocks, report.num_kv_blocks_used + load.delta_blocks),
        )

    def fill(self, candidates: Iterable[Candidate]) -> None:
        """Sets every candidate's `predicted_*` fields."""
        for candidate in candidates:
            predicted = self.load((candidate.worker_id, candidate.dp_rank))
            candidate.predicted_requests = predicted.num_requests
            candidate.predicted_prefill_tokens = predicted.num_prefill_tokens
            candidate.predicted_blocks = predicted.num_blocks

    def _load(self, worker: WorkerKey) -> _WorkerLoad:
        load = self._workers.get(worker)
        if load is None:
            load = self._workers[worker] = _WorkerLoad()
        return load
