"""The worker's KV event and load publishers: the only place the engine's events touch ZMQ.

`KVEventPublisher` owns a bounded queue and one thread that owns two sockets:

- a PUB socket sending vLLM's multipart `[topic, seq, payload]`, where `seq` is an
  8-byte big-endian counter and `payload` the msgpack `EventBatch`;
- optionally a ROUTER replay socket over a ring buffer of the last `buffer_size`
  `(seq, payload)`. A request `[client_id, b"", start_seq]` is answered with one
  `[client_id, b"", seq, payload]` per buffered seq >= start, then the end marker
  `[client_id, b"", -1, b""]`. A DEALER client receives the whole answer; a REQ
  client (vLLM's example) receives only its first message, REQ being one reply per
  request (the rest of the answer may still reach it after its next request, so
  subscribers should use DEALER, as `indexer.subscriber` does).

NOTE: `publish()` assigns the seq on the caller's side, before queueing. A batch
dropped because the queue is full therefore leaves a hole in the seq stream and
never reaches the ring buffer: subscribers see a gap that replay cannot cover and
resync, instead of silently keeping entries the lost batch would have removed.

The engine thread calls `publish()` once per step; it never blocks on I/O. Every
socket send goes through `_send_live` / `_send_replay`, so a test can subclass the
publisher to drop or corrupt frames.

`LoadPublisher` is the small sibling for `LoadReport`s: a PUB socket written from
the engine thread, no queue, no replay (a lost report is superseded by the next one).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from types import TracebackType

import zmq

from indexer.events import END_OF_REPLAY_SEQ, EventBatch, KVEvent, decode_seq, encode_batch, encode_seq
from indexer.load import LoadReport, encode_report

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.01  # how long the thread waits on the queue before polling replay
_MAX_BATCHES_PER_TURN = 64  # live batches sent between two looks at the replay socket
_Queued = tuple[int, float, list[KVEvent]]  # (seq, ts, events)


class KVEventPublisher:
    """Publishes the engine's KV events in vLLM's wire format, with a replay buffer."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "kv",
        buffer_size: int = 10_000,
        max_queue: int = 100_000,
        data_parallel_rank: int | None = None,
    ) -> None:
        if buffer_size <= 0 or max_queue <= 0:
            raise ValueError("buffer_size and max_queue must be positive")
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._dp_rank = data_parallel_rank
        self._queue: queue.Queue[_Queued] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._seq_lock = threading.Lock()
        self._next_seq = 0
        self._draining = threading.Event()
        self._aborting = threading.Event()
        self._context: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._close_deadline = 0.0
        self.bound_endpoint: str | None = None
        self.bound_replay_endpoint: str | None = None
        self.num_published = 0
        self.num_dropped = 0
        self.num_replay_requests = 0
        self.num_replay_malformed = 0

    # -- engine thread -------------------------------------------------------------

    def publish(self, events: list[KVEvent]) -> bool:
        """Queues one step's events; False when dropped (queue full or closed)."""
        if not events:
            return True
        if self._closed or self._draining.is_set():
            self.num_dropped += 1
            return False
        batch_ts = time.time()
        with self._seq_lock:
            # NOTE: the seq is spent even when the batch is dropped (see module doc).
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._queue.put_nowait((seq, batch_ts, events))
            except queue.Full:
                self.num_dropped += 1
                return False
        return True

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> KVEventPublisher:
        """Binds the sockets (errors raise here) and starts the publisher thread."""
        if self._thread is not None or self._closed:
            raise RuntimeError("publisher already started or closed")
        self._context = zmq.Context()
        try:
            self._bind_sockets(self._context)
        except zmq.ZMQError:
            self._close_sockets(linger_ms=0)
            self._context.term()
            self._context = None
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued (within `timeout`), then closes the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close_deadline = time.monotonic() + timeout
        self._draining.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._aborting.set()
                self._thread.join()
        if self._context is not None:
            # Blocks until the PUB's pipes are flushed or the sockets' linger is over.
            self._context.term()
            self._context = None
        if not self._queue.empty():
            logger.warning("kv publisher closed with %d batches unsent", self._queue.qsize())

    def __enter__(self) -> KVEventPublisher:
        if self._thread is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def num_queued(self) -> int:
        return self._queue.qsize()

    # -- publisher thread ----------------------------------------------------------

    def _bind_sockets(self, context: zmq.Context) -> None:
        self._pub = context.socket(zmq.PUB)
        self._pub.bind(self._endpoint)
        self.bound_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self._replay_endpoint is not None:
            self._replay = context.socket(zmq.ROUTER)
            # A full answer must fit in one client's pipe, or ROUTER drops its tail.
            self._replay.setsockopt(zmq.SNDHWM, (self._buffer.maxlen or 0) + 1)
            self._replay.bind(self._replay_endpoint)
            self.bound_replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    def _run(self) -> None:
        try:
            while not self._aborting.is_set():
                num_sent = self._send_queued()
                self._serve_replay()
                if num_sent == 0 and self._draining.is_set() and self._queue.empty():
                    break
        except Exception:
            logger.exception("kv publisher thread failed")
        finally:
            remaining_s = 0.0 if self._aborting.is_set() else self._close_deadline - time.monotonic()
            self._close_sockets(linger_ms=max(0, int(remaining_s * 1000)))

    def _send_queued(self) -> int:
        """Sends up to a turn's worth of queued batches; waits briefly when idle."""
        wait_s = _IDLE_WAIT_S if self._replay is not None or self._draining.is_set() else 0.1
        num_sent = 0
        while num_sent < _MAX_BATCHES_PER_TURN and not self._aborting.is_set():
            try:
                item = self._queue.get(timeout=wait_s) if num_sent == 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            self._send_batch(*item)
            num_sent += 1
        return num_sent

    def _send_batch(self, seq: int, batch_ts: float, events: list[KVEvent]) -> None:
        payload = encode_batch(EventBatch(batch_ts, events, self._dp_rank))
        self._buffer.append((seq, payload))
        self._send_live([self._topic, encode_seq(seq), payload])
        self.num_published += 1

    def _send_live(self, frames: list[bytes]) -> None:
        """The one live send; PUB never blocks (it drops for a subscriber at its HWM)."""
        assert self._pub is not None
        self._pub.send_multipart(frames, copy=False)

    def _serve_replay(self) -> None:
        if self._replay is None:
            return
        while self._replay.poll(0, zmq.POLLIN):
            frames = self._replay.recv_multipart()
            self.num_replay_requests += 1
            start = self._parse_replay_request(frames)
            if start is None:
                self.num_replay_malformed += 1
                continue
            client_id = frames[0]
            for seq, payload in self._buffer:
                if seq >= start:
                    self._send_replay([client_id, b"", encode_seq(seq), payload])
            self._send_replay([client_id, b"", encode_seq(END_OF_REPLAY_SEQ), b""])

    @staticmethod
    def _parse_replay_request(frames: list[bytes]) -> int | None:
        if len(frames) != 3 or frames[1] != b"":
            return None
        try:
            start = decode_seq(frames[2])
        except ValueError:
            return None
        return start if start >= 0 else None

    def _send_replay(self, frames: list[bytes]) -> None:
        assert self._replay is not None
        self._replay.send_multipart(frames, copy=False)

    def _close_sockets(self, linger_ms: int | None) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger_ms)
        self._pub = self._replay = None


class LoadPublisher:
    """Publishes `LoadReport`s as `[topic, msgpack]` on a PUB socket it binds."""

    def __init__(self, endpoint: str, topic: str = "load") -> None:
        self._topic = topic.encode()
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        try:
            self._pub.bind(endpoint)
        except zmq.ZMQError:
            self._pub.close(linger=0)
            self._context.term()
            raise
        self.bound_endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.num_published = 0
        self.num_dropped = 0
        self._closed = False

    def publish(self, report: LoadReport) -> bool:
        """Sends one report without blocking; False if it was dropped."""
        payload = encode_report(report)
        with self._lock:
            if self._closed:
                self.num_dropped += 1
                return False
            try:
                self._pub.send_multipart([self._topic, payload], flags=zmq.NOBLOCK)
            except zmq.Again:
                self.num_dropped += 1
                return False
            self.num_published += 1
        return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # A report is superseded by the next: nothing here is worth waiting for.
            self._pub.close(linger=0)
            self._context.term()

    def __enter__(self) -> LoadPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
