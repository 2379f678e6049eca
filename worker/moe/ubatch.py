"""Micro-batch threads for Dual Batch Overlap: two threads, one running at a time.

Owns `UBatchContext` (the baton two micro-batch threads pass back and forth),
`run_ubatches` (runs two callables as micro-batch threads and returns their results;
the two threads live across steps)
and the yield-point functions the MoE layer calls: `dbo_yield`, `dbo_register_recv_hook`
and `dbo_maybe_run_recv_hooks`. Outside a micro-batch thread they do nothing, so a
layer with yield points runs unchanged without DBO.

How the overlap happens: a thread that has *started* a dispatch or combine calls
`dbo_yield`, which hands control to the other micro-batch and blocks until it is handed
back. The other thread computes (its experts, its shared expert) while the first
one's transfer is in flight; it yields at its own next transfer, and so on. Control
passes strictly alternately, so the two threads issue collectives in one fixed,
data-independent order, the same on every rank.

Receive hooks: a backend whose handle has a `recv_hook` attribute (a callable, e.g.
DeepEP's low-latency kernels, which post the receive separately) gets it registered by
the thread that started the transfer and run by the *other* thread at its next yield
point, before it hands control back. Handles without one (torch.distributed) just
wait.

Invariants: at most one micro-batch thread runs Python at a time; micro-batch 0 runs
first; a finished (or failed) thread hands control over for good, so a micro-batch
with fewer yield points (or an empty one) never leaves its peer blocked; an exception
in either thread aborts the peer at its next yield and is re-raised by `run_ubatches`.
Waits block on a lock (no polling).
Callers: `worker.moe.layer.ExpertParallelMoE.forward` (yield points),
`worker.moe.dbo` (runs the micro-batches).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable, Sequence

import torch

NUM_UBATCHES = 2

_local = threading.local()


class UBatchAborted(RuntimeError):
    """Raised at a yield point when the other micro-batch thread has failed."""


class UBatchContext:
    """The baton shared by the two micro-batch threads of one step.

    The baton is one lock per micro-batch, held while that micro-batch must not run:
    handing over is releasing the peer's lock and acquiring one's own, so a switch
    wakes exactly one thread, once (a shared Condition would also make the woken
    thread queue for the Condition's lock that the switching thread still holds).
    """

    def __init__(self) -> None:
        # NOTE: micro-batch 0 holds the baton first: only lock 1 starts taken.
        self._gates = [threading.Lock() for _ in range(NUM_UBATCHES)]
        self._gates[1].acquire()
        self._state = threading.Lock()  # guards the fields below
        self._finished = [False] * NUM_UBATCHES
        self._failed = False
        # recv hooks registered by ubatch i, to be run by the other ubatch
        self._hooks: list[list[Callable[[], Any]]] = [[] for _ in range(NUM_UBATCHES)]
        self.num_switches = 0

    def wait_for_turn(self, ubatch_id: int) -> None:
        """Block until `ubatch_id` holds the baton; raise UBatchAborted if the peer failed."""
        self._gates[ubatch_id].acquire()
        if self._failed:
            raise UBatchAborted("the other micro-batch failed")

    def register_recv_hook(self, ubatch_id: int, hook: Callable[[], Any]) -> None:
        """Ask the other micro-batch to run `hook` at its next yield point."""
        with self._state:
            # Nobody is left to run it if the peer is done; completing the receive
            # here keeps it correct.
            run_now = self._finished[1 - ubatch_id]
            if not run_now:
                self._hooks[ubatch_id].append(hook)
        if run_now:
            hook()

    def run_peer_hooks(self, ubatch_id: int) -> None:
        """Run the receive hooks the other micro-batch registered."""
        with self._state:
            hooks, self._hooks[1 - ubatch_id] = self._hooks[1 - ubatch_id], []
        for hook in hooks:
            hook()

    def switch(self, ubatch_id: int) -> None:
        """Hand the baton to the other micro-batch and wait for it to come back."""
        self.run_peer_hooks(ubatch_id)
        with self._state:
            if self._failed:
                raise UBatchAborted("the other micro-batch failed")
            if self._finished[1 - ubatch_id]:
                return
            self.num_switches += 1
        self._gates[1 - ubatch_id].release()
        self.wait_for_turn(ubatch_id)

    def finish(self, ubatch_id: int, failed: bool) -> None:
        """Mark `ubatch_id` done and give the baton to the peer for good."""
        if not failed:
            self.run_peer_hooks(ubatch_id)
        with self._state:
            self._finished[ubatch_id] = True
            self._failed = self._failed or failed
            leftover = self._hooks[ubatch_id]
            self._hooks[ubatch_id] = []
            peer_done = self._finished[1 - ubatch_id]
        if not peer_done:
            self._gates[1 - ubatch_id].release()
        # NOTE: hooks of a finished ubatch that its peer never ran must still complete.
        if not failed:
            for hook in leftover:
                hook()


def current_ubatch() -> tuple[UBatchContext, int] | None:
    """(context, micro-batch id) of the calling thread, or None outside DBO."""
    return getattr(_local, "ubatch", None)


def dbo_yield() -> None:
    """Yield point: let the other micro-batch run (no-op outside a micro-batch thread)."""
    current = current_ubatch()
    if current is not None:
        current[0].switch(current[1])


def dbo_register_recv_hook(hook: Callable[[], Any]) -> None:
    """Hand a receive hook to the other micro-batch; outside DBO, run it now."""
    current = current_ubatch()
    if current is None:
        hook()
    else:
        current[0].register_recv_hook(current[1], hook)


def dbo_maybe_run_recv_hooks() -> None:
    """Run the receive hooks the other micro-batch registered (no-op outside DBO)."""
    current = current_ubatch()
    if current is not None:
        current[0].run_peer_hooks(current[1])


def dbo_yield_after_start(pending: Any) -> None:
    """Yield point after a dispatch/combine has been started: register the receive
    hooks of its handles (if the backend has any; outside DBO they run at once), then
    yield."""
    for hook in getattr(pending, "recv_hooks", tuple)():
        dbo_register_recv_hook(hook)
    dbo_yield()


def _thread_main(
    ctx: UBatchContext, ubatch_id: int, fn: Callable[[], Any], grad_enabled: bool, out: list, errors: list
) -> None:
    _local.ubatch = (ctx, ubatch_id)
    failed = False
    try:
        ctx.wait_for_turn(ubatch_id)
        # NOTE: grad mode is thread-local in torch; inherit the caller's.
        with torch.set_grad_enabled(grad_enabled):
            out[ubatch_id] = fn()
    except BaseException as exc:  # noqa: BLE001 - re-raised by run_ubatches
        failed = True
        errors[ubatch_id] = exc
    finally:
        _local.ubatch = None
        ctx.finish(ubatch_id, failed)


class _UBatchWorker:
    """A long-lived micro-batch thread running one `_thread_main` job at a time.

    Reused across steps: a fresh thread per micro-batch per step pays thread start-up
    and the BLAS library's per-thread set-up (about half a millisecond of CPU) every
    step."""

    def __init__(self, ubatch_id: int) -> None:
        self._jobs: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._done = threading.Semaphore(0)
        threading.Thread(target=self._serve, name=f"ubatch-{ubatch_id}", daemon=True).start()

    def submit(self, *job: Any) -> None:
        self._jobs.put(job)

    def join(self) -> None:
        """Block until the job submitted last has ended."""
        self._done.acquire()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                _thread_main(*job)
            finally:
                del job  # the step's inputs and outputs are the caller's, not ours to keep
                self._done.release()


_workers: list[_UBatchWorker] = []
# NOTE: held by the one run_ubatches using the long-lived workers; a concurrent caller
# (two engines in one process) runs on fresh threads instead of waiting.
_workers_lock = threading.Lock()


def _reset_workers_in_child() -> None:
    global _workers_lock
    # A forked child has none of the parent's threads.
    _workers.clear()
    _workers_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_workers_in_child)


def run_ubatches(fns: Sequence[Callable[[], Any]]) -> tuple[list[Any], UBatchContext]:
    """Run two callables as alternating micro-batch threads; return their results.

    Re-raises the first real error (not the peer's UBatchAborted) after both threads end.
    """
    if len(fns) != NUM_UBATCHES:
        raise ValueError(f"need {NUM_UBATCHES} micro-batches, got {len(fns)}")
    if current_ubatch() is not None:
        raise RuntimeError("micro-batches cannot nest")
    ctx = UBatchContext()
    out: list[Any] = [None] * NUM_UBATCHES
    errors: list[BaseException | None] = [None] * NUM_UBATCHES
    grad = torch.is_grad_enabled()
    jobs = [(ctx, i, fn, grad, out, errors) for i, fn in enumerate(fns)]
    lock = _workers_lock
    if lock.acquire(blocking=False):
        try:
            if not _workers:
                _workers.extend(_UBatchWorker(i) for i in range(NUM_UBATCHES))
            for worker, job in zip(_workers, jobs):
                worker.submit(*job)
            for worker in _workers:
                worker.join()
        finally:
            lock.release()
    else:
        threads = [
            threading.Thread(target=_thread_main, args=job, name=f"ubatch-{job[1]}", daemon=True) for job in jobs
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    real = [e for e in errors if e is not None and not isinstance(e, UBatchAborted)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    return out, ctx
