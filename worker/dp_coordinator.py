"""The DP step coordinator: keeps data-parallel engine ranks in lock-step (seed 004).

Collective MoE layers hang unless every DP rank runs the same number of forward
steps. Instead of the router waking idle ranks ("DP waves"), the ranks agree among
themselves: a rank with work advances its local step and, when it is ahead of the
global step it knows, sends `StartStep(step)` here; the coordinator raises the global
step and broadcasts `Step(step)` to every participant, and idle ranks run dummy steps
until they catch up (`worker.dp_participant`). When no rank has work, nobody sends
anything and every rank blocks.

This module owns the wire types of that small protocol (tagged msgspec structs over
one ROUTER socket, participants connect DEALERs with identity `dp<rank>`) and
`DPCoordinator`, run by DP rank 0 in a background thread.

Invariants:
- the global step never decreases; a `Step` carrying an older value is a heartbeat;
- a registered rank that sends nothing for `liveness_timeout_s` is declared dead,
  once, and every surviving participant is told with `RankDead`;
- a rank that says `Bye` leaves without being reported dead;
- no participant is welcomed (so none steps) before all `num_ranks` have registered.

Liveness: participants heartbeat every `heartbeat_interval_s` from their I/O thread,
and the coordinator re-broadcasts its step as its own heartbeat, so an idle group
wakes a few times a second at most and otherwise sits in `zmq_poll`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

logger = logging.getLogger(__name__)


# --- wire types (only grow at the end) -------------------------------------------


class Register(msgspec.Struct, tag="register", array_like=True):
    dp_rank: int


class StartStep(msgspec.Struct, tag="start_step", array_like=True):
    dp_rank: int
    step: int


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    dp_rank: int


class Bye(msgspec.Struct, tag="bye", array_like=True):
    dp_rank: int


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    step: int


class Step(msgspec.Struct, tag="step", array_like=True):
    step: int


class RankDead(msgspec.Struct, tag="rank_dead", array_like=True):
    dp_rank: int


ToCoordinator = Register | StartStep | Heartbeat | Bye
ToParticipant = Welcome | Step | RankDead


def rank_identity(dp_rank: int) -> bytes:
    return f"dp{dp_rank}".encode()


class Waker:
    """A self-pipe: lets any thread interrupt a `zmq.Poller` that watches `fd`."""

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    @property
    def fd(self) -> int:
        return self._read_fd

    def wake(self) -> None:
        try:
            os.write(self._write_fd, b"x")
        except BlockingIOError:
            pass  # the pipe is full, so the reader is woken anyway

    def drain(self) -> None:
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)


# --- coordinator -------------------------------------------------------------------


@dataclass(frozen=True)
class DPCoordinatorConfig:
    address: str
    num_ranks: int
    heartbeat_interval_s: float = 1.0
    liveness_timeout_s: float = 10.0
    # Raising the global step past the requested one saves round trips when ranks
    # stay busy, at the price of that many extra dummy steps on every rank.
    num_lookahead_steps: int = 0

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        if self.liveness_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("liveness_timeout_s must exceed heartbeat_interval_s")
        if self.num_lookahead_steps < 0:
            raise ValueError("num_lookahead_steps must be >= 0")


class DPCoordinator:
    """The global step and rank liveness, served from one background thread.

    `start()` binds (the bound endpoint is then in `address`, useful with
    `tcp://127.0.0.1:*`); `close()` stops the thread and closes the socket. The
    read-only properties are safe to call from any thread.
    """

    def __init__(self, config: DPCoordinatorConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._step = 0
        self._last_seen: dict[int, float] = {}
        self._dead_ranks: list[int] = []
        self._left_ranks: set[int] = set()
        self._formed = False
        self._waker = Waker()
        self._stopping = False
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._address = config.address
        self._thread = threading.Thread(target=self._run, name="dp-coordinator", daemon=True)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToCoordinator)

    @property
    def address(self) -> str:
        return self._address

    @property
    def step(self) -> int:
        with self._lock:
            return self._step

    @property
    def dead_ranks(self) -> list[int]:
        """Ranks declared dead, in detection order."""
        with self._lock:
            return list(self._dead_ranks)

    @property
    def registered_ranks(self) -> list[int]:
        with self._lock:
            return sorted(self._last_seen)

    def start(self) -> None:
        self._socket.bind(self._config.address)
        self._address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread.start()

    def wait_registered(self, timeout_s: float) -> bool:
        """Block until every rank has registered; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while len(self._last_seen) + len(self._left_ranks) < self._config.num_ranks:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._changed.wait(remaining):
                    return False
        return True

    def wait_dead(self, timeout_s: float) -> list[int]:
        """Block until some rank is declared dead or timeout; returns `dead_ranks`."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self._dead_ranks:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._changed.wait(remaining):
                    break
            return list(self._dead_ranks)

    def close(self) -> None:
        self._stopping = True
        self._waker.wake()
        if self._thread.is_alive():
            self._thread.join()
        self._socket.close()
        self._ctx.term()
        self._waker.close()

    # --- the coordinator thread ------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._waker.fd, zmq.POLLIN)
        interval_s = self._config.heartbeat_interval_s
        next_beat = time.monotonic() + interval_s
        while not self._stopping:
            timeout_ms = max(0.0, next_beat - time.monotonic()) * 1000
            for sock, _ in poller.poll(timeout_ms):
                if sock is self._socket:
                    self._drain_socket()
                else:
                    self._waker.drain()
            now = time.monotonic()
            if now >= next_beat:
                self._check_liveness(now)
                self._broadcast(Step(self.step))
                next_beat = now + interval_s

    def _drain_socket(self) -> None:
        while True:
            try:
                identity, payload = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self._decoder.decode(payload)
            except msgspec.DecodeError:
                logger.warning("dropping undecodable DP message from %r", identity)
                continue
            self._handle(identity, message)

    def _handle(self, identity: bytes, message: ToCoordinator) -> None:
        rank = message.dp_rank
        if not 0 <= rank < self._config.num_ranks or identity != rank_identity(rank):
            logger.warning("dropping DP message with bad rank %d from %r", rank, identity)
            return
        with self._changed:
            if rank in self._dead_ranks:
                return  # a dead rank stays dead: the group must be restarted
            if isinstance(message, Bye):
                self._last_seen.pop(rank, None)
                self._left_ranks.add(rank)
                self._changed.notify_all()
                return
            is_new = rank not in self._last_seen
            self._last_seen[rank] = time.monotonic()
            if is_new:
                self._left_ranks.discard(rank)
                self._changed.notify_all()
        if isinstance(message, Register):
            self._may_welcome(rank)
        elif isinstance(message, StartStep):
            self._may_advance(message.step)

    def _may_welcome(self, rank: int) -> None:
        # NOTE: nobody is welcomed before the whole group has registered, so no rank
        # can step while another could still miss that step's collective.
        with self._lock:
            was_formed = self._formed
            self._formed = len(self._last_seen) + len(self._left_ranks) == self._config.num_ranks
            welcome = Welcome(self._step)
        if was_formed:
            self._send(rank, welcome)
        elif self._formed:
            self._broadcast(welcome)

    def _may_advance(self, step: int) -> None:
        with self._lock:
            if step <= self._step:
                return  # another rank already pushed the group this far
            self._step = step + self._config.num_lookahead_steps
            new_step = self._step
        self._broadcast(Step(new_step))

    def _check_liveness(self, now: float) -> None:
        timeout_s = self._config.liveness_timeout_s
        with self._changed:
            newly_dead = [r for r, seen in self._last_seen.items() if now - seen > timeout_s]
            for rank in newly_dead:
                del self._last_seen[rank]
                self._dead_ranks.append(rank)
            if newly_dead:
                self._changed.notify_all()
        for rank in newly_dead:
            logger.error("DP rank %d missed heartbeats for %.1fs: declared dead", rank, timeout_s)
            self._broadcast(RankDead(rank))

    def _broadcast(self, message: ToParticipant) -> None:
        with self._lock:
            ranks = list(self._last_seen)
        for rank in ranks:
            self._send(rank, message)

    def _send(self, rank: int, message: ToParticipant) -> None:
        try:
            self._socket.send_multipart(
                [rank_identity(rank), self._encoder.encode(message)], zmq.NOBLOCK
            )
        except zmq.Again:
            # NOTE: a peer this far behind is either dead (liveness will say so) or will
            # catch up from the next Step, which carries the whole state.
            logger.warning("DP rank %d is not draining its socket", rank)
