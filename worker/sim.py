"""The simulated engine: a real scheduler, block pool, KV events and load reports, no model.

Owns `SimConfig` (sizes, batching limits, timing model), `OutputScript` (the "model")
and `SimEngine`: the asyncio driver that runs a `worker.scheduler.Scheduler` in real
time and implements `worker.engine.Engine`. `kvgate worker --engine sim` runs one;
`kvgate up` and tests run fleets of them to test routing at scale.

A step lasts `SimConfig.step_seconds`: fixed overhead + `prefill_ms_per_token` per
uncached prompt token computed + `decode_ms_per_step` when any sequence decodes +
`decode_ms_per_seq` per decoding sequence, all divided by `speedup`. The defaults
look like a ~7B model on one GPU: ~20k prefill tokens/s, ~13 ms per decode step.

The "model" (`OutputScript`): the output is `LOREM` from an offset derived from the
prompt ids (and `seed`), then EOS, then `LOREM` again: equal requests, equal outputs.

Invariants: the scheduler is mutated only between steps (new requests and aborts wait
for a step boundary); every request fits the pool on its own (`prompt + max_tokens <=
max_model_len <= num_blocks * block_size`, checked here), so the oldest request always
progresses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import xxhash

from indexer.hashing import token_bytes
from indexer.load import LoadReport
from worker.api import EngineUnavailable, GenerateRequest, InvalidRequest, ServedModel
from worker.block_pool import BlockPool
from worker.engine import EngineOutput, EngineStats, OutputStreams
from worker.engine_io import EngineOutlets, EnginePublishers, TokenRate
from worker.remote_prefill import RemotePrefills
from worker.scheduler import RequestState, Scheduler, StepResult

logger = logging.getLogger(__name__)

LOREM = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut "
    "labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris "
    "nisi ut aliquip ex ea commodo consequat. Duis aute irure dolor in reprehenderit in voluptate velit "
    "esse cillum dolore eu fugiat nulla pariatur. Excepteur sint occaecat cupidatat non proident, sunt "
    "in culpa qui officia deserunt mollit anim id est laborum."
)
_MAX_LAG_S = 0.05  # how far the step clock may run behind before it stops catching up


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Sizes, batching limits and the timing model (milliseconds before `speedup`)."""

    block_size: int = 16
    num_blocks: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0  # 0: the whole pool, num_blocks * block_size
    step_overhead_ms: float = 1.0
    prefill_ms_per_token: float = 0.05
    decode_ms_per_step: float = 12.0
    decode_ms_per_seq: float = 0.1
    speedup: float = 1.0
    load_interval_s: float = 0.1
    min_load_interval_s: float = 0.02

    def __post_init__(self) -> None:
        for name, value in ((f, getattr(self, f)) for f in self.__slots__):
            if "_ms" in name:  # a cost of zero switches that term off
                if value < 0:
                    raise ValueError(f"{name} must be >= 0, got {value}")
            elif name != "max_model_len" and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 <= self.max_model_len <= self.num_blocks * self.block_size:
            raise ValueError(
                f"max_model_len must be in [0, num_blocks * block_size = {self.num_blocks * self.block_size}], "
                f"got {self.max_model_len}"
            )

    @property
    def context_len(self) -> int:
        return self.max_model_len or self.num_blocks * self.block_size

    def step_seconds(self, num_prefill_tokens: int, num_decode_seqs: int) -> float:
        """Wall time of one step computing that many uncached prompt tokens and decodes."""
        ms = self.step_overhead_ms + self.prefill_ms_per_token * num_prefill_tokens
        if num_decode_seqs:
            ms += self.decode_ms_per_step + self.decode_ms_per_seq * num_decode_seqs
        return ms / 1000.0 / self.speedup


class OutputScript:
    """A request's output tokens: `passage` from a prompt-derived offset, then EOS.

    The sim's `worker.scheduler.TokenSource`: what a model would sample, but scripted.
    """

    def __init__(self, passage: Sequence[int], prompt_ids: Sequence[int], seed: int | None, eos_token_id: int | None):
        assert passage, "the output passage must not be empty"
        self._passage = passage
        self._eos_token_id = eos_token_id
        digest = xxhash.xxh3_64_intdigest(token_bytes(prompt_ids), (seed or 0) & 0xFFFF_FFFF_FFFF_FFFF)
        self._pos = digest % len(passage)

    def next_token(self) -> int:
        if self._pos == len(self._passage):
            self._pos = 0
            if self._eos_token_id is not None:
                return self._eos_token_id
        token_id = self._passage[self._pos]
        self._pos += 1
        return token_id


