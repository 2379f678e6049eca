"""A worker's side of decode-first disaggregation: enqueueing jobs (decode) and serving them (prefill).

Owns the two halves that run on the worker's event loop, beside its engine:

- `DecodeLink` (role `decode`): turns the engine's `worker.remote_prefill.RemoteRequest`s
  into `kvstore.prefill_job.PrefillJob`s in the global queue, naming this worker's KV
  receivers (`KVIngress`); the ingress reports each request whose KV arrived. A job
  that cannot be queued (queue unreachable, duplicate request id) is handed back to
  the engine at once, which prefills locally.
- `PrefillLoop` (role `prefill`): claims jobs while it has room (`max_jobs`), runs each
  prompt through its own engine (its prefix cache, its KV events) as a one-token
  request whose blocks the engine holds, writes the blocks the decode worker asked for
  through `KVEgress`, releases them, and only then acks. While a job runs its claim is
  renewed, so a slow prefill is not handed to a second worker; one reclaimed anyway
  (its renewals failed) is not sent, and left to its new holder. A job past its deadline is
  acked unrun; a job the decode worker cannot take (unreachable, rejected, too late)
  is acked too: the decode worker prefills locally at its deadline.

Also owns the two transport-facing protocols (`KVIngress`, `KVEgress`); their
implementations are `worker.kv_ports` (torch caches over `kvstore` transports) and
`worker.sim_transfer` (the simulated engine). A prefill loop that loses its engine
stops claiming; a job it held is then reclaimed by another prefill worker after the
queue's idle timeout, as is the job of a prefill worker that died.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

from kvstore.prefill_job import ClaimedJob, PrefillJob
from kvstore.prefill_queue import PrefillQueue, QueueUnavailable
from kvstore.transfer import KVTransferError, ReceiverEndpoint
from worker.api import ApiError, EngineUnavailable, GenerateRequest
from worker.engine import Engine
from worker.remote_prefill import RemoteCounters, RemoteRequest

logger = logging.getLogger(__name__)


class KVIngress(Protocol):
    """Decode side of a KV transport: where prefill workers write this worker's blocks."""

    def endpoints(self) -> list[bytes]:
        """This worker's encoded `ReceiverEndpoint`s, one per rank, for the job."""
        ...

    def set_on_ready(self, callback: Callable[[str], None]) -> None:
        """`callback(request_id)` (from any thread) once all of a request's KV arrived."""
        ...

    def forget(self, request_id: str) -> None: ...

    def close(self) -> None: ...


class KVEgress(Protocol):
    """Prefill side of a KV transport."""

    async def send(self, job: PrefillJob, src_block_ids: list[int], timeout_s: float) -> None:
        """Write this worker's `src_block_ids` into the job's blocks, then notify;
        raises `KVTransferError` on failure."""
        ...

    def close(self) -> None: ...


class DisaggEngine(Engine, Protocol):
    """What the disaggregation halves need of an engine beyond `worker.engine.Engine`."""

    @property
    def remote_counters(self) -> RemoteCounters: ...

    def set_remote_handler(self, handler: Callable[[list[RemoteRequest]], None]) -> None: ...

    def remote_ready(self, request_id: str) -> None: ...

    def remote_failed(self, request_id: str) -> None: ...

    def release(self, request_id: str) -> None: ...


@dataclass(slots=True)
class LinkCounters:
    """Totals of one worker's disaggregation traffic, for /metrics."""

    num_jobs_enqueued: int = 0
    num_jobs_unqueued: int = 0  # queue unreachable or duplicate: prefilled locally
    num_jobs_claimed: int = 0
    num_jobs_served: int = 0
    num_jobs_expired: int = 0
    num_jobs_undeliverable: int = 0  # the decode worker could not take the KV
    num_jobs_failed: int = 0  # the prompt could not be run here
    num_jobs_lost: int = 0  # reclaimed by another prefill worker before the KV was sent
    num_blocks_sent: int = 0

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


