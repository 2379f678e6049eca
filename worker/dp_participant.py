"""One DP rank's side of the step coordinator (seed 004): tells its engine loop when
to run a real batch, a dummy batch, or sleep.

The engine thread calls `wait_for_work_or_step(has_work)` at the top of every loop
iteration and `finish_step()` after the batch it was told to run:

- `RUN_REAL`: the rank has work; its local step advances, and if that puts it ahead
  of the global step it knows, `StartStep` goes to the coordinator (no round trip is
  awaited: the collective inside the forward is what synchronises the ranks);
- `RUN_DUMMY`: no work, but the global step is ahead of the local one, so another
  rank is in a forward that needs this rank's collective;
- `IDLE`: no work and caught up; the call blocked (no CPU) until the global step
  moved, `wake()` was called, or `timeout_s` passed. The caller re-checks its work.

Producers that hand the engine new work call `wake()` (any thread) so an idle rank
returns at once. A dead peer or a silent coordinator turns every later call into a
`DPGroupLost` the engine loop can catch: the collectives could never complete.

One I/O thread owns the DEALER socket: it heartbeats even while the engine is inside a
long forward, and turns coordinator messages into state under a condition variable.
The engine thread never touches the socket.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from worker.dp_coordinator import (
    Bye,
    Heartbeat,
    RankDead,
    Register,
    StartStep,
    Step,
    ToCoordinator,
    ToParticipant,
    Waker,
    Welcome,
    rank_identity,
)


class Decision(enum.Enum):
    RUN_REAL = "run_real"
    RUN_DUMMY = "run_dummy"
    IDLE = "idle"


class DPGroupLost(RuntimeError):
    """The DP group cannot step any more: a rank died or the coordinator went silent."""

    def __init__(self, reason: str, dead_ranks: list[int]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.dead_ranks = dead_ranks


@dataclass(frozen=True)
class DPParticipantConfig:
    address: str
    dp_rank: int
    heartbeat_interval_s: float = 1.0
    liveness_timeout_s: float = 10.0
    register_timeout_s: float = 30.0


class DPParticipant:
    """Counters `num_real_steps`, `num_dummy_steps`, `num_idle_waits` are for metrics."""

    def __init__(self, config: DPParticipantConfig) -> None:
        self._config = config
        self._cond = threading.Condition()
        self._local_step = 0
        self._coord_step = 0
        self._registered = False
        self._lost: DPGroupLost | None = None
        self._woken = False
        self._in_step = False
        self._stopping = False
        self.num_real_steps = 0
        self.num_dummy_steps = 0
        self.num_idle_waits = 0
        self._outbox: queue.SimpleQueue[ToCoordinator] = queue.SimpleQueue()
        self._waker = Waker()
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IDENTITY, rank_identity(config.dp_rank))
        self._socket.connect(config.address)
        self._thread = threading.Thread(
            target=self._run, name=f"dp-participant-{config.dp_rank}", daemon=True
        )
        self._thread.start()
        self._wait_registered()

    @property
    def dp_rank(self) -> int:
        return self._config.dp_rank

    @property
    def local_step(self) -> int:
        return self._local_step

    @property
    def coord_step(self) -> int:
        with self._cond:
            return self._coord_step

    @property
    def lost(self) -> DPGroupLost | None:
        with self._cond:
            return self._lost

    # --- engine thread ---------------------------------------------------------------

    def wait_for_work_or_step(self, has_work: bool, timeout_s: float | None = None) -> Decision:
        if self._in_step:
            raise RuntimeError("finish_step() was not called after the previous step")
        with self._cond:
            self._raise_if_lost()
            if has_work:
                return self._begin_real()
            if self._local_step >= self._coord_step and not self._woken:
                self.num_idle_waits += 1
                self._cond.wait_for(self._should_return, timeout_s)
                self._raise_if_lost()
            self._woken = False
            if self._local_step < self._coord_step:
                return self._begin(Decision.RUN_DUMMY)
            return Decision.IDLE

    def finish_step(self) -> None:
        if not self._in_step:
            raise RuntimeError("finish_step() called outside a step")
        self._in_step = False

    def wake(self) -> None:
        """Make a blocked (or the next) `wait_for_work_or_step` return; any thread."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def close(self) -> None:
        """Leave the group cleanly (the coordinator does not report this rank dead)."""
        if self._stopping:
            return
        self._outbox.put(Bye(self._config.dp_rank))
        self._stopping = True
        self._waker.wake()
        self._thread.join()
        self._socket.close()
        self._ctx.term()
        self._waker.close()

    def _begin_real(self) -> Decision:
        decision = self._begin(Decision.RUN_REAL)
        if self._local_step > self._coord_step:
            self._outbox.put(StartStep(self._config.dp_rank, self._local_step))
            self._waker.wake()
        return decision

    def _begin(self, decision: Decision) -> Decision:
        self._local_step += 1
        self._in_step = True
        if decision is Decision.RUN_REAL:
            self.num_real_steps += 1
        else:
            self.num_dummy_steps += 1
        return decision

    def _should_return(self) -> bool:
        return self._woken or self._lost is not None or self._local_step < self._coord_step

    def _raise_if_lost(self) -> None:
        if self._lost is not None:
            raise self._lost

    def _wait_registered(self) -> None:
        with self._cond:
            registered = self._cond.wait_for(
                lambda: self._registered or self._lost is not None,
                self._config.register_timeout_s,
            )
        if not registered or self._lost is not None:
            self.close()
            raise DPGroupLost(f"no coordinator answered at {self._config.address}", [])

    # --- I/O thread ------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        decoder = msgspec.msgpack.Decoder(ToParticipant)
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        interval_s = self._config.heartbeat_interval_s
        self._send(encoder, Register(self._config.dp_rank))
        last_heard = time.monotonic()
        next_beat = last_heard + interval_s
        while True:
            timeout_ms = max(0.0, next_beat - time.monotonic()) * 1000
            for sock, _ in poller.poll(timeout_ms):
                if sock is self._socket:
                    last_heard = self._drain_socket(decoder, last_heard)
                else:
                    self._waker.drain()
            self._flush_outbox(encoder)
            if self._stopping:
                return
            now = time.monotonic()
            if now >= next_beat:
                self._send(encoder, Heartbeat(self._config.dp_rank))
                self._check_coordinator(now - last_heard)
                next_beat = now + interval_s

    def _flush_outbox(self, encoder: msgspec.msgpack.Encoder) -> None:
        while True:
            try:
                message = self._outbox.get_nowait()
            except queue.Empty:
                return
            self._send(encoder, message)

    def _send(self, encoder: msgspec.msgpack.Encoder, message: ToCoordinator) -> None:
        try:
            self._socket.send(encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            # NOTE: the queue to a vanished coordinator is full; blocking here would stop
            # the heartbeat check that reports it.
            pass

    def _drain_socket(self, decoder: msgspec.msgpack.Decoder, last_heard: float) -> float:
        while True:
            try:
                payload = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return last_heard
            last_heard = time.monotonic()
            self._apply(decoder.decode(payload))

    def _apply(self, message: ToParticipant) -> None:
        with self._cond:
            if isinstance(message, Welcome) and not self._registered:
                # A rank joining late starts at the global step: the steps it missed
                # were completed by the others without it.
                self._registered = True
                self._local_step = self._coord_step = message.step
            elif isinstance(message, Step):
                self._coord_step = max(self._coord_step, message.step)
            elif isinstance(message, RankDead) and self._lost is None:
                self._lost = DPGroupLost(
                    f"DP rank {message.dp_rank} died", [message.dp_rank]
                )
            self._cond.notify_all()

    def _check_coordinator(self, silent_s: float) -> None:
        if silent_s <= self._config.liveness_timeout_s:
            return
        with self._cond:
            if not self._registered:
                return  # register_timeout_s governs the wait for the first answer
            if self._lost is None:
                self._lost = DPGroupLost(
                    f"DP coordinator silent for {silent_s:.1f}s", []
                )
            self._cond.notify_all()
