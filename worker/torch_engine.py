"""The torch engine: an `EngineCore` run in its own thread behind the `Engine` protocol.

Owns `TorchEngine`, what `kvgate worker --engine torch` serves with `worker/server.py`:
the engine thread (steps the core, publishes KV events once per step and load
reports), the hand-over of requests and aborts from the event loop to that thread,
and of outputs back.

Threads:
- the event loop (HTTP handlers) calls `submit` / `abort` / `stats`: they validate,
  queue a command on a thread-safe inbox and return at once; they never wait on a step.
- the engine thread alone touches the `EngineCore` (scheduler, block pool, model, KV
  cache) and the publishers' sending side; it applies queued commands between steps,
  and hands each step's outputs to the loop in one `call_soon_threadsafe`.
- `OutputStreams` is touched only on the loop; `stats()` reads an immutable snapshot
  the engine thread replaces after every step (and every load interval when idle).
- disaggregation (`worker.disagg`): the remote-prefill requests the scheduler admits
  go to the loop's handler in one `call_soon_threadsafe`; KV arrivals (from the
  transport's thread), unqueued jobs and releases come back as inbox commands. An
  idle thread waits on the inbox no longer than the next remote-prefill deadline.

Invariants: a request is rejected (`InvalidRequest`, 400) before it is queued unless
it fits the model and the cache, so no request can kill the engine; if a step raises
anyway, the engine is marked dead, every open stream fails with 503 and `/health`
answers 503.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from indexer.load import LoadReport
from worker.api import EngineUnavailable, GenerateRequest, InvalidRequest, ServedModel
from worker.engine import EngineOutput, EngineStats, OutputStreams
from worker.engine_core import EngineCore, RequestRejected
from worker.engine_io import EngineOutlets, EnginePublishers, TokenRate
from worker.remote_prefill import RemotePrefills
from worker.sampling import SamplingParams, sampling_params
from worker.scheduler import StepResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    remote_prefill: bool = False
    hold_blocks: bool = False


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Remote:
    """A disaggregation event: "ready" (KV arrived), "failed" (not queued), "release"."""

    what: str
    request_id: str


_Command = _Add | _Abort | _Remote | None  # None only wakes the thread


class TorchEngine(EngineOutlets):
    """Runs an `EngineCore` in a thread; implements `worker.engine.Engine`."""

    def __init__(
        self,
        core: EngineCore,
        served: ServedModel,
        *,
        worker_id: str = "torch",
        events_endpoint: str | None = None,
        replay_endpoint: str | None = None,
        load_endpoint: str | None = None,
        load_interval_s: float = 0.1,
        min_load_interval_s: float = 0.02,
        remote_prefill_timeout_s: float = 30.0,
    ) -> None:
        if served.max_model_len > core.max_model_len:
            raise ValueError(f"max_model_len {served.max_model_len} exceeds the engine's {core.max_model_len}")
        if served.tokenizer.vocab_size > core.model_config.vocab_size:
            raise ValueError(
                f"the tokenizer's vocabulary ({served.tokenizer.vocab_size}) exceeds the model's "
                f"({core.model_config.vocab_size})"
            )
        self.core = core
        self._served = served
        self.worker_id = worker_id
        self._load_interval_s = load_interval_s
        # The idle thread wakes every load interval, so the throttle's own interval keeps reports periodic.
        self._publishers = EnginePublishers(
            events_endpoint,
            replay_endpoint,
            load_endpoint,
            min_load_interval_s=min_load_interval_s,
            load_interval_s=load_interval_s,
        )
        self._streams = OutputStreams(on_close=self.abort)
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state = "not started"  # -> running -> stopped, or -> dead if a step failed
        self._rate = TokenRate()
        self.remote = RemotePrefills(core.scheduler, remote_prefill_timeout_s)
        self._stats = self._snapshot()

    @property
    def served(self) -> ServedModel:
        return self._served

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Binds the publishers (ZMQ errors raise here) and starts the engine thread."""
        self._publishers.open()
        self._loop = asyncio.get_running_loop()
        self._state = "running"
        self._thread = threading.Thread(target=self._run, name=f"torch-engine {self.worker_id}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stops the thread after its current step, fails unfinished requests with 503,
        frees their blocks, publishes the last events and closes the publishers."""
        if self._state == "running":
            self._state = "stopped"
        if self._thread is not None:
            self._inbox.put(None)
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        failed = self._streams.fail_all(EngineUnavailable("the worker is shutting down"))
        if self._state == "stopped":  # a dead core's state is not trusted
            for request_id in failed:
                self.core.abort(request_id)
            self.remote.release_all()
            self._publishers.publish_events(self.core.pool.take_events())
        self._publishers.close()

    # -- requests (event loop) -------------------------------------------------------

    def submit(self, request: GenerateRequest) -> AsyncGenerator[EngineOutput, None]:
        """Validates and queues a request; its outputs arrive through the returned iterator."""
        if not self.is_alive:
            raise EngineUnavailable(f"the engine is {self._state}")
        prompt = request.prompt_token_ids.tolist()
        try:
            params = sampling_params(request)
            self.core.check(prompt, params)
        except RequestRejected as exc:
            code = "context_length_exceeded" if exc.param == "max_tokens" else None
            raise InvalidRequest(str(exc), param=exc.param, code=code) from None
        except ValueError as exc:
            raise InvalidRequest(str(exc), param=str(exc).partition(" ")[0]) from None
        try:
            outputs = self._streams.open(request.request_id)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="request_id") from None
        self._inbox.put(_Add(request.request_id, prompt, params, self._wants_remote(request), request.hold_blocks))
        return outputs

    def abort(self, request_id: str) -> None:
        """Drops a request at the next step boundary (no-op for finished or unknown ones)."""
        if request_id in self._streams:
            self._streams.discard(request_id)
            self._inbox.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def _remote_event(self, event: str, request_id: str) -> None:
        self._inbox.put(_Remote(event, request_id))

    # -- the engine thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._state == "running":
                self._apply_commands(wait=not self.core.has_work() or self.core.stalled)
                self.remote.expire(time.monotonic())
                if self.core.has_work() and self._state == "running":
                    self._deliver(self.core.step())
                    self._hand_over_remote()
                self._publishers.publish_events(self.core.pool.take_events())
                self._publishers.may_report(self.load_report)
                self._stats = self._snapshot()
        except Exception:
            logger.exception("torch engine %s failed", self.worker_id)
            self._state = "dead"
            self._call_on_loop(self._streams.fail_all, EngineUnavailable("the engine failed"))

    def _apply_commands(self, *, wait: bool) -> None:
        """Applies queued commands; when idle, first waits for one, up to a load interval
        or the next remote-prefill deadline."""
        try:
            command = self._inbox.get(timeout=self._wait_s()) if wait else self._inbox.get_nowait()
            self.core.stalled = False  # anything that arrives may unblock the scheduler
            while True:
                if isinstance(command, _Add):
                    self._add(command)
                elif isinstance(command, _Abort):
                    self.core.abort(command.request_id)
                    self.remote.on_abort(command.request_id)
                elif isinstance(command, _Remote):
                    self.remote.apply(command.what, command.request_id)
                command = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _wait_s(self) -> float:
        due = self.remote.next_due()
        if due is None:
            return self._load_interval_s
        return min(self._load_interval_s, max(due - time.monotonic(), 0.0))

    def _hand_over_remote(self) -> None:
        if requests := self._take_remote_requests(time.monotonic()):
            self._call_on_loop(self._remote_handler, requests)  # type: ignore[arg-type]

    def _add(self, command: _Add) -> None:
        # NOTE: cannot be rejected: `submit` checked it, its id has an open stream (so no
        # other unfinished request holds it), and the inbox applies an abort before a re-add.
        self.core.add_request(
            command.request_id, command.prompt_token_ids, command.params,
            remote_prefill=command.remote_prefill, hold_blocks=command.hold_blocks,
        )

    def _deliver(self, results: list[StepResult]) -> None:
        self._rate.add(len(results))
        if results:
            outputs = [(r.request.request_id, self._output(r)) for r in results]
            self._call_on_loop(self._push_all, outputs)

    def _output(self, result: StepResult) -> EngineOutput:
        request = result.request
        output = EngineOutput([result.token_id], result.finish_reason, request.num_cached_tokens or 0)
        if result.finish_reason is not None and request.hold_blocks:
            output.block_ids = self.core.pool.block_ids(request.request_id)
        return output

    def _push_all(self, outputs: list[tuple[str, EngineOutput]]) -> None:
        for request_id, output in outputs:
            self._streams.push(request_id, output)

    def _call_on_loop(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            logger.warning("engine %s: the event loop is closed; outputs dropped", self.worker_id)

    # -- events, load and stats (engine thread) ----------------------------------------

    def load_report(self) -> LoadReport:
        scheduler, pool = self.core.scheduler, self.core.pool
        return LoadReport(
            worker_id=self.worker_id,
            dp_rank=0,
            timestamp=time.time(),
            num_running=scheduler.num_active(),
            num_waiting=len(scheduler.waiting),
            num_kv_blocks_used=pool.num_used_blocks,
            num_kv_blocks_total=pool.num_blocks,
            num_prefill_tokens=scheduler.num_prefill_tokens(),
        )

    def _snapshot(self) -> EngineStats:
        scheduler, pool = self.core.scheduler, self.core.pool
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_kv_blocks_used=pool.num_used_blocks,
            num_kv_blocks_total=pool.num_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            num_prompt_tokens=scheduler.num_prompt_tokens,
            num_cached_prompt_tokens=scheduler.num_cached_prompt_tokens,
            num_generation_tokens=scheduler.num_generation_tokens,
            num_preemptions=scheduler.num_preemptions,
            num_steps=scheduler.num_steps,
            generation_tokens_per_s=self._rate.per_second(),
        )
