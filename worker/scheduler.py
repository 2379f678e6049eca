"""The batching core of a worker engine: continuous batching, chunked prefill, preemption.

Owns `Scheduler` (which requests compute how many tokens in each step, over a
`worker.block_pool.BlockPool`), `RequestState` (a request's tokens and progress),
`Step` (one step's plan and cost drivers) and `StepResult` (a sampled token).
Engine-agnostic: the engine supplies the batch limits (`BatchLimits`), runs the
step's compute between `schedule` and `finish_step`, and publishes the pool's KV
events. Each request's next token comes either from the engine (`finish_step(step,
sampled_token_ids)`: the torch engine's sampled tokens, one per entry of
`Step.sampling_indices()`) or from the request's own `TokenSource` (the simulated
engine, `worker/sim.py`). Pure and synchronous: no I/O, no clock.

Each step schedules running requests first (admission order: the rest of a prompt or
one decode token each, within `max_num_batched_tokens`: chunked prefill), then admits
waiting ones in arrival order while `max_num_seqs` and the budget allow. `allocate`
reserves the whole prompt and reports the prefix-cache hit: only the uncached tail is
computed; a request whose blocks do not fit waits. A running request that needs a
block when none is free preempts the newest one (recompute: its blocks are freed, it
goes back to the queue's front with its output so far, and is re-prefilled later).

Invariants: one owner (the engine's step loop) mutates it, and only between steps
(new requests and aborts wait for a step boundary); every request fits the pool on
its own (`prompt + max_tokens <= max_model_len <= num_blocks * block_size`, which the
engine checks), so the oldest request always progresses.

Disaggregation (seed 003) adds two states outside `running`, so preemption never
frees their blocks:
- remote-prefilling (decode side): a request flagged `remote_prefill` is admitted as
  usual, but when its uncached full blocks (all but the last prompt token) are not
  empty it waits in `remote_prefilling` while a prefill worker fills them;
  `take_remote_tasks` hands the engine what to ask for. `complete_remote` commits the
  filled blocks (they are cached and published like computed ones) and moves the
  request to `running`, where the prompt's tail is computed locally and yields the
  first token; `fallback_remote` moves it there with nothing filled.
- held (prefill side, and aborted remote prefills): a request flagged `hold_blocks`
  keeps its blocks when it finishes, and an aborted remote-prefilling request keeps
  them too (a transfer may still be writing them), until the engine calls `release`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from worker.block_pool import BlockPool, NoFreeBlocks


class BatchLimits(Protocol):
    """The engine's batching limits (`worker.sim.SimConfig` is one)."""

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...


class TokenSource(Protocol):
    """Where a request's output tokens come from: the model's samples (the sim's script)."""

    def next_token(self) -> int: ...


@dataclass(slots=True, eq=False)
class RequestState:
    """A request's tokens (prompt, then outputs) and its progress."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    token_source: TokenSource | None  # None: the engine passes sampled tokens to finish_step
    eos_token_id: int | None  # None: never stop on EOS (ignore_eos, or no EOS token)
    num_output_tokens: int = 0
    num_cached_tokens: int | None = None  # the prefix hit at first admission
    in_prefill: bool = True  # since the last admission, no token sampled yet
    stop_token_ids: frozenset[int] = frozenset()  # more tokens that end the request ("stop")
    remote_prefill: bool = False  # decode side: have a prefill worker compute the prompt
    hold_blocks: bool = False  # prefill side: keep the blocks after finishing, until `release`


class RemoteTask(NamedTuple):
    """A remote prefill to ask for: fill `block_ids`, the prompt's blocks from token
    `num_cached_tokens` on (full blocks only, the last prompt token excluded)."""

    request: RequestState
    num_cached_tokens: int
    block_ids: list[int]


@dataclass(slots=True)
class Step:
    """What one step computes: (request, number of tokens) pairs, and the step's cost drivers."""

    scheduled: list[tuple[RequestState, int]] = field(default_factory=list)
    # Per entry of `scheduled`: tokens whose KV was computed before this step (its start).
    num_computed_tokens: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0

    def sampling_indices(self) -> list[int]:
        """Entries of `scheduled` that compute their request's last token, so sample one."""
        return [
            index
            for index, ((request, num_tokens), start) in enumerate(zip(self.scheduled, self.num_computed_tokens))
            if start + num_tokens == len(request.token_ids)
        ]