class SimEngine(EngineOutlets):
    """Runs a `Scheduler` in real time (scaled by `speedup`), publishing its KV events
    and load reports; implements `worker.engine.Engine`."""

    def __init__(
        self,
        config: SimConfig,
        served: ServedModel,
        *,
        worker_id: str = "sim",
        events_endpoint: str | None = None,
        replay_endpoint: str | None = None,
        load_endpoint: str | None = None,
        remote_prefill_timeout_s: float = 30.0,
    ) -> None:
        if served.max_model_len > config.num_blocks * config.block_size:
            raise ValueError("max_model_len exceeds the KV cache: num_blocks * block_size")
        self.config = config
        self.served = served
        self.worker_id = worker_id
        self.pool = BlockPool(config.num_blocks, config.block_size, model=served.name)
        self.scheduler = Scheduler(config, self.pool)
        self.remote = RemotePrefills(self.scheduler, remote_prefill_timeout_s)
        self._remote_events: list[tuple[str, str]] = []  # (what, request id): ready, failed, release
        self._passage = served.tokenizer.encode(LOREM).tolist()
        # The load timer task forces periodic reports, so the throttle has no interval of its own.
        self._publishers = EnginePublishers(
            events_endpoint, replay_endpoint, load_endpoint, min_load_interval_s=config.min_load_interval_s
        )
        self._streams = OutputStreams(on_close=self.abort)
        self._new: list[RequestState] = []
        self._aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._state = "not started"  # -> running -> stopped, or -> dead if the loop failed
        self._rate = TokenRate()

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Binds the publishers (ZMQ errors raise here) and starts the step loop."""
        self._publishers.open()
        self._state = "running"
        self._tasks = [
            asyncio.create_task(self._run(), name=f"sim-engine {self.worker_id}"),
            asyncio.create_task(self._report_periodically(), name=f"sim-load {self.worker_id}"),
        ]

    async def stop(self) -> None:
        """Stops the loop, fails unfinished requests with 503, closes the publishers."""
        if self._state == "running":
            self._state = "stopped"
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._tasks = []
        self._fail_all(EngineUnavailable("the worker is shutting down"))
        self.remote.release_all()
        self._publishers.publish_events(self.pool.take_events())
        self._publishers.close()

    # -- requests ------------------------------------------------------------------

    def submit(self, request: GenerateRequest) -> AsyncGenerator[EngineOutput, None]:
        """Queues a request; its outputs arrive through the returned iterator."""
        if not self.is_alive:
            raise EngineUnavailable(f"the engine is {self._state}")
        if (num_tokens := request.num_prompt_tokens + request.max_tokens) > self.served.max_model_len:
            limit = self.served.max_model_len
            message = f"prompt + max_tokens = {num_tokens} exceeds the maximum context length {limit}"
            raise InvalidRequest(message, param="max_tokens", code="context_length_exceeded")
        prompt = request.prompt_token_ids.tolist()
        eos_token_id = self.served.tokenizer.eos_token_id
        script = OutputScript(self._passage, prompt, request.seed, eos_token_id)
        stop_eos = None if request.ignore_eos else eos_token_id
        state = RequestState(
            request.request_id, prompt, len(prompt), request.max_tokens, script, stop_eos,
            remote_prefill=self._wants_remote(request),
            hold_blocks=request.hold_blocks,
        )
        outputs = self._streams.open(request.request_id)
        self._new.append(state)
        self._wake.set()
        return outputs

    def abort(self, request_id: str) -> None:
        """Drops a request at the next step boundary (no-op for finished or unknown ones)."""
        if request_id in self._streams:
            self._aborts.add(request_id)
            self._wake.set()

    # -- disaggregation (worker.disagg) ------------------------------------------------

    def _remote_event(self, event: str, request_id: str) -> None:
        self._remote_events.append((event, request_id))
        self._wake.set()

    def _apply_remote_events(self, now: float) -> None:
        for event, request_id in self._remote_events:
            self.remote.apply(event, request_id)
        self._remote_events.clear()
        self.remote.expire(now)

    def _hand_over_remote(self, now: float) -> None:
        if requests := self._take_remote_requests(now):
            self._remote_handler(requests)  # type: ignore[misc]  # checked by _take_remote_requests

    # -- the step loop ---------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time()
        try:
            while True:
                self._apply_remote_events(loop.time())
                self._step_boundary()
                step = self.scheduler.schedule() if self.scheduler.has_work() else None
                self._hand_over_remote(loop.time())
                if step is None or not step.scheduled:
                    # Nothing to compute until new work, remote KV or a deadline arrives.
                    assert step is None or self.scheduler.waits_on_transfers(), (
                        "work queued but nothing schedulable: a request outgrew the pool"
                    )
                    await self._idle(self.remote.next_due())
                    clock = loop.time()
                    continue
                seconds = self.config.step_seconds(step.num_prefill_tokens, step.num_decode_seqs)
                # The clock carries oversleeps into the next step, so long runs keep the model's pace.
                clock = max(clock, loop.time() - _MAX_LAG_S) + seconds
                await asyncio.sleep(max(0.0, clock - loop.time()))
                self._deliver(self.scheduler.finish_step(step))
        except Exception:
            logger.exception("sim engine %s failed", self.worker_id)
            self._state = "dead"
            self._fail_all(EngineUnavailable("the engine failed"))

    async def _idle(self, until: float | None) -> None:
        self._wake.clear()
        if until is None:
            await self._wake.wait()
            return
        timeout = until - asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(self._wake.wait(), max(timeout, 0.0))
        except TimeoutError:
            pass

    def _step_boundary(self) -> None:
        """Applies aborts and new requests, publishes events and, if due, a load report."""
        for request_id in self._aborts:
            self.scheduler.abort(request_id)
            self.remote.on_abort(request_id)
            self._streams.discard(request_id)
        if self._aborts:
            self._new = [r for r in self._new if r.request_id not in self._aborts]
            self._aborts.clear()
        for request in self._new:
            self.scheduler.add(request)
        self._new.clear()
        self._publishers.publish_events(self.pool.take_events())
        self._may_report()

    def _deliver(self, results: list[StepResult]) -> None:
        self._rate.add(len(results))
        for request, token_id, finish_reason in results:
            output = EngineOutput([token_id], finish_reason, request.num_cached_tokens or 0)
            if finish_reason is not None and request.hold_blocks:
                output.block_ids = self.pool.block_ids(request.request_id)
            self._streams.push(request.request_id, output)

    def _fail_all(self, error: Exception) -> None:
        for request_id in self._streams.fail_all(error):
            self.scheduler.abort(request_id)
        self._new.clear()
        self._aborts.clear()

    # -- events, load and stats ------------------------------------------------------

    def load_report(self) -> LoadReport:
        return LoadReport(
            worker_id=self.worker_id,
            dp_rank=0,
            timestamp=time.time(),
            num_running=self.scheduler.num_active(),
            num_waiting=len(self.scheduler.waiting) + len(self._new),
            num_kv_blocks_used=self.pool.num_used_blocks,
            num_kv_blocks_total=self.pool.num_blocks,
            num_prefill_tokens=self.scheduler.num_prefill_tokens() + sum(r.num_prompt_tokens for r in self._new),
        )

    def _may_report(self, *, force: bool = False) -> None:
        """Publishes a report when load changed (at most every `min_load_interval_s`) or when forced."""
        self._publishers.may_report(self.load_report, force=force)

    async def _report_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_interval_s)
            self._may_report(force=True)

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(self._new),
            num_kv_blocks_used=self.pool.num_used_blocks,
            num_kv_blocks_total=self.pool.num_blocks,
            num_cached_blocks=self.pool.num_cached_blocks,
            num_prompt_tokens=scheduler.num_prompt_tokens,
            num_cached_prompt_tokens=scheduler.num_cached_prompt_tokens,
            num_generation_tokens=scheduler.num_generation_tokens,
            num_preemptions=scheduler.num_preemptions,
            num_steps=scheduler.num_steps,
            generation_tokens_per_s=self._rate.per_second(),
        )
