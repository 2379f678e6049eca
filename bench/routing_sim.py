"""A simulated fleet in simulated time: real routing parts, modelled engines, and the
trace workload it replays (Mooncake-format lines, prompts synthesised per hash id).

Used by `bench/routing.py` (trace replay) and by the policy tests. What is real: the
routing policy objects (`router.policy`), the `LoadTracker`, the `LoadAggregator`, the
`PrefixIndex` fed by each engine's real `BlockPool` KV events, and the lookup step. What
is modelled: the forward passes (a timing model) and the network (instant, except an
optional KV-event lag).

Engine model (one per worker): vLLM-style continuous batching with chunked prefill.
Each step takes, in order, one token for every decoding sequence, the rest of an
unfinished prefill chunk, then new requests from the FCFS waiting queue while the
token budget (`max_num_batched_tokens`) and `max_num_seqs` allow; a request is admitted
only when the block pool can hold its whole prompt (`BlockPool.allocate`; the cached
prefix costs nothing). A decoding sequence that needs a block when none is free preempts
the most recently admitted sequence (freed, re-queued first, recomputed later). Step
time: `step_overhead_s + prefill_s_per_token * prefill tokens in the step +
decode_s_per_seq * decoding sequences`, so prefill cost counts only uncached tokens.
The first token of a request comes at the end of the step that completes its prefill.

Router model: at each arrival the router builds candidates from the latest load reports
(`LoadAggregator`, reports every `report_interval_s` and after a step, at most every
`min_report_gap_s`; like `worker/sim.py`, a report counts a waiting request's whole
prompt as prefill tokens), fills predictions (`LoadTracker.fill`) and matches
(`fill_matches`), ranks with the policy and sends to the first candidate; first tokens
and finishes go back to the tracker and the policy at the simulated time they happen.
"""

from __future__ import annotations

import heapq
import json
import math
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from indexer.events import EventBatch
from indexer.index import PrefixIndex
from indexer.load import LoadAggregator, LoadReport
from router.load_tracker import LoadTracker
from router.policy import Candidate, Policy, RouteRequest, fill_matches
from worker.block_pool import BlockPool, NoFreeBlocks

