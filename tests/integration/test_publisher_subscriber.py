"""KVEventPublisher -> EventSubscriber over real ZMQ sockets in one process.

The subscriber's contract is the sequence of `apply` / `clear` calls it makes on the
index, so `Recorder` records them (and forwards them to a real `PrefixIndex`, whose
final state is checked too). Each published batch stores one block tagged with its
expected seq (plus a per-publisher base), so the recorded calls show exactly which
batches were applied, in which order, and where the index was cleared.
"""

import asyncio
import dataclasses
import threading
import time

import pytest
import zmq

from indexer.events import BatchDecoder, BlockStored, decode_seq, encode_batch, encode_seq, make_batch
from indexer.hashing import hash_prompt
from indexer.index import PrefixIndex
from indexer.subscriber import EventSubscriber
from worker.kv_publisher import KVEventPublisher

BLOCK_SIZE = 4
WORKER = ("w0", 0)
LOCAL = "tcp://127.0.0.1:0"


def tokens(tag: int) -> list[int]:
    return [tag, tag + 1, tag + 2, tag + 3]


def stored(tag: int) -> BlockStored:
    return BlockStored(block_hashes=[tag], parent_block_hash=None, token_ids=tokens(tag), block_size=BLOCK_SIZE)


def own_hashes(tags) -> set[int]:
    return {hash_prompt(tokens(tag), BLOCK_SIZE)[0] for tag in tags}


class Recorder:
    """The index as the subscriber sees it: records calls, then forwards them."""

    def __init__(self) -> None:
        self.index = PrefixIndex(BLOCK_SIZE)
        self.calls: list[tuple] = []

    def apply(self, worker, batch) -> None:
        self.calls.append(("apply", worker, batch.events[0].block_hashes[0]))
        self.index.apply(worker, batch)

    def clear(self, worker) -> None:
        self.calls.append(("clear", worker))
        self.index.clear(worker)


class Feed:
    """Publishes one tagged batch per call; tag = base + the seq the publisher gives it."""

    def __init__(self, pub: KVEventPublisher, base: int = 0) -> None:
        self.pub = pub
        self.base = base
        self.num_sent = 0

    def send(self, count: int = 1) -> list[bool]:
        results = []
        for _ in range(count):
            results.append(self.pub.publish([stored(self.base + self.num_sent)]))
            self.num_sent += 1
        return results

    def tags(self, seqs) -> list[int]:
        return [self.base + seq for seq in seqs]


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.002)


async def join(sub: EventSubscriber, feed: Feed) -> None:
    """Publishes until the SUB has joined (ZMQ's slow joiner), then until it caught up."""
    num_seen = sub.stats.num_messages
    deadline = time.monotonic() + 5.0
    while sub.stats.num_messages == num_seen:
        assert time.monotonic() < deadline, "subscriber never joined"
        feed.send()
        await asyncio.sleep(0.005)
    await wait_until(lambda: sub.stats.last_seq == feed.num_sent - 1)


def delta(sub: EventSubscriber, before) -> dict[str, int]:
    after = dataclasses.asdict(sub.stats)
    return {k: after[k] - v for k, v in dataclasses.asdict(before).items() if k.startswith("num_")}


class Bench:
    """A publisher subclass, a subscriber on it and a recorder; stats baselined after join."""

    def __init__(self, pub: KVEventPublisher, **sub_kwargs) -> None:
        self.pub = pub.start()
        self.feed = Feed(pub)
        self.rec = Recorder()
        replay = sub_kwargs.pop("replay_endpoint", pub.bound_replay_endpoint)
        self.sub = EventSubscriber(self.rec, "w0", pub.bound_endpoint, replay, **sub_kwargs)
        self.sub.start()

    async def joined(self) -> None:
        await join(self.sub, self.feed)
        self.before = dataclasses.replace(self.sub.stats)
        self.num_calls = len(self.rec.calls)

    def new_calls(self) -> list[tuple]:
        return self.rec.calls[self.num_calls :]

    def delta(self) -> dict[str, int]:
        return delta(self.sub, self.before)

    async def close(self) -> None:
        await self.sub.stop()
        self.pub.close()