class DecodeLink:
    """See the module docstring."""

    def __init__(self, queue: PrefillQueue, ingress: KVIngress, engine: DisaggEngine, *,
                 model: str, worker_id: str, block_size: int) -> None:
        self.queue = queue
        self.ingress = ingress
        self.engine = engine
        self.model = model
        self.worker_id = worker_id
        self.block_size = block_size
        self.counters = LinkCounters()
        self._tasks: set[asyncio.Task[None]] = set()
        engine.set_remote_handler(self.request)
        ingress.set_on_ready(engine.remote_ready)

    def request(self, requests: list[RemoteRequest]) -> None:
        """Enqueue a job per request (called on the event loop)."""
        for remote in requests:
            task = asyncio.create_task(self._enqueue(remote), name=f"enqueue {remote.request_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _enqueue(self, remote: RemoteRequest) -> None:
        endpoints = self.ingress.endpoints()
        now = time.time()
        job = PrefillJob(
            request_id=remote.request_id, model=self.model, token_ids=remote.token_ids,
            block_ids=remote.block_ids, decode_worker_id=self.worker_id,
            transfer_endpoint=_describe(endpoints), deadline=now + remote.timeout_s,
            num_cached_tokens=remote.num_cached_tokens, created_at=now,
            block_size=self.block_size, receivers=endpoints,
        )
        try:
            queued = await self.queue.enqueue(job)
        except QueueUnavailable as exc:
            logger.warning("request %s: prefill queue unavailable (%s); prefilling locally", remote.request_id, exc)
            queued = False
        if queued:
            self.counters.num_jobs_enqueued += 1
        else:
            self.counters.num_jobs_unqueued += 1
            self.engine.remote_failed(remote.request_id)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self.ingress.close()


def _describe(endpoints: list[bytes]) -> str:
    if not endpoints:
        return ""
    first = ReceiverEndpoint.from_bytes(endpoints[0])
    return f"{first.transport}://{first.address}"


class PrefillLoop:
    """See the module docstring."""

    def __init__(self, queue: PrefillQueue, egress: KVEgress, engine: DisaggEngine, *,
                 model: str, consumer: str, block_size: int, max_jobs: int = 8,
                 claim_timeout_s: float = 1.0) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.queue = queue
        self.egress = egress
        self.engine = engine
        self.model = model
        self.consumer = consumer
        self.block_size = block_size
        self.claim_timeout_s = claim_timeout_s
        self.counters = LinkCounters()
        self._slots = asyncio.Semaphore(max_jobs)
        self._jobs: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"prefill-loop {self.consumer}")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._jobs) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self.egress.close()

    async def _run(self) -> None:
        backoff = self.queue.config.backoff_initial_s
        while self.engine.is_alive:
            await self._slots.acquire()
            try:
                claimed = await self.queue.claim(self.model, self.consumer, self.claim_timeout_s)
            except QueueUnavailable:
                self._slots.release()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.queue.config.backoff_max_s)
                continue
            except BaseException:
                self._slots.release()
                raise
            backoff = self.queue.config.backoff_initial_s
            if claimed is None:
                self._slots.release()
                continue
            self.counters.num_jobs_claimed += 1
            task = asyncio.create_task(self._serve(claimed), name=f"prefill {claimed.job.request_id}")
            self._jobs.add(task)
            task.add_done_callback(self._jobs.discard)
        logger.error("prefill worker %s: the engine stopped; no more jobs are claimed", self.consumer)

    async def _serve(self, claimed: ClaimedJob) -> None:
        job = claimed.job
        heartbeat = asyncio.create_task(self._keep_claimed(claimed), name=f"renew {job.request_id}")
        try:
            if job.is_expired():
                self.counters.num_jobs_expired += 1
            elif not await self._prefill_and_send(claimed):
                return  # another prefill worker holds the job now: its ack, not ours
            await self._ack(claimed)
        except EngineUnavailable:
            logger.error("job %s left unacked: the engine is gone", job.request_id)
        finally:
            heartbeat.cancel()
            self._slots.release()

    async def _keep_claimed(self, claimed: ClaimedJob) -> None:
        """Renews the claim while the job runs, so a slow prefill is not handed to another worker."""
        interval = self.queue.config.idle_timeout_s / 3
        while True:
            await asyncio.sleep(interval)
            try:
                if not await self.queue.renew(claimed):
                    return
            except QueueUnavailable:
                continue

    async def _still_held(self, claimed: ClaimedJob) -> bool:
        """False if the job went to another prefill worker (it will write the KV, not us).
        NOTE: an unreachable queue counts as held: then no other worker could claim it either."""
        try:
            return await self.queue.renew(claimed)
        except QueueUnavailable:
            return True

    async def _prefill_and_send(self, claimed: ClaimedJob) -> bool:
        """Runs the prompt and writes its KV into the decode worker; False only when the
        job is no longer ours. A job that cannot be done is counted and acked."""
        job = claimed.job
        request_id = f"prefill-{job.request_id}-{time.monotonic_ns()}"
        try:
            block_ids = await self._run_prompt(request_id, job)
        except ApiError as exc:
            if isinstance(exc, EngineUnavailable):
                raise
            logger.warning("job %s: the prompt cannot run here: %s", job.request_id, exc)
            self.counters.num_jobs_failed += 1
            return True
        try:
            if not await self._still_held(claimed):
                logger.warning("job %s: reclaimed by another prefill worker; its KV is not sent", job.request_id)
                self.counters.num_jobs_lost += 1
                return False
            await self._send(job, block_ids)
        finally:
            self.engine.release(request_id)
        return True

    async def _send(self, job: PrefillJob, block_ids: list[int]) -> None:
        first = job.num_cached_tokens // job.block_size if job.block_size else 0
        src = block_ids[first : first + len(job.block_ids)]
        if len(src) != len(job.block_ids) or job.block_size != self.block_size:
            logger.warning("job %s: block layout does not match this worker's", job.request_id)
            self.counters.num_jobs_failed += 1
            return
        remaining = job.deadline - time.time()
        if remaining <= 0:
            self.counters.num_jobs_expired += 1
            return
        try:
            await self.egress.send(job, src, remaining)
        except KVTransferError as exc:
            logger.warning("job %s: KV not delivered to %s: %s", job.request_id, job.decode_worker_id, exc)
            self.counters.num_jobs_undeliverable += 1
            return
        self.counters.num_jobs_served += 1
        self.counters.num_blocks_sent += len(job.block_ids)

    async def _run_prompt(self, request_id: str, job: PrefillJob) -> list[int]:
        """Computes the prompt's KV as a one-token request; returns its (held) block ids."""
        request = GenerateRequest(
            request_id=request_id, kind="completion", model=job.model,
            prompt_token_ids=array("l", job.token_ids), max_tokens=1, ignore_eos=True, hold_blocks=True,
        )
        block_ids: list[int] | None = None
        async for output in self.engine.submit(request):
            if output.block_ids is not None:
                block_ids = output.block_ids
        assert block_ids is not None, "a held request finished without its block ids"
        return block_ids

    async def _ack(self, claimed: ClaimedJob) -> None:
        """Acks, retrying with backoff until the job's deadline: an unacked job would be
        delivered again after the idle timeout and computed for nothing."""
        backoff = self.queue.config.backoff_initial_s
        while True:
            try:
                await self.queue.ack(claimed)
                return
            except QueueUnavailable as exc:
                if time.time() + backoff >= claimed.job.deadline:
                    # NOTE: the job stays pending; a later delivery finds it expired, and the
                    # decode worker ignores a second notification: nothing reaches a client twice.
                    logger.warning("job %s: not acked, the queue is unreachable: %s", claimed.job.request_id, exc)
                    return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.queue.config.backoff_max_s)
