"""One data-parallel rank of the expert-parallel torch engine: its model runner and engine loop.

Owns `DPModelRunner` (a `ModelRunner` whose MoE layers are this rank's
`ExpertParallelMoE` shards, which micro-batches a step with Dual Batch Overlap when
every rank agrees, and which runs dummy forwards), `DPTorchEngine` (a `TorchEngine`
whose engine thread asks the rank's `DPParticipant` what to run each step),
`CommMeter` (an all-to-all backend wrapper timing how long callers wait on
communication) and `DPMetrics` (the rank's step counters and timings on /metrics:
`kvgate_worker_dp_steps_total{kind=real|dummy}`,
`kvgate_worker_dbo_steps_total{batching=microbatched|plain}`, and per step the
histograms `kvgate_worker_step_comm_seconds` / `kvgate_worker_step_compute_seconds`).

The engine loop, once per iteration: apply queued requests, ask the participant with
`has_work`; RUN_REAL -> one real `EngineCore.step`, RUN_DUMMY -> `dummy_step` (one
padding token through the model, so the other ranks' collectives pair up), IDLE -> the
participant blocked until a peer stepped, a request arrived or a load interval passed.
On `stop` the loop drains first: it keeps pairing with the other ranks' steps (their
requests in flight need its collectives) until the group is quiet or the drain
timeout (`--shutdown-timeout`) passes.

Invariants:
- every forward on every rank issues the same collectives in the same order: with DBO
  on, `agree_split` once, then the MoE layers plainly or as two micro-batches, the same
  choice on every rank. NOTE: a dummy step never vetoes a split: its batch is padding,
  it pads to whatever size the others agreed on.
- padding tokens (DBO padding, dummy steps) write and read only the scratch block, one
  block past the pool's, so they never touch a request's KV.
- a lost DP group (`DPGroupLost`) or a failed collective kills the engine: streams fail
  with 503, `/health` answers 503 and `dead` is set for `worker.dp_worker` to exit on.
Callers: `worker.dp_worker` (builds both per rank), tests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import msgspec
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from indexer.load import LoadReport
from worker.api import EngineUnavailable, GenerateRequest, ServedModel
from worker.dp_participant import Decision, DPGroupLost, DPParticipant
from worker.engine import EngineOutput
from worker.engine_core import EngineCore
from worker.engine_io import EnginePublishers
from worker.model_runner import ModelInputs, ModelRunner, sub_batch
from worker.models import AttentionMetadata, MoETransformer
from worker.models.moe import MoE
from worker.moe import AllToAllBackend, AllToAllHandle, ExpertParallelMoE
from worker.moe.a2a import CountedHandle, WrappedBackend
from worker.moe.dbo import DboConfig, agree_split, dbo_forward
from worker.torch_engine import TorchEngine

logger = logging.getLogger(__name__)

_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _MeteredHandle:
    """An in-flight exchange whose `wait` is charged to the meter; other attributes
    (a backend's optional `recv_hook`) are the wrapped handle's."""

    __slots__ = ("_inner", "_meter")

    def __init__(self, inner: AllToAllHandle, meter: CommMeter) -> None:
        self._inner = inner
        self._meter = meter

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def wait(self) -> torch.Tensor:
        started = time.perf_counter()
        try:
            return self._inner.wait()
        finally:
            self._meter.charge(time.perf_counter() - started)

    def recv_counts(self) -> list[int]:
        """A `start_all_to_all_v` handle's counts (may block until they are exchanged)."""
        started = time.perf_counter()
        try:
            return self._inner.recv_counts()  # type: ignore[attr-defined, no-any-return]
        finally:
            self._meter.charge(time.perf_counter() - started)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class CommMeter(WrappedBackend):
    """`inner`, plus the seconds its callers spent blocked in it since the last `take`.

    Blocked time is communication the step could not hide: the count exchange, starting
    a transfer, and waiting for one (under DBO, the wait left after the other
    micro-batch's compute)."""

    def __init__(self, inner: AllToAllBackend) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._blocked_s = 0.0

    def charge(self, seconds: float) -> None:
        with self._lock:  # NOTE: both micro-batch threads charge the same meter
            self._blocked_s += seconds

    def take(self) -> float:
        """Seconds blocked since the last call."""
        with self._lock:
            blocked, self._blocked_s = self._blocked_s, 0.0
        return blocked

    def exchange_counts(self, send_counts: Sequence[int]) -> list[int]:
        started = time.perf_counter()
        try:
            return self.inner.exchange_counts(send_counts)
        finally:
            self.charge(time.perf_counter() - started)

    def all_to_all(
        self, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> AllToAllHandle:
        started = time.perf_counter()
        try:
            handle = self.inner.all_to_all(rows, send_counts, recv_counts)
        finally:
            self.charge(time.perf_counter() - started)
        return _MeteredHandle(handle, self)

    def start_all_to_all_v(self, rows: torch.Tensor, send_counts: Sequence[int]) -> CountedHandle:
        started = time.perf_counter()
        try:
            handle = self.inner.start_all_to_all_v(rows, send_counts)
        finally:
            self.charge(time.perf_counter() - started)
        return _MeteredHandle(handle, self)  # type: ignore[arg-type, return-value]


class DPMetrics:
    """One rank's forwards by kind and batching, and their communication/compute split.

    Built unregistered (the engine exists before its HTTP app); `register` adds them to
    the app's registry."""

    def __init__(self) -> None:
        self.steps = Counter(
            "kvgate_worker_dp_steps", "Forward steps run, by kind (real: this rank's batch; "
            "dummy: padding only, to pair with other DP ranks)", ["kind"], registry=None,
        )
        self.batching = Counter(
            "kvgate_worker_dbo_steps", "Forward steps by batching (microbatched: two overlapped "
            "micro-batches; plain: one batch)", ["batching"], registry=None,
        )
        self.comm = Histogram(
            "kvgate_worker_step_comm_seconds", "Per forward step: time blocked on communication "
            "(expert all-to-all, DBO agreement)", buckets=_STEP_BUCKETS, registry=None,
        )
        self.compute = Histogram(
            "kvgate_worker_step_compute_seconds", "Per forward step: time not blocked on communication",
            buckets=_STEP_BUCKETS, registry=None,
        )

        for kind in ("real", "dummy"):
            self.steps.labels(kind)
        for batching in ("microbatched", "plain"):
            self.batching.labels(batching)

    def register(self, registry: CollectorRegistry) -> None:
        for metric in (self.steps, self.batching, self.comm, self.compute):
            registry.register(metric)

    def observe(self, kind: str, microbatched: bool, comm_s: float, total_s: float) -> None:
        self.steps.labels(kind).inc()
        self.batching.labels("microbatched" if microbatched else "plain").inc()
        self.comm.observe(comm_s)
        self.compute.observe(max(0.0, total_s - comm_s))


class DPModelRunner(ModelRunner):
    """A `ModelRunner` over this rank's expert shards; see the module docstring."""

    def __init__(
        self, model: MoETransformer, num_blocks: int, block_size: int, *,
        meter: CommMeter, dbo: DboConfig, metrics: DPMetrics,
    ) -> None:
        device = next(model.parameters()).device
        model.replace_moe(lambda _, moe: _shard(model, moe, meter, device))
        super().__init__(model, num_blocks + 1, block_size)
        self.num_blocks = num_blocks
        self.pad_block = num_blocks  # the scratch block
        self.meter = meter
        self.dbo = dbo
        self.metrics = metrics
        empty = torch.zeros(0, dtype=torch.long, device=device)
        self._no_tokens = ModelInputs(empty, empty, AttentionMetadata(empty, block_size), empty)

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """A real step: this rank's batch, micro-batched if every rank agrees."""
        num_tokens = inputs.input_ids.shape[0]
        return self._timed_forward(inputs, "real", num_tokens, bool(inputs.meta.prefills))

    def dummy_step(self) -> None:
        """A forward of padding only, so the other ranks' collectives pair up."""
        # The smallest vote that can split: never the rank that vetoes DBO.
        config = self.dbo
        has_prefill = config.dbo_prefill_token_threshold < config.dbo_decode_token_threshold
        vote = min(config.dbo_prefill_token_threshold, config.dbo_decode_token_threshold)
        with torch.inference_mode():
            self._timed_forward(self._no_tokens, "dummy", vote, has_prefill)

    def _timed_forward(self, inputs: ModelInputs, kind: str, vote_tokens: int, has_prefill: bool) -> torch.Tensor:
        started = time.perf_counter()
        self.meter.take()
        split, agree_s = None, 0.0
        if self.dbo.enable_dbo:
            split = agree_split(vote_tokens, has_prefill, self.dbo, device=self.device)
            agree_s = time.perf_counter() - started
        num_tokens = inputs.input_ids.shape[0]
        if split is not None:
            # Rows are batch index + 1; dbo_forward pads with 0, a padding token.
            rows = torch.arange(1, num_tokens + 1, device=self.device).unsqueeze(1)
            hidden = dbo_forward(lambda part: self._in_ubatch(inputs, part), rows, split)
        elif num_tokens:
            hidden = self._run(inputs)
        else:
            hidden = self._run(sub_batch(inputs, 0, 0, 1, self.pad_block))
        self.metrics.observe(kind, split is not None, self.meter.take() + agree_s, time.perf_counter() - started)
        return hidden

    def _in_ubatch(self, inputs: ModelInputs, rows: torch.Tensor) -> torch.Tensor:
        """One micro-batch: `rows` are a run of the batch's tokens (index + 1), then padding."""
        real = rows[rows > 0]
        start = int(real[0]) - 1 if real.numel() else 0
        part = sub_batch(inputs, start, start + real.numel(), rows.shape[0] - real.numel(), self.pad_block)
        # NOTE: inference mode is thread-local and the KV cache holds inference tensors.
        with torch.inference_mode():
            return self._run(part)

    def _run(self, inputs: ModelInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)


def _shard(model: MoETransformer, moe: MoE, meter: CommMeter, device: torch.device) -> ExpertParallelMoE:
    layer = ExpertParallelMoE.from_moe(model.config, moe, meter)
    return layer.to(device).eval().requires_grad_(False)


def make_dp_runner(meter: CommMeter, dbo: DboConfig, metrics: DPMetrics) -> Callable[..., DPModelRunner]:
    """The `make_runner` for `EngineCore`: the model, sharded, behind a `DPModelRunner`."""
    return lambda model, num_blocks, block_size: DPModelRunner(
        model, num_blocks, block_size, meter=meter, dbo=dbo, metrics=metrics
    )


class DPTorchEngine(TorchEngine):
    """A `TorchEngine` for one DP rank: the participant decides each step."""

    def __init__(
        self, core: EngineCore, served: ServedModel, *, participant: DPParticipant, metrics: DPMetrics,
        events_endpoint: str | None = None, replay_endpoint: str | None = None,
        load_endpoint: str | None = None, load_interval_s: float = 0.1,
        min_load_interval_s: float = 0.02, drain_timeout_s: float = 5.0, drain_quiet_s: float = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            core, served, events_endpoint=events_endpoint, replay_endpoint=replay_endpoint,
            load_endpoint=load_endpoint, load_interval_s=load_interval_s,
            min_load_interval_s=min_load_interval_s, **kwargs,
        )
        self.dp_rank = participant.dp_rank
        self.participant = participant
        self.metrics = metrics
        self.lost: DPGroupLost | None = None
        self.dead = asyncio.Event()  # set on the loop once the engine thread has failed
        self._drain_timeout_s = drain_timeout_s
        self._drain_quiet_s = drain_quiet_s
        self._drain_deadline: float | None = None  # set by `stop`
        self._publishers = EnginePublishers(
            events_endpoint, replay_endpoint, load_endpoint, min_load_interval_s=min_load_interval_s,
            load_interval_s=load_interval_s, data_parallel_rank=self.dp_rank,
        )

    def submit(self, request: GenerateRequest) -> AsyncGenerator[EngineOutput, None]:
        outputs = super().submit(request)
        self.participant.wake()  # an idle rank is blocked in the participant, not the inbox
        return outputs

    async def stop(self) -> None:
        """Drains, then stops like `TorchEngine.stop`.

        Draining: the other ranks may still be finishing their requests, which need this
        rank's collectives, so the thread keeps running dummy steps until the group has
        been quiet for `drain_quiet_s` (or `drain_timeout_s` passed) and only then exits.
        """
        self._drain_deadline = time.monotonic() + self._drain_timeout_s
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        if self._state == "running":
            self._state = "stopped"
        await super().stop()
        await asyncio.to_thread(self.participant.close)

    def load_report(self) -> LoadReport:
        return msgspec.structs.replace(super().load_report(), dp_rank=self.dp_rank)

    def _run(self) -> None:
        participant, runner = self.participant, self.core.runner
        assert isinstance(runner, DPModelRunner)
        try:
            last_step_at = time.monotonic()
            while self._state == "running":
                self._apply_commands(wait=False)
                decision = participant.wait_for_work_or_step(self.core.has_work(), self._load_interval_s)
                if self._is_drained(decision, last_step_at):
                    break
                if decision is not Decision.IDLE:
                    last_step_at = time.monotonic()
                    try:
                        if decision is Decision.RUN_REAL:
                            self._deliver(self.core.step())
                        else:
                            runner.dummy_step()
                    finally:
                        participant.finish_step()
                self._publishers.publish_events(self.core.pool.take_events())
                self._publishers.may_report(self.load_report)
                self._stats = self._snapshot()
        except DPGroupLost as exc:
            logger.error("DP rank %d: the DP group is lost (%s); the engine stops", self.dp_rank, exc.reason)
            self._fail(exc)
        except Exception:
            logger.exception("DP rank %d: the engine failed", self.dp_rank)
            self._fail(None)

    def _is_drained(self, decision: Decision, last_step_at: float) -> bool:
        """Stopping, and the group has not stepped for `drain_quiet_s` (or time is up)."""
        if self._drain_deadline is None:
            return False
        now = time.monotonic()
        is_quiet = decision is Decision.IDLE and now - last_step_at >= self._drain_quiet_s
        return is_quiet or now > self._drain_deadline

    def _fail(self, lost: DPGroupLost | None) -> None:
        self.lost = lost
        self._state = "dead"
        self._call_on_loop(self._streams.fail_all, EngineUnavailable("the engine failed"))
        self._call_on_loop(self.dead.set)