@pytest.fixture
async def benches():
    made: list[Bench] = []

    def make(pub: KVEventPublisher, **sub_kwargs) -> Bench:
        made.append(Bench(pub, **sub_kwargs))
        return made[-1]

    yield make
    for bench in made:
        await bench.close()


class DroppingPublisher(KVEventPublisher):
    """Loses the live sends of chosen seqs (they still reach the replay buffer)."""

    def __init__(self, *args, drop_seqs=(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drop_seqs = set(drop_seqs)

    def _send_live(self, frames) -> None:
        if decode_seq(frames[1]) not in self.drop_seqs:
            super()._send_live(frames)


def applies(tags, worker=WORKER) -> list[tuple]:
    return [("apply", worker, tag) for tag in tags]


# -- live order and replay ---------------------------------------------------------


async def test_batches_are_applied_in_seq_order_from_the_first(benches):
    bench = benches(KVEventPublisher(LOCAL, LOCAL, data_parallel_rank=2))
    await bench.joined()
    bench.feed.send(300)
    await wait_until(lambda: bench.sub.stats.last_seq == bench.feed.num_sent - 1)
    worker = ("w0", 2)  # the batches' own data_parallel_rank
    assert bench.rec.calls == applies(range(bench.feed.num_sent), worker)
    live = {"num_messages": 300, "num_batches": 300, "num_events": 300}
    assert bench.delta() == dict.fromkeys(bench.delta(), 0) | live  # no gap, replay or resync
    assert bench.rec.index.worker_block_hashes(worker) == own_hashes(range(bench.feed.num_sent))


@pytest.fixture
async def late_subscriber():
    """Subscribes to an already running publisher, as a router does to a busy worker."""
    made: list[tuple[EventSubscriber, KVEventPublisher]] = []

    def subscribe(pub: KVEventPublisher) -> tuple[EventSubscriber, Recorder]:
        rec = Recorder()
        sub = EventSubscriber(rec, "w0", pub.bound_endpoint, pub.bound_replay_endpoint)
        sub.start()
        made.append((sub, pub))
        return sub, rec

    yield subscribe
    for sub, pub in made:
        await sub.stop()
        pub.close()


async def test_an_idle_workers_history_is_replayed_at_connect(late_subscriber):
    pub = KVEventPublisher(LOCAL, LOCAL).start()
    feed = Feed(pub)
    feed.send(20)
    await wait_until(lambda: pub.num_published == 20)
    # The worker then goes quiet: no live message will reveal the gap.
    sub, rec = late_subscriber(pub)
    await wait_until(lambda: sub.stats.last_seq == 19)
    assert rec.calls == applies(range(20))
    assert rec.index.worker_block_hashes(WORKER) == own_hashes(range(20))
    assert (sub.stats.num_replays, sub.stats.num_gaps, sub.stats.num_messages) == (20, 0, 0)
    # Live messages that were also replayed are not applied twice; new ones are.
    await join(sub, feed)
    assert rec.calls == applies(range(feed.num_sent))


async def test_after_connect_only_the_replayed_batches_themselves_are_skipped(late_subscriber):
    pub = KVEventPublisher(LOCAL, LOCAL).start()
    Feed(pub).send(3)
    await wait_until(lambda: pub.num_published == 3)
    sub, rec = late_subscriber(pub)
    await wait_until(lambda: sub.stats.last_seq == 2)
    # The same batch seen live (sent while the buffer was read): applied once only.
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.connect(pub.bound_replay_endpoint)
        dealer.send_multipart([b"", encode_seq(1)])
        _, seq_frame, payload = recv(dealer)
    await sub.handle([b"kv", seq_frame, payload])
    assert rec.calls == applies(range(3)) and sub.stats.num_restarts == 0
    # A restarted publisher behind a relay (no reconnect): its seq 0 is new history.
    restarted = encode_batch(make_batch([stored(100)]))
    await sub.handle([b"kv", encode_seq(0), restarted])
    assert rec.calls == applies(range(3)) + [("clear", WORKER)] + applies([100])
    assert sub.stats.num_restarts == 1
    assert rec.index.worker_block_hashes(WORKER) == own_hashes([100])


async def test_history_partly_out_of_the_buffer_at_connect_is_applied_from_its_start(late_subscriber):
    pub = KVEventPublisher(LOCAL, LOCAL, buffer_size=5).start()
    feed = Feed(pub)
    feed.send(12)
    await wait_until(lambda: pub.num_published == 12)
    sub, rec = late_subscriber(pub)
    await wait_until(lambda: sub.stats.last_seq == 11)
    assert rec.calls == applies(range(7, 12))
    assert (sub.stats.num_gaps, sub.stats.num_resyncs) == (1, 0)


async def test_a_fixed_dp_rank_overrides_the_batch_rank(benches):
    bench = benches(KVEventPublisher(LOCAL, LOCAL, data_parallel_rank=2), dp_rank=5)
    await bench.joined()
    assert {call[1] for call in bench.rec.calls} == {("w0", 5)}


async def test_replay_heals_gaps_in_the_live_stream(benches):
    pub = DroppingPublisher(LOCAL, LOCAL)
    bench = benches(pub)
    await bench.joined()
    first = bench.feed.num_sent
    pub.drop_seqs = {first + 3, first + 4, first + 10, first + 49}
    bench.feed.send(50)
    await wait_until(lambda: bench.sub.stats.last_seq == first + 48)
    assert bench.rec.calls == applies(range(first + 49))
    changes = bench.delta()
    assert (changes["num_gaps"], changes["num_replays"], changes["num_resyncs"]) == (2, 3, 0)
    # seq first+49 is the last one: nothing reveals its loss until the next batch.
    bench.feed.send()
    await wait_until(lambda: bench.sub.stats.last_seq == bench.feed.num_sent - 1)
    assert bench.rec.calls == applies(range(bench.feed.num_sent))
    assert bench.delta()["num_replays"] == 4


async def test_a_gap_beyond_the_replay_buffer_clears_and_resyncs(benches):
    pub = DroppingPublisher(LOCAL, LOCAL, buffer_size=4)
    bench = benches(pub)
    await bench.joined()
    first = bench.feed.num_sent
    pub.drop_seqs = set(range(first + 2, first + 12))
    bench.feed.send(15)
    await wait_until(lambda: bench.sub.stats.last_seq == first + 14)
    expected = applies([first, first + 1]) + [("clear", WORKER)] + applies(range(first + 12, first + 15))
    assert bench.new_calls() == expected
    changes = bench.delta()
    assert (changes["num_gaps"], changes["num_replays"], changes["num_resyncs"]) == (1, 0, 1)
    assert bench.rec.index.worker_block_hashes(WORKER) == own_hashes(range(first + 12, first + 15))


async def test_without_a_replay_endpoint_a_gap_resyncs(benches):
    pub = DroppingPublisher(LOCAL)
    bench = benches(pub)
    await bench.joined()
    first = bench.feed.num_sent
    pub.drop_seqs = {first + 1}
    bench.feed.send(3)
    await wait_until(lambda: bench.sub.stats.last_seq == first + 2)
    assert bench.new_calls() == applies([first]) + [("clear", WORKER)] + applies([first + 2])
    assert bench.delta()["num_resyncs"] == 1


async def test_a_replay_endpoint_that_never_answers_times_out_and_resyncs(benches, tmp_path):
    pub = DroppingPublisher(LOCAL)
    silent = f"ipc://{tmp_path}/nobody.sock"
    bench = benches(pub, replay_endpoint=silent, replay_timeout_s=0.05)
    await bench.joined()
    first = bench.feed.num_sent
    pub.drop_seqs = {first}
    bench.feed.send(2)
    await wait_until(lambda: bench.sub.stats.last_seq == first + 1)
    assert bench.new_calls() == [("clear", WORKER)] + applies([first + 1])


class CorruptReplayPublisher(KVEventPublisher):
    def _send_replay(self, frames) -> None:
        if frames[3]:
            frames = [*frames[:3], b"\xc1 not msgpack"]
        super()._send_replay(frames)


class DroppingCorruptReplayPublisher(DroppingPublisher, CorruptReplayPublisher):
    pass


async def test_an_undecodable_replayed_batch_resyncs(benches):
    pub = DroppingCorruptReplayPublisher(LOCAL, LOCAL)
    bench = benches(pub)
    await bench.joined()
    first = bench.feed.num_sent
    pub.drop_seqs = {first}
    bench.feed.send(2)
    await wait_until(lambda: bench.sub.stats.last_seq == first + 1)
    assert bench.new_calls() == [("clear", WORKER)] + applies([first + 1])
    assert (bench.delta()["num_malformed"], bench.delta()["num_resyncs"]) == (1, 1)


# -- restarts, garbage, overflow ---------------------------------------------------


async def test_a_publisher_restart_is_detected_and_the_new_history_replayed(benches, tmp_path):
    events, replay = f"ipc://{tmp_path}/events.sock", f"ipc://{tmp_path}/replay.sock"
    bench = benches(KVEventPublisher(events, replay))
    await bench.joined()
    bench.feed.send(200)
    await wait_until(lambda: bench.sub.stats.last_seq == bench.feed.num_sent - 1)
    bench.pub.close()
    bench.pub = KVEventPublisher(events, replay).start()  # the Bench closes this one
    feed = Feed(bench.pub, base=100_000)
    await join(bench.sub, feed)
    # The new publisher's first batches went out before the SUB reconnected: replayed.
    restart = bench.rec.calls.index(("clear", WORKER))
    assert bench.rec.calls[restart + 1 :] == applies(feed.tags(range(feed.num_sent)))
    changes = bench.delta()
    assert (changes["num_restarts"], changes["num_resyncs"]) == (1, 1)
    assert bench.rec.index.worker_block_hashes(WORKER) == own_hashes(feed.tags(range(feed.num_sent)))


class GarbagePublisher(KVEventPublisher):
    """After the live send of `garbage_after`, sends malformed messages on the same socket."""

    garbage_after = -1

    def _send_live(self, frames) -> None:
        super()._send_live(frames)
        if decode_seq(frames[1]) == self.garbage_after:
            topic, seq, payload = frames
            for bad in (
                [topic],
                [topic, b"short", payload],
                [topic, encode_seq(999), b"\xc1 not msgpack"],
                [topic, encode_seq(999), payload, b"extra"],
                [topic, encode_seq(-5), payload],
            ):
                super()._send_live(bad)


async def test_garbage_messages_are_counted_and_skipped(benches):
    pub = GarbagePublisher(LOCAL, LOCAL)
    bench = benches(pub)
    await bench.joined()
    first = bench.feed.num_sent
    pub.garbage_after = first + 1
    bench.feed.send(4)
    await wait_until(lambda: bench.sub.stats.last_seq == first + 3)
    assert bench.new_calls() == applies(range(first, first + 4))
    changes = bench.delta()
    assert changes["num_malformed"] == 5
    assert (changes["num_gaps"], changes["num_resyncs"], changes["num_restarts"]) == (0, 0, 0)


class GatedPublisher(KVEventPublisher):
    """Its thread blocks in the live send while `gate` is clear, like a stuck socket."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()

    def _send_live(self, frames) -> None:
        self.gate.wait(timeout=10)
        super()._send_live(frames)


async def test_queue_overflow_drops_leave_a_seq_hole_that_resyncs(benches):
    pub = GatedPublisher(LOCAL, LOCAL, max_queue=3)
    bench = benches(pub)
    await bench.joined()
    first = bench.feed.num_sent
    pub.gate.clear()
    bench.feed.send()
    await wait_until(lambda: pub.num_queued == 0)  # the thread holds seq `first`
    assert bench.feed.send(5) == [True, True, True, False, False]
    assert pub.num_dropped == 2
    pub.gate.set()
    await wait_until(lambda: pub.num_queued == 0)
    assert bench.feed.send() == [True]
    await wait_until(lambda: bench.sub.stats.last_seq == first + 6)
    # seqs first+4 and first+5 were never sent nor buffered: replay cannot fill them.
    assert bench.new_calls() == applies(range(first, first + 4)) + [("clear", WORKER)] + applies([first + 6])
    assert bench.delta()["num_resyncs"] == 1


async def test_close_sends_everything_queued(benches):
    bench = benches(KVEventPublisher(LOCAL, LOCAL))
    await bench.joined()
    bench.feed.send(500)
    bench.pub.close()
    bench.pub.close()
    assert bench.pub.num_published == bench.feed.num_sent
    await wait_until(lambda: bench.sub.stats.last_seq == bench.feed.num_sent - 1)
    assert bench.rec.calls == applies(range(bench.feed.num_sent))
    assert bench.feed.send() == [False]


# -- the replay socket itself ------------------------------------------------------


@pytest.fixture
def replay_server():
    with KVEventPublisher(LOCAL, LOCAL, buffer_size=3) as pub:
        assert pub.publish([]) is True  # nothing to send: no seq spent
        for tag in range(5):
            pub.publish([stored(tag)])
        deadline = time.monotonic() + 5
        while pub.num_published < 5:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        with zmq.Context() as context:
            yield pub, context


def recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(5000), "no replay answer"
    return sock.recv_multipart()


def tag_of(payload: bytes) -> int:
    return BatchDecoder().decode(payload).events[0].block_hashes[0]


def test_a_req_client_gets_the_first_batch_of_its_answer(replay_server):
    # vLLM's example client is a REQ socket: one reply per request, so it reads the first
    # buffered batch at or after its start seq. (Walking on with start = seq + 1 races
    # with the rest of the previous answer still in flight: DEALER is the right client.)
    pub, context = replay_server
    with context.socket(zmq.REQ) as req:
        req.connect(pub.bound_replay_endpoint)
        req.send(encode_seq(0))
        seq_frame, payload = recv(req)
    assert (decode_seq(seq_frame), tag_of(payload)) == (2, 2)  # the ring holds the last 3


def test_a_dealer_client_gets_the_whole_answer(replay_server):
    pub, context = replay_server
    with context.socket(zmq.DEALER) as dealer:
        dealer.connect(pub.bound_replay_endpoint)
        dealer.send_multipart([b"", encode_seq(3)])
        answer = [recv(dealer) for _ in range(3)]
    assert [(empty, decode_seq(seq)) for empty, seq, _ in answer] == [(b"", 3), (b"", 4), (b"", -1)]
    assert [tag_of(payload) for _, _, payload in answer[:2]] == [3, 4]


def test_malformed_replay_requests_are_counted_and_ignored(replay_server):
    pub, context = replay_server
    with context.socket(zmq.DEALER) as dealer:
        dealer.connect(pub.bound_replay_endpoint)
        for bad in ([b"", b"short"], [b"no delimiter"], [b"", encode_seq(0), b"extra"], [b"", encode_seq(-1)]):
            dealer.send_multipart(bad)
        dealer.send_multipart([b"", encode_seq(10)])
        assert recv(dealer) == [b"", encode_seq(-1), b""]  # the only answer
        assert not dealer.poll(50)
    assert (pub.num_replay_requests, pub.num_replay_malformed) == (5, 4)


def test_ephemeral_tcp_and_ipc_bindings_expose_their_address(tmp_path):
    with KVEventPublisher("tcp://127.0.0.1:*", f"ipc://{tmp_path}/r.sock") as pub:
        assert pub.bound_endpoint.startswith("tcp://127.0.0.1:")
        assert not pub.bound_endpoint.endswith(":0")
        assert pub.bound_replay_endpoint == f"ipc://{tmp_path}/r.sock"


def test_a_bad_endpoint_raises_at_start_and_leaks_nothing():
    pub = KVEventPublisher("nonsense://here")
    with pytest.raises(zmq.ZMQError):
        pub.start()
    pub.close()