_ARRIVAL, _STEP_END, _TICK, _EVENTS = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Seconds per unit of work of one simulated engine (see the module docstring)."""

    prefill_s_per_token: float = 1e-4
    decode_s_per_seq: float = 1e-4
    step_overhead_s: float = 0.008
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256


@dataclass(slots=True)
class SimRequest:
    """One request of a workload; the run fills in where it went and when it answered."""

    request_id: str
    arrival_s: float
    token_ids: array  # uint32 prompt
    num_output_tokens: int
    worker: int = -1
    num_cached_tokens: int = 0  # at its first admission
    first_token_s: float = math.nan
    finish_s: float = math.nan
    rejected: bool = False  # its prompt can never fit the worker's block pool

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(slots=True, eq=False)
class _Seq:
    request: SimRequest
    tokens: list[int]
    num_computed: int = 0
    num_generated: int = 0
    prefilled: bool = False
    admitted: bool = False  # ever allocated (its first admission fixes the hit count)


class SimEngine:
    """One simulated worker: a real `BlockPool` driven by the timing model's steps."""

    def __init__(self, worker_id: str, num_blocks: int, block_size: int, model: str, timing: TimingModel) -> None:
        self.worker_id = worker_id
        self.pool = BlockPool(num_blocks, block_size, model)
        self.timing = timing
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.stepping = False
        self.busy_s = 0.0
        self.num_preempted = 0
        self.last_report_s = -math.inf
        self._plan: list[tuple[_Seq, int]] = []

    def add(self, request: SimRequest) -> bool:
        """Queues a request; False (and `rejected`) if its prompt can never fit."""
        num_needed = self.pool.num_blocks_for(len(request.token_ids) + request.num_output_tokens)
        if num_needed > self.pool.num_blocks:
            request.rejected = True
            return False
        seq = _Seq(request, list(request.token_ids))
        self.waiting.append(seq)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def begin_step(self) -> float | None:
        """Plans the next step; its duration, or None when there is nothing to do."""
        timing = self.timing
        plan: list[tuple[_Seq, int]] = []
        budget = timing.max_num_batched_tokens
        for seq in [s for s in self.running if s.prefilled]:
            # A preemption earlier in this loop may have sent `seq` back to waiting.
            if seq.prefilled and self._reserve_decode_slot(seq):
                plan.append((seq, 1))
                budget -= 1
        num_decode = len(plan)
        for seq in self.running:
            if not seq.prefilled and budget > 0:
                num_new = min(budget, len(seq.tokens) - seq.num_computed)
                plan.append((seq, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < timing.max_num_seqs:
            seq = self.waiting[0]
            try:
                num_cached = self.pool.allocate(seq.request.request_id, seq.tokens)
            except NoFreeBlocks:
                break
            self.waiting.popleft()
            self._admit(seq, num_cached)
            num_new = min(budget, len(seq.tokens) - num_cached)
            plan.append((seq, num_new))
            budget -= num_new
        if not plan:
            return None
        self._plan = plan
        num_prefill = timing.max_num_batched_tokens - budget - num_decode
        duration = timing.step_overhead_s + num_prefill * timing.prefill_s_per_token
        duration += num_decode * timing.decode_s_per_seq
        self.busy_s += duration
        return duration

    def _admit(self, seq: _Seq, num_cached: int) -> None:
        if not seq.admitted:
            seq.request.num_cached_tokens = num_cached
        seq.admitted = True
        seq.prefilled = False
        seq.num_computed = num_cached
        self.running.append(seq)

    def _reserve_decode_slot(self, seq: _Seq) -> bool:
        """Appends the sequence's sampled token, preempting newer ones for a block."""
        request_id = seq.request.request_id
        while not self.pool.can_append(request_id, 1):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        token = _output_token(seq)
        self.pool.append(request_id, [token])
        seq.tokens.append(token)
        return True

    def _preempt(self, seq: _Seq) -> None:
        self.pool.free(seq.request.request_id)
        self.running.remove(seq)
        seq.prefilled = False  # `admitted` stays set: a re-admission is not a first one
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preempted += 1

    def end_step(self, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """Commits the planned step; the requests that got their first token, and those
        that finished."""
        first_tokens: list[SimRequest] = []
        finished: list[SimRequest] = []
        for seq, num_new in self._plan:
            request = seq.request
            seq.num_computed += num_new
            self.pool.commit(request.request_id, seq.num_computed)
            if seq.num_computed < len(seq.tokens):
                continue  # a prefill chunk, more to come
            if not seq.prefilled:
                seq.prefilled = True
                if seq.num_generated > 0:
                    continue  # recomputed after preemption: its next token is already known
            seq.num_generated += 1
            if seq.num_generated == 1:
                request.first_token_s = now
                first_tokens.append(request)
            if seq.num_generated >= request.num_output_tokens:
                self.pool.free(request.request_id)
                self.running.remove(seq)
                request.finish_s = now
                finished.append(request)
        self._plan = []
        return first_tokens, finished

    def report(self, now: float) -> LoadReport:
        self.last_report_s = now
        # Like worker/sim.py: a waiting request counts its whole prompt (its cached
        # prefix is only known once it is admitted).
        num_prefill = sum(len(s.tokens) - s.num_computed for s in self.running if not s.prefilled)
        num_prefill += sum(len(s.tokens) for s in self.waiting)
        return LoadReport(
            worker_id=self.worker_id,
            dp_rank=0,
            timestamp=now,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_kv_blocks_used=self.pool.num_used_blocks,
            num_kv_blocks_total=self.pool.num_blocks,
            num_prefill_tokens=num_prefill,
        )


def _output_token(seq: _Seq) -> int:
    # Generated tokens live above 2**31, apart from prompt tokens, unique per request.
    return 0x8000_0000 | ((zlib.crc32(seq.request.request_id.encode()) * 4099 + seq.num_generated) & 0x7FFF_FFFF)


@dataclass
class FleetConfig:
    num_workers: int = 8
    num_blocks: int = 1024
    block_size: int = 16
    model: str = "sim-model"
    timing: TimingModel = field(default_factory=TimingModel)
    report_interval_s: float = 0.1
    min_report_gap_s: float = 0.02
    kv_event_lag_s: float = 0.0


class SimFleet:
    """Engines, the router's real routing parts, and the simulated clock that drives them."""

    def __init__(self, policy: Policy, config: FleetConfig) -> None:
        self.policy = policy
        self.config = config
        self.now = 0.0
        self.engines = [
            SimEngine(f"worker-{i}", config.num_blocks, config.block_size, config.model, config.timing)
            for i in range(config.num_workers)
        ]
        self.index = PrefixIndex(config.block_size, default_model=config.model)
        self.tracker = LoadTracker(clock=self._clock)
        self.aggregator = LoadAggregator(max_age_s=2.0, clock=self._clock)
        self.requests_per_worker = [0] * config.num_workers
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0

    def _clock(self) -> float:
        return self.now

    def _push(self, at: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, kind, payload))

    def run(self, requests: Sequence[SimRequest], progress: Callable[[int], None] | None = None) -> None:
        """Replays `requests` (sorted by arrival) until every one finished or was rejected."""
        for i in range(len(self.engines)):
            self._push(0.0, _TICK, i)
        next_arrival = 0
        num_done = 0
        heap = self._heap
        while next_arrival < len(requests) or self._busy():
            arrival_s = requests[next_arrival].arrival_s if next_arrival < len(requests) else math.inf
            if heap and heap[0][0] <= arrival_s:
                at, _, kind, payload = heapq.heappop(heap)
                self.now = max(self.now, at)
                num_done += self._handle(kind, payload)
            else:
                self.now = max(self.now, arrival_s)
                num_done += self._arrive(requests[next_arrival])
                next_arrival += 1
            if progress is not None:
                progress(num_done)

    def _busy(self) -> bool:
        return any(kind != _TICK for _, _, kind, _ in self._heap) or any(e.has_work for e in self.engines)

    def _handle(self, kind: int, payload: object) -> int:
        if kind == _STEP_END:
            return self._end_step(payload)  # type: ignore[arg-type]
        if kind == _TICK:
            self._report(payload)  # type: ignore[arg-type]
            self._push(self.now + self.config.report_interval_s, _TICK, payload)
        elif kind == _EVENTS:
            worker, batch = payload  # type: ignore[misc]
            self.index.apply(worker, batch)
        return 0

    def _report(self, i: int) -> None:
        report = self.engines[i].report(self.now)
        self.aggregator.update(report)
        self.tracker.apply_report(report)

    def candidates(self) -> list[Candidate]:
        config = self.config
        candidates = []
        for engine in self.engines:
            candidate = Candidate(engine.worker_id, 0, "", "both", config.model, config.block_size)
            report = self.aggregator.get((engine.worker_id, 0))
            if report is not None:
                candidate.apply_report(report)
            candidates.append(candidate)
        self.tracker.fill(candidates)
        return candidates

    def route(self, request: SimRequest) -> Candidate:
        """The routing decision the router would make now (the policy's best)."""
        route_request = RouteRequest(
            request.request_id, self.config.model, request.token_ids, len(request.token_ids), request.num_output_tokens
        )
        candidates = self.candidates()
        fill_matches(self.index, route_request, candidates)
        ranked = self.policy.rank(route_request, candidates)
        chosen = ranked[0]
        self.policy.on_dispatch(route_request, chosen)
        return chosen

    def _arrive(self, request: SimRequest) -> int:
        chosen = self.route(request)
        i = int(chosen.worker_id.rsplit("-", 1)[1])
        request.worker = i
        self.requests_per_worker[i] += 1
        block_size = self.config.block_size
        num_prompt = len(request.token_ids)
        # The engine recomputes at least one token, so a full hit stops a block short.
        num_hit = min(chosen.matched_blocks, (num_prompt - 1) // block_size) * block_size
        num_blocks = -(-(num_prompt + request.num_output_tokens) // block_size) - chosen.matched_blocks
        self.tracker.on_dispatch(request.request_id, chosen.key, num_prompt - num_hit, max(0, num_blocks))
        engine = self.engines[i]
        if not engine.add(request):
            self._finish(request)
            return 1
        if not engine.stepping:
            self._start_step(i)
        return 0

    def _start_step(self, i: int) -> None:
        engine = self.engines[i]
        duration = engine.begin_step()
        engine.stepping = duration is not None
        if duration is not None:
            self._push(self.now + duration, _STEP_END, i)

    def _end_step(self, i: int) -> int:
        engine = self.engines[i]
        first_tokens, finished = engine.end_step(self.now)
        events = engine.pool.take_events()
        if events:
            batch = EventBatch(self.now, events, 0)
            if self.config.kv_event_lag_s > 0:
                self._push(self.now + self.config.kv_event_lag_s, _EVENTS, ((engine.worker_id, 0), batch))
            else:
                self.index.apply((engine.worker_id, 0), batch)
        for request in first_tokens:
            self.tracker.on_first_token(request.request_id)
        for request in finished:
            self._finish(request)
        if self.now - engine.last_report_s >= self.config.min_report_gap_s:
            self._report(i)
        self._start_step(i)
        return len(finished)

    def _finish(self, request: SimRequest) -> None:
        self.tracker.on_finish(request.request_id)
        self.policy.on_finish(request.request_id)


# ---------------------------------------------------------------------- trace workload


@dataclass(frozen=True, slots=True)
class TraceEntry:
    arrival_s: float
    token_ids: array  # the synthesised prompt; shared by every replay (never mutated)
    num_output_tokens: int


def load_trace(path: str, trace_block_size: int, max_requests: int = 0) -> list[TraceEntry]:
    """The trace's requests with prompts synthesised per hash id (see bench/routing.py)."""
    entries = []
    with open(path) as lines:
        for line in lines:
            if not line.strip():
                continue
            row = json.loads(line)
            tokens = array("I")
            for block_id in row["hash_ids"]:
                start = block_id * trace_block_size
                tokens.extend(range(start, start + trace_block_size))
            del tokens[row["input_length"] :]
            entries.append(TraceEntry(row["timestamp"] / 1000.0, tokens, max(1, row["output_length"])))
            if max_requests and len(entries) >= max_requests:
                break
    entries.sort(key=lambda entry: entry.arrival_s)
    return entries


def make_requests(entries: list[TraceEntry]) -> list[SimRequest]:
    return [
        SimRequest(f"req-{i}", entry.arrival_s, entry.token_ids, entry.num_output_tokens)
        for i, entry in enumerate(entries)
    ]
