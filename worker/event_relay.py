"""Relays an engine's local KV event stream to an endpoint the router can reach.

Owns `SeqRing` (pure: the replay buffer of `(seq, payload)`) and `EventRelay` (the
asyncio edge: a SUB + replay DEALER towards the engine, a PUB + replay ROUTER towards
the router). Caller: `worker.sidecar` (`kvgate sidecar --relay`).

Semantics kept from vLLM's protocol (see `indexer.events`, `indexer.subscriber`):
- Payloads are forwarded byte for byte under the engine's own seq, so the router's
  subscriber sees exactly the stream it would see from the engine.
- A gap in the engine's seqs is filled from the engine's replay endpoint before the
  live batch is forwarded. A gap the engine cannot fill is forwarded as a gap: the
  ring has no batch for it, so the router's replay request fails and it resyncs.
- An engine restart (seq back, or any unexpected seq after a reconnection) empties
  the ring and re-sends the new engine's history from seq 0 (by replay), so the
  router sees the seq go back and resyncs too.
- `engine_lost()` (the sidecar saw the engine die) empties the ring as well, so a
  router catching up later never re-indexes a dead engine's blocks.
- The ring is mutated only by the follower task, never across an await.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass

import zmq
import zmq.asyncio

from indexer.events import END_OF_REPLAY_SEQ, BatchDecoder, MalformedBatch, decode_seq, encode_seq

logger = logging.getLogger(__name__)

Entry = tuple[int, bytes]  # (seq, payload)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("relay task %s failed", task.get_name(), exc_info=task.exception())


class SeqRing:
    """The last `size` batches, in strictly increasing seq order."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError("size must be positive")
        self.size = size
        self._entries: deque[Entry] = deque(maxlen=size)

    def append(self, seq: int, payload: bytes) -> None:
        assert not self._entries or seq > self._entries[-1][0], "seqs must increase"
        self._entries.append((seq, payload))

    def clear(self) -> None:
        self._entries.clear()

    def since(self, start: int) -> list[Entry]:
        return [entry for entry in self._entries if entry[0] >= start]

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(slots=True)
class RelayStats:
    num_forwarded: int = 0  # batches published, replayed ones included
    num_from_replay: int = 0  # batches fetched from the engine's replay endpoint
    num_gaps: int = 0
    num_lost: int = 0  # gaps the engine could not fill
    num_restarts: int = 0
    num_malformed: int = 0
    num_replay_requests: int = 0  # from the router
    last_seq: int | None = None


