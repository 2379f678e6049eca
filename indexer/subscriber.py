"""One worker's KV event stream into the prefix index: ordering, gaps, replay and resync.

An `EventSubscriber` owns one asyncio ZMQ SUB socket connected to one worker's events
endpoint (vLLM's `[topic, seq, payload]` messages) and feeds the batches, in seq
order, to `index.apply((worker_id, dp_rank), batch)`. It is the only writer of the
index entries of the worker keys it feeds. The router starts one per worker endpoint
and reads `stats`.

Invariants:
- Batches are applied in strictly increasing seq order, each at most once.
- Missing batches (a gap in seq, or history from before the router started) are
  fetched from the worker's replay endpoint (DEALER `[b"", start]`, answered with
  `[b"", seq, payload]` until seq -1). Where replay cannot cover the whole gap, every
  worker key this subscriber fed is cleared before going on: the index may then miss
  blocks (it refills as the worker caches more) but never keeps a removed one.
- A seq at or below the last one means the publisher restarted: clear, then catch up
  from seq 0 by replay where possible.
- A malformed message is counted and skipped; it never advances `last_seq`.

- A reconnection (the SUB socket's monitor saw the connection drop) followed by any
  seq other than last + 1 is also taken for a restart: vLLM's protocol carries no
  publisher epoch, and a restarted publisher may already be past the old last seq by
  the time the socket reconnects; mistaking its history for a gap would apply it over
  the old process's entries.

`run()` never awaits in the middle of an index mutation: replayed batches are all
fetched and decoded before the first is applied.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash
import zmq
import zmq.asyncio

from indexer.background import BackgroundLoop
from indexer.events import END_OF_REPLAY_SEQ, BatchDecoder, EventBatch, MalformedBatch, decode_seq, encode_seq

logger = logging.getLogger(__name__)
_digest = xxhash.xxh3_64_intdigest
_Replayed = tuple[int, list[EventBatch], list[int]]

WorkerKey = tuple[str, int]


class EventSink(Protocol):
    """What the subscriber needs of the index (`indexer.index.PrefixIndex` fits)."""

    def apply(self, worker: WorkerKey, batch: EventBatch) -> Any: ...

    def clear(self, worker: WorkerKey) -> Any: ...


@dataclass(slots=True)
class SubscriberStats:
    num_messages: int = 0  # live messages received, malformed ones included
    num_batches: int = 0  # batches applied, live and replayed
    num_events: int = 0
    num_gaps: int = 0  # times batches were missing (startup and restarts included)
    num_replays: int = 0  # replayed batches applied
    num_resyncs: int = 0  # times the fed keys were cleared because history was lost
    num_restarts: int = 0  # publisher restarts seen (seq went back)
    num_malformed: int = 0
    last_seq: int | None = None
    last_message_at: float | None = None  # time.monotonic() of the last live message


class EventSubscriber(BackgroundLoop):
    """Feeds one worker events endpoint into a prefix index (see the module docstring)."""

    def __init__(
        self,
        index: EventSink,
        worker_id: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        dp_rank: int | None = None,
        replay_timeout_s: float = 1.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if replay_timeout_s <= 0:
            raise ValueError("replay_timeout_s must be positive")
        self.index = index
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.dp_rank = dp_rank
        self.replay_timeout_s = replay_timeout_s
        self.stats = SubscriberStats()
        self._topic = topic.encode()
        self._given_context = context
        self._context: zmq.asyncio.Context | None = None
        self._decoder = BatchDecoder()
        self._fed: set[WorkerKey] = set()
        self._reconnected = False  # the connection dropped since the last live message
        # seq -> payload digest of batches applied from replay at connect, until the first
        # live message that is not one of them (they may also arrive live, once).
        self._replayed_digests: dict[int, int] | None = None

    # -- lifecycle -----------------------------------------------------------------

    async def run(self) -> None:
        """Receives and applies batches until cancelled; sockets are closed on the way out.

        Without a `context`, one is made and terminated here; pass a shared one when
        running many subscribers (each context has its own I/O thread).
        """
        owned = self._given_context is None
        self._context = zmq.asyncio.Context() if owned else self._given_context
        assert self._context is not None
        sock = self._context.socket(zmq.SUB)
        monitor = self._open_monitor(sock)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            sock.connect(self.endpoint)
            await self._catch_up_at_connect()
            while True:
                frames = await sock.recv_multipart()
                if self._saw_disconnect(monitor):
                    self._reconnected = True
                await self.handle(frames)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            if owned:
                self._context.term()
            self._context = None

    def _open_monitor(self, sock: zmq.asyncio.Socket) -> zmq.Socket:
        """A synchronous PAIR receiving the SUB socket's disconnect events, read without
        awaiting when a message arrives."""
        assert self._context is not None
        address = f"inproc://kv-subscriber-monitor-{id(self)}"
        sock.monitor(address, zmq.EVENT_DISCONNECTED)
        monitor = zmq.Context.shadow(self._context.underlying).socket(zmq.PAIR)
        monitor.connect(address)
        return monitor

    @staticmethod
    def _saw_disconnect(monitor: zmq.Socket) -> bool:
        seen = False
        while monitor.poll(0):
            monitor.recv_multipart()
            seen = True
        return seen

    def task_name(self) -> str:
        return f"kv-subscriber {self.worker_id}"

    # -- one live message ----------------------------------------------------------

    async def handle(self, frames: list[bytes]) -> None:
        """Applies one live `[topic, seq, payload]` message, catching up first if needed."""
        self.stats.num_messages += 1
        self.stats.last_message_at = time.monotonic()
        parsed = self._parse(frames)
        if parsed is None:
            return
        seq, batch = parsed
        reconnected, self._reconnected = self._reconnected, False
        if self._replayed_digests is not None:
            if not reconnected and self._replayed_digests.get(seq) == _digest(frames[2]):
                return  # published while we read it from replay: applied already
            self._replayed_digests = None
        last = self.stats.last_seq
        expected = 0 if last is None else last + 1
        resync_if_uncovered = True
        if seq < expected or (reconnected and seq != expected):
            self.stats.num_restarts += 1
            self._resync(batch, f"publisher restarted (seq {seq} after {last})")
            expected, resync_if_uncovered = 0, False
        if seq > expected:
            await self._catch_up(expected, seq, batch, resync=resync_if_uncovered)
        self._apply(seq, batch)

    def _parse(self, frames: list[bytes]) -> tuple[int, EventBatch] | None:
        try:
            if len(frames) != 3:
                raise MalformedBatch(f"{len(frames)} frames, expected 3")
            seq = decode_seq(frames[1])
            if seq < 0:
                raise MalformedBatch(f"negative seq {seq} on the live stream")
            return seq, self._decoder.decode(frames[2])
        except MalformedBatch as exc:
            self._count_malformed(f"skipped a malformed message: {exc}")
            return None

    def _count_malformed(self, reason: str) -> None:
        self.stats.num_malformed += 1
        num_malformed = self.stats.num_malformed
        # A peer sending garbage in a loop must not flood the log.
        level = logging.WARNING if num_malformed in (1, 10, 100) or num_malformed % 1000 == 0 else logging.DEBUG
        logger.log(level, "kv subscriber %s (%d malformed): %s", self.worker_id, num_malformed, reason)

    def _key(self, batch: EventBatch) -> WorkerKey:
        if self.dp_rank is not None:
            return (self.worker_id, self.dp_rank)
        return (self.worker_id, batch.data_parallel_rank or 0)

    def _apply(self, seq: int, batch: EventBatch) -> None:
        key = self._key(batch)
        self.index.apply(key, batch)
        self._fed.add(key)
        self.stats.num_batches += 1
        self.stats.num_events += len(batch.events)
        self.stats.last_seq = seq

    def _resync(self, live_batch: EventBatch, reason: str) -> None:
        """Clears every key this subscriber fed (and the live batch's): history is lost."""
        for key in self._fed | {self._key(live_batch)}:
            self.index.clear(key)
        self.stats.num_resyncs += 1
        logger.warning("kv subscriber %s: resync, cleared its index entries: %s", self.worker_id, reason)

    # -- gaps ----------------------------------------------------------------------

    async def _catch_up_at_connect(self) -> None:
        """Indexes what the worker cached before this subscriber connected.

        An idle worker sends nothing live that would reveal a gap, so its replay buffer
        is read once up front. If the buffer no longer starts at seq 0, what came before
        is gone: nothing is indexed yet, so there is nothing stale to clear (stores
        chained to the lost blocks are counted as unknown parents and dropped).
        """
        if self.replay_endpoint is None or self.stats.last_seq is not None:
            return
        replayed = await self._fetch_replay(0, None)
        if not replayed:
            return
        first_seq, batches, digests = replayed
        if first_seq > 0:
            self.stats.num_gaps += 1
        for offset, batch in enumerate(batches):
            self._apply(first_seq + offset, batch)
        self.stats.num_replays += len(batches)
        self._replayed_digests = dict(zip(range(first_seq, first_seq + len(batches)), digests))

    async def _catch_up(self, start: int, end: int, live_batch: EventBatch, *, resync: bool) -> None:
        """Applies the batches `start..end-1` from replay, or resyncs if it cannot."""
        self.stats.num_gaps += 1
        replayed = await self._fetch_replay(start, end)
        if replayed is None:
            if resync:
                self._resync(live_batch, f"replay could not cover seq {start}..{end - 1}")
            return
        batches = replayed[1]
        for offset, batch in enumerate(batches):
            self._apply(start + offset, batch)
        self.stats.num_replays += len(batches)

    async def _fetch_replay(self, start: int, end: int | None) -> _Replayed | None:
        """`(first_seq, batches, payload digests)`: consecutive decoded batches from the replay endpoint,
        from `start` (or the oldest buffered after it) up to `end - 1`, or to the end of
        the buffer when `end` is None. None if the answer has a hole, an undecodable
        batch, stops short of `end`, or is late."""
        if self.replay_endpoint is None or self._context is None:
            return None
        # A fresh socket per request, so a late answer to an earlier one is never read.
        sock = self._context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(self.replay_endpoint)
            async with asyncio.timeout(self.replay_timeout_s):
                await sock.send_multipart([b"", encode_seq(start)])
                return await self._read_replay(sock, start, end)
        except TimeoutError:
            logger.warning("kv subscriber %s: replay from seq %d timed out", self.worker_id, start)
            return None
        finally:
            sock.close(linger=0)

    async def _read_replay(
        self, sock: zmq.asyncio.Socket, start: int, end: int | None
    ) -> _Replayed | None:
        first_seq = -1
        batches: list[EventBatch] = []
        digests: list[int] = []
        while end is None or first_seq < 0 or first_seq + len(batches) < end:
            frames = await sock.recv_multipart()
            try:
                if len(frames) != 3 or frames[0] != b"":
                    raise MalformedBatch(f"replay answer of {len(frames)} frames")
                seq = decode_seq(frames[1])
                if seq == END_OF_REPLAY_SEQ:
                    break
                if first_seq < 0:
                    if end is not None and seq != start:
                        return None  # a gap must be covered from its first seq
                    first_seq = seq
                elif seq != first_seq + len(batches):
                    return None  # a hole in the answer
                batches.append(self._decoder.decode(frames[2]))
                digests.append(_digest(frames[2]))
            except MalformedBatch as exc:
                self._count_malformed(f"malformed replay answer: {exc}")
                return None
        if not batches or (end is not None and first_seq + len(batches) < end):
            return None
        return first_seq, batches, digests