class StepResult(NamedTuple):
    """A token sampled for a request in one step, and whether it finished the request."""

    request: RequestState
    token_id: int
    finish_reason: str | None


class Scheduler:
    """Continuous batching with chunked prefill and preemption over a `BlockPool`."""

    def __init__(self, config: BatchLimits, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.remote_prefilling: dict[str, RequestState] = {}
        self.held: dict[str, RequestState] = {}
        self._remote_tasks: list[RemoteTask] = []
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0
        self.num_steps = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: RequestState) -> None:
        self.waiting.append(request)

    def waits_on_transfers(self) -> bool:
        """True while blocks or slots are held for KV transfers, which may free them:
        a step that schedules nothing is then a wait, not a request outgrowing the pool."""
        return bool(self.remote_prefilling or self.held)

    def num_active(self) -> int:
        """Requests holding a sequence slot: running or remote-prefilling."""
        return len(self.running) + len(self.remote_prefilling)

    def abort(self, request_id: str) -> bool:
        """Drops an unfinished request, freeing its blocks; False if unknown.

        A remote-prefilling request's blocks are held instead (see `release`)."""
        request = self.remote_prefilling.pop(request_id, None)
        if request is not None:
            self.held[request_id] = request
            return True
        for queue in (self.waiting, self.running):
            request = next((r for r in queue if r.request_id == request_id), None)
            if request is not None:
                queue.remove(request)
                if self.pool.has_request(request_id):
                    self.pool.free(request_id)
                return True
        return False

    def take_remote_tasks(self) -> list[RemoteTask]:
        """Remote prefills admitted since the last call, for the engine to request."""
        tasks, self._remote_tasks = self._remote_tasks, []
        return tasks

    def complete_remote(self, request_id: str, num_tokens: int) -> bool:
        """The prompt's first `num_tokens` tokens now have their KV: commit them and run
        the request; False if it is not remote-prefilling (finished, aborted, fell back)."""
        request = self.remote_prefilling.pop(request_id, None)
        if request is None:
            return False
        self.pool.commit(request_id, num_tokens)
        self.running.append(request)
        return True

    def fallback_remote(self, request_id: str) -> bool:
        """Compute the prompt locally after all; False if it is not remote-prefilling."""
        request = self.remote_prefilling.pop(request_id, None)
        if request is None:
            return False
        self.running.append(request)
        return True

    def release(self, request_id: str) -> bool:
        """Frees a held request's blocks; False if it is not held."""
        if self.held.pop(request_id, None) is None:
            return False
        self.pool.free(request_id)
        return True

    def num_prefill_tokens(self) -> int:
        """Prompt tokens not yet computed, of running requests in prefill and all waiting ones."""
        pending = sum(len(r.token_ids) for r in self.waiting)
        for request in self.running:
            if request.in_prefill:
                pending += len(request.token_ids) - self.pool.num_computed_tokens(request.request_id)
        return pending

    def schedule(self) -> Step:
        step = Step()
        budget = self.config.max_num_batched_tokens
        num_preempted = self.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if not self._reserve(request):
                break  # it preempted itself: every request after it is gone too
            budget -= self._add_to_step(step, request, budget)
            index += 1
        if self.num_preemptions == num_preempted:
            self._admit(step, budget)
        self.num_steps += 1
        return step

    def finish_step(self, step: Step, sampled_token_ids: Sequence[int] | None = None) -> list[StepResult]:
        """Commits the step's KV and appends a token to every request whose tokens are all computed.

        `sampled_token_ids`: the engine's tokens, one per `step.sampling_indices()` entry,
        in order; None takes each request's next token from its `token_source`.
        """
        results = []
        sampled = iter(sampled_token_ids) if sampled_token_ids is not None else None
        for request, num_tokens in step.scheduled:
            num_computed = self.pool.num_computed_tokens(request.request_id) + num_tokens
            self.pool.commit(request.request_id, num_computed)
            if num_computed < len(request.token_ids):
                continue  # a prefill chunk: no logits yet
            token_id = self._next_token(request, sampled)
            request.token_ids.append(token_id)
            request.num_output_tokens += 1
            request.in_prefill = False
            finish_reason = self._finish_reason(request, token_id)
            if finish_reason is not None:
                if request.hold_blocks:
                    self.held[request.request_id] = request
                else:
                    self.pool.free(request.request_id)
            results.append(StepResult(request, token_id, finish_reason))
        self.num_generation_tokens += len(results)
        if any(r.finish_reason is not None for r in results):
            done = {id(r.request) for r in results if r.finish_reason is not None}
            self.running = [r for r in self.running if id(r) not in done]
        return results

    @staticmethod
    def _next_token(request: RequestState, sampled: Iterator[int] | None) -> int:
        if sampled is not None:
            token_id = next(sampled, None)
            assert token_id is not None, "fewer sampled tokens than requests to sample"
            return int(token_id)
        assert request.token_source is not None, f"request {request.request_id} has no token source"
        return request.token_source.next_token()

    def _add_to_step(self, step: Step, request: RequestState, budget: int) -> int:
        num_computed = self.pool.num_computed_tokens(request.request_id)
        num_tokens = min(len(request.token_ids) - num_computed, budget)
        step.scheduled.append((request, num_tokens))
        step.num_computed_tokens.append(num_computed)
        if request.in_prefill:
            step.num_prefill_tokens += num_tokens
        else:
            step.num_decode_seqs += 1
        return num_tokens

    def _reserve(self, request: RequestState) -> bool:
        """Gives the pool the request's sampled tokens, preempting from the tail for room;
        False if the request had to preempt itself."""
        pending = request.token_ids[self.pool.num_tokens(request.request_id) :]
        if not pending:
            return True
        while not self.pool.can_append(request.request_id, len(pending)):
            # The newest request loses the least work; recompute needs no swap space.
            victim = self.running.pop()
            self.pool.free(victim.request_id)
            victim.in_prefill = True
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            if victim is request:
                return False
        self.pool.append(request.request_id, pending)
        return True

    def _admit(self, step: Step, budget: int) -> None:
        while self.waiting and budget > 0 and self.num_active() < self.config.max_num_seqs:
            request = self.waiting[0]
            try:
                num_hit = self.pool.allocate(request.request_id, request.token_ids)
            except NoFreeBlocks:
                # First come, first served: a smaller request behind may fit, but letting it
                # overtake could starve a long prompt forever.
                return
            self.waiting.popleft()
            self.running.append(request)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit
                self.num_prompt_tokens += request.num_prompt_tokens
                self.num_cached_prompt_tokens += num_hit
            if request.remote_prefill and self._may_go_remote(request, num_hit):
                continue
            budget -= self._add_to_step(step, request, budget)

    def _may_go_remote(self, request: RequestState, num_hit: int) -> bool:
        """Parks a newly admitted request as remote-prefilling when it has blocks to fill."""
        request.remote_prefill = False  # asked once: a preempted request recomputes locally
        size = self.pool.block_size
        first, stop = num_hit // size, (request.num_prompt_tokens - 1) // size
        if stop <= first or request.num_output_tokens:
            return False
        self.running.remove(request)
        self.remote_prefilling[request.request_id] = request
        block_ids = self.pool.block_ids(request.request_id)[first:stop]
        self._remote_tasks.append(RemoteTask(request, num_hit, block_ids))
        return True

    @staticmethod
    def _finish_reason(request: RequestState, token_id: int) -> str | None:
        if token_id == request.eos_token_id or token_id in request.stop_token_ids:
            return "stop"
        if request.num_output_tokens >= request.max_tokens:
            return "length"
        return None