class EventRelay:
    """See the module docstring. `start()` binds (errors raise), `close()` stops everything."""

    def __init__(
        self,
        upstream: str,
        upstream_replay: str | None,
        endpoint: str,
        replay_endpoint: str,
        *,
        topic: str = "",
        buffer_size: int = 10_000,
        replay_timeout_s: float = 1.0,
    ) -> None:
        self.upstream = upstream
        self.upstream_replay = upstream_replay
        self.stats = RelayStats()
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._topic_frame = self._topic  # the engine's topic, once a live message shows it
        self._replay_timeout_s = replay_timeout_s
        self._ring = SeqRing(buffer_size)
        self._decoder = BatchDecoder()
        self._context = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._reconnected = False
        self._replayed_through: int | None = None
        # Held while taking in a live message or the history: both await the engine's
        # replay, and the sidecar's catch_up() may run beside the follower.
        self._lock = asyncio.Lock()
        self.bound_endpoint: str | None = None
        self.bound_replay_endpoint: str | None = None

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.bind(self._endpoint)
            self.bound_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self._router = self._context.socket(zmq.ROUTER)
            # A whole answer must fit in one client's pipe, or ROUTER drops its tail.
            self._router.setsockopt(zmq.SNDHWM, self._ring.size + 1)
            self._router.bind(self._replay_endpoint)
            self.bound_replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._tasks = [
            asyncio.create_task(self._follow(), name="relay-follow"),
            asyncio.create_task(self._serve_replay(), name="relay-replay"),
        ]
        for task in self._tasks:
            task.add_done_callback(_log_failure)

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        self._context.term()

    # -- what the sidecar calls ----------------------------------------------------

    def engine_lost(self) -> None:
        """The engine died: forget its history (see the module docstring)."""
        self._ring.clear()
        self.stats.last_seq = self._replayed_through = None

    async def catch_up(self) -> None:
        """Takes in the engine's buffered history when nothing of it is held yet."""
        async with self._lock:
            await self._catch_up()

    async def _catch_up(self) -> None:
        if self.stats.last_seq is not None or self.upstream_replay is None:
            return
        entries = await self._fetch_replay(0, None)
        if entries is None or self.stats.last_seq is not None:
            return
        if entries[0][0] > 0:
            self.stats.num_gaps += 1
        for seq, payload in entries:
            self._forward(seq, payload)
        self._replayed_through = self.stats.last_seq

    # -- engine side ---------------------------------------------------------------

    async def _follow(self) -> None:
        sock = self._context.socket(zmq.SUB)
        address = f"inproc://relay-monitor-{id(self)}"
        sock.monitor(address, zmq.EVENT_DISCONNECTED)
        monitor = zmq.Context.shadow(self._context.underlying).socket(zmq.PAIR)
        monitor.connect(address)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            sock.connect(self.upstream)
            await self.catch_up()
            while True:
                frames = await sock.recv_multipart()
                while monitor.poll(0):
                    monitor.recv_multipart()
                    self._reconnected = True
                async with self._lock:
                    await self._handle(frames)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    async def _handle(self, frames: list[bytes]) -> None:
        parsed = self._parse(frames)
        if parsed is None:
            return
        seq, payload = parsed
        self._topic_frame = frames[0]
        reconnected, self._reconnected = self._reconnected, False
        replayed_through, self._replayed_through = self._replayed_through, None
        if replayed_through is not None and seq <= replayed_through and not reconnected:
            self._replayed_through = replayed_through  # already forwarded from replay
            return
        last = self.stats.last_seq
        expected = 0 if last is None else last + 1
        if seq < expected or (reconnected and seq != expected):
            self.stats.num_restarts += 1
            logger.warning("relay: engine restarted (seq %d after %s): re-sending its history", seq, last)
            self._ring.clear()
            expected = 0
        if seq > expected:
            await self._fill_gap(expected, seq)
        self._forward(seq, payload)

    def _parse(self, frames: list[bytes]) -> Entry | None:
        try:
            if len(frames) != 3:
                raise MalformedBatch(f"{len(frames)} frames, expected 3")
            seq = decode_seq(frames[1])
            if seq < 0:
                raise MalformedBatch(f"negative seq {seq}")
            self._decoder.decode(frames[2])  # only forward what the router can read
        except MalformedBatch as exc:
            self.stats.num_malformed += 1
            if self.stats.num_malformed in (1, 10, 100) or self.stats.num_malformed % 1000 == 0:
                logger.warning("relay: skipped a malformed message (%d so far): %s", self.stats.num_malformed, exc)
            return None
        return seq, frames[2]

    async def _fill_gap(self, start: int, end: int) -> None:
        self.stats.num_gaps += 1
        entries = await self._fetch_replay(start, end)
        if entries is None:
            self.stats.num_lost += 1
            logger.warning("relay: the engine cannot replay seq %d..%d; forwarding the gap", start, end - 1)
            return
        for seq, payload in entries:
            self._forward(seq, payload)

    def _forward(self, seq: int, payload: bytes) -> None:
        assert self._pub is not None
        self._ring.append(seq, payload)
        self._pub.send_multipart([self._topic_frame, encode_seq(seq), payload], copy=False)
        self.stats.num_forwarded += 1
        self.stats.last_seq = seq

    async def _fetch_replay(self, start: int, end: int | None) -> list[Entry] | None:
        """Consecutive batches from `start` (or the oldest after it when `end` is None) up
        to `end - 1` or the end of the engine's buffer; None when it cannot answer that."""
        if self.upstream_replay is None:
            return None
        sock = self._context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(self.upstream_replay)
            async with asyncio.timeout(self._replay_timeout_s):
                await sock.send_multipart([b"", encode_seq(start)])
                entries = await self._read_replay(sock)
        except TimeoutError:
            logger.warning("relay: replay from seq %d timed out", start)
            return None
        finally:
            sock.close(linger=0)
        if end is not None:
            entries = [entry for entry in entries if entry[0] < end]
        first = entries[0][0] if entries else -1
        consecutive = all(seq == first + offset for offset, (seq, _) in enumerate(entries))
        if not entries or not consecutive or (end is not None and (first != start or entries[-1][0] != end - 1)):
            return None
        self.stats.num_from_replay += len(entries)
        return entries

    async def _read_replay(self, sock: zmq.asyncio.Socket) -> list[Entry]:
        entries: list[Entry] = []
        while True:
            frames = await sock.recv_multipart()
            try:
                if len(frames) != 3 or frames[0] != b"":
                    raise MalformedBatch(f"replay answer of {len(frames)} frames")
                seq = decode_seq(frames[1])
                if seq == END_OF_REPLAY_SEQ:
                    return entries
                self._decoder.decode(frames[2])
            except MalformedBatch:
                self.stats.num_malformed += 1
                return []  # an answer that cannot be trusted covers nothing
            entries.append((seq, frames[2]))

    # -- router side ---------------------------------------------------------------

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            self.stats.num_replay_requests += 1
            if len(frames) != 3 or frames[1] != b"":
                continue
            try:
                start = decode_seq(frames[2])
            except MalformedBatch:
                continue
            client_id = frames[0]
            for seq, payload in self._ring.since(max(0, start)):
                await self._router.send_multipart([client_id, b"", encode_seq(seq), payload], copy=False)
            await self._router.send_multipart([client_id, b"", encode_seq(END_OF_REPLAY_SEQ), b""])
