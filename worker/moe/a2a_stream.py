"""A communication stream: an all-to-all backend wrapper whose collectives run on one
thread per rank, in the order they were submitted.

Owns `CommStreamBackend`. Its point is `start_all_to_all_v`: a dispatch must exchange
its counts (a round trip that waits for every peer to arrive) before its rows can
move. Run by the caller, that wait blocks the micro-batch thread that holds the DBO
baton, so neither micro-batch computes while the ranks line up. Submitted here, the
caller gets a handle at once and yields; the stream thread does the count exchange
and starts the row transfer while the other micro-batch computes. This is what a CUDA
communication stream gives a GPU all-to-all, done with a thread.

Every call (`exchange_counts`, `all_to_all`, `start_all_to_all_v`) is ordered behind
the ones submitted before it, so the collectives leave this rank in submission order;
DBO's strict alternation makes that order the same on every rank. A call whose
caller would only wait for it (a count exchange, a transfer start, a dispatch outside
DBO) runs on the caller when nothing is queued or running, saving two thread
hand-offs; otherwise it is queued for the stream thread. Handles wait for their job
and then for the wrapped backend's handle.

Invariants: calls into `inner` never overlap and run in submission order; a job that
raises fails its own handle, and the stream keeps serving later jobs; `close` drains
the queue and stops the thread (a later call starts a new one).
A backend whose handles carry receive hooks (DeepEP) already runs its transfers
behind the handle and is used without a stream.
Callers: EP worker processes and `bench/dbo.py` (wrapping the gloo/NCCL backend or
its emulated-link wrapper), tests.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from worker.moe.a2a import AllToAllBackend, AllToAllHandle, CountedHandle, WrappedBackend, check_counts
from worker.moe.ubatch import current_ubatch

_STOP = None


class StreamHandle:
    """A job submitted to the stream; its result is the wrapped backend's handle."""

    __slots__ = ("_job",)

    def __init__(self, job: Future) -> None:
        self._job = job

    def is_completed(self) -> bool:
        # A failed job is complete: its `wait` raises at once.
        job = self._job
        return job.done() and (job.exception() is not None or job.result().is_completed())

    def wait(self) -> torch.Tensor:
        return self._job.result().wait()

    def recv_counts(self) -> list[int]:
        """The receive counts (a `start_all_to_all_v` job's; blocks until exchanged)."""
        return self._job.result().recv_counts()


class CommStreamBackend(WrappedBackend):
    """`inner`, with every collective issued in submission order, off the caller's
    thread where the caller has better things to do."""

    def __init__(self, inner: AllToAllBackend) -> None:
        super().__init__(inner)
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._state = threading.Lock()  # guards _thread and _num_pending
        self._num_pending = 0  # jobs queued or running, on the stream or on a caller
        # NOTE: held while calling into `inner`; free whenever _num_pending is 0.
        self._issue = threading.Lock()

    def exchange_counts(self, send_counts: Sequence[int]) -> list[int]:
        return self._run(lambda: self.inner.exchange_counts(send_counts), may_run_here=True).result()

    def all_to_all(
        self, rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> AllToAllHandle:
        check_counts(self, rows, send_counts)
        return StreamHandle(self._run(lambda: self.inner.all_to_all(rows, send_counts, recv_counts), True))

    def start_all_to_all_v(self, rows: torch.Tensor, send_counts: Sequence[int]) -> CountedHandle:
        check_counts(self, rows, send_counts)
        # Only a micro-batch thread has other work (its peer's) to run meanwhile.
        job = self._run(lambda: self.inner.start_all_to_all_v(rows, send_counts), current_ubatch() is None)
        return StreamHandle(job)

    def close(self) -> None:
        """Finish the submitted jobs and stop the stream thread (called by the stream's
        one user, not while another thread may still submit)."""
        with self._state:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(_STOP)
            thread.join()

    def _run(self, fn: Callable[[], Any], may_run_here: bool) -> Future:
        """Run `fn` after every job submitted before it: here, if the stream is idle and
        the caller would only wait for it, else on the stream thread."""
        job: Future = Future()
        with self._state:
            run_here = may_run_here and self._num_pending == 0
            self._num_pending += 1
            if run_here:
                self._issue.acquire()
            else:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, name=f"comm-stream-{self.rank}", daemon=True)
                    self._thread.start()
                self._jobs.put((job, fn))
        if run_here:
            self._execute(job, fn)
        return job

    def _serve(self) -> None:
        while (item := self._jobs.get()) is not _STOP:
            self._issue.acquire()
            self._execute(*item)

    def _execute(self, job: Future, fn: Callable[[], Any]) -> None:
        # Called with _issue held. The stream counts as idle again before the waiter
        # wakes, so a caller's next call may run on the caller.
        try:
            result, error = fn(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the job's waiter
            result, error = None, exc
        self._issue.release()
        with self._state:
            self._num_pending -= 1
        if error is None:
            job.set_result(result)
        else:
            job.set_exception(error)
