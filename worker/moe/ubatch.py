"""Micro-batch threads for Dual Batch Overlap: two threads, one running at a time.

Owns `UBatchContext` (the baton two micro-batch threads pass back and forth),
`run_ubatches` (runs two callables as micro-batch threads and returns their results)
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
Waits block on a Condition (no polling).
Callers: `worker.moe.layer.ExpertParallelMoE.forward` (yield points),
`worker.moe.dbo` (runs the micro-batches).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

NUM_UBATCHES = 2

_local = threading.local()


class UBatchAborted(RuntimeError):
    """Raised at a yield point when the other micro-batch thread has failed."""


class UBatchContext:
    """The baton shared by the two micro-batch threads of one step."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._turn = 0
        self._finished = [False] * NUM_UBATCHES
        self._failed = False
        # recv hooks registered by ubatch i, to be run by the other ubatch
        self._hooks: list[list[Callable[[], Any]]] = [[] for _ in range(NUM_UBATCHES)]
        self.num_switches = 0

    def wait_for_turn(self, ubatch_id: int) -> None:
        """Block until `ubatch_id` holds the baton; raise UBatchAborted if the peer failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._turn == ubatch_id or self._failed)
            if self._failed:
                raise UBatchAborted("the other micro-batch failed")

    def register_recv_hook(self, ubatch_id: int, hook: Callable[[], Any]) -> None:
        """Ask the other micro-batch to run `hook` at its next yield point."""
        with self._cond:
            if self._finished[1 - ubatch_id]:
                # Nobody is left to run it; completing the receive here keeps it correct.
                run_now = True
            else:
                self._hooks[ubatch_id].append(hook)
                run_now = False
        if run_now:
            hook()

    def run_peer_hooks(self, ubatch_id: int) -> None:
        """Run the receive hooks the other micro-batch registered."""
        with self._cond:
            hooks, self._hooks[1 - ubatch_id] = self._hooks[1 - ubatch_id], []
        for hook in hooks:
            hook()

    def switch(self, ubatch_id: int) -> None:
        """Hand the baton to the other micro-batch and wait for it to come back."""
        self.run_peer_hooks(ubatch_id)
        with self._cond:
            if self._failed:
                raise UBatchAborted("the other micro-batch failed")
            if self._finished[1 - ubatch_id]:
                return
            self._turn = 1 - ubatch_id
            self.num_switches += 1
            self._cond.notify_all()
        self.wait_for_turn(ubatch_id)

    def finish(self, ubatch_id: int, failed: bool) -> None:
        """Mark `ubatch_id` done and give the baton to the peer for good."""
        if not failed:
            self.run_peer_hooks(ubatch_id)
        with self._cond:
            self._finished[ubatch_id] = True
            self._failed = self._failed or failed
            self._turn = 1 - ubatch_id
            leftover = self._hooks[ubatch_id]
            self._hooks[ubatch_id] = []
            self._cond.notify_all()
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
    threads = [
        threading.Thread(target=_thread_main, args=(ctx, i, fn, grad, out, errors), name=f"ubatch-{i}", daemon=True)
        for i, fn in enumerate(fns)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if e is not None and not isinstance(e, UBatchAborted)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    return out, ctx
