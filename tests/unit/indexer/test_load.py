import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from indexer.load import LoadAggregator, LoadReport, LoadSubscriber, MalformedReport, decode_report, encode_report
from worker.kv_publisher import LoadPublisher


def report(worker_id="w0", dp_rank=0, timestamp=100.0, **counts) -> LoadReport:
    fields = dict(num_running=2, num_waiting=1, num_kv_blocks_used=30, num_kv_blocks_total=120, num_prefill_tokens=512)
    fields.update(counts)
    return LoadReport(worker_id=worker_id, dp_rank=dp_rank, timestamp=timestamp, **fields)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def wait_until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


# -- the wire type -----------------------------------------------------------------


def test_report_round_trip_and_kv_usage():
    original = report()
    assert decode_report(encode_report(original)) == original
    assert original.kv_usage == 0.25
    assert original.worker == ("w0", 0)


def test_kv_usage_of_a_worker_without_blocks_is_zero():
    assert report(num_kv_blocks_used=0, num_kv_blocks_total=0).kv_usage == 0.0


def test_report_is_a_map_and_ignores_unknown_trailing_fields():
    wire = msgspec.msgpack.decode(encode_report(report()))
    assert list(wire) == [
        "worker_id", "dp_rank", "timestamp", "num_running", "num_waiting",
        "num_kv_blocks_used", "num_kv_blocks_total", "num_prefill_tokens",
    ]
    wire["num_swapped"] = 7
    assert decode_report(msgspec.msgpack.encode(wire)) == report()


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"worker_id": "w0"}),  # fields missing
        msgspec.msgpack.encode({**msgspec.to_builtins(report()), "num_running": -1}),
        msgspec.msgpack.encode({**msgspec.to_builtins(report()), "worker_id": ""}),
        msgspec.msgpack.encode({**msgspec.to_builtins(report()), "timestamp": "now"}),
    ],
)
def test_decode_rejects_malformed_payloads(payload):
    with pytest.raises(MalformedReport):
        decode_report(payload)


# -- the aggregator ----------------------------------------------------------------


def test_aggregator_keeps_the_latest_report_per_worker_and_rank():
    agg = LoadAggregator(clock=FakeClock())
    assert agg.update(report(timestamp=1.0, num_running=1))
    assert agg.update(report(timestamp=2.0, num_running=5))
    assert agg.update(report(dp_rank=1, timestamp=1.0, num_running=9))
    assert agg.get(("w0", 0)).num_running == 5
    assert agg.get(("w0", 1)).num_running == 9
    assert agg.get(("w1", 0)) is None
    assert set(agg.reports()) == {("w0", 0), ("w0", 1)}


def test_aggregator_ignores_reports_older_than_the_one_held():
    agg = LoadAggregator(clock=FakeClock())
    agg.update(report(timestamp=5.0, num_running=5))
    assert not agg.update(report(timestamp=4.0, num_running=4))
    assert agg.get(("w0", 0)).num_running == 5
    assert agg.num_out_of_order == 1
    assert agg.update(report(timestamp=5.0, num_running=6))  # same instant: the later wins
    assert agg.get(("w0", 0)).num_running == 6


def test_aggregator_hides_stale_reports_by_arrival_time():
    clock = FakeClock()
    agg = LoadAggregator(max_age_s=2.0, clock=clock)
    agg.update(report(worker_id="a", timestamp=0.0))  # an old worker clock does not matter
    clock.now += 1.0
    agg.update(report(worker_id="b"))
    clock.now += 1.0
    assert agg.get(("a", 0)) is not None  # exactly max_age_s old: still fresh
    clock.now += 0.5
    assert agg.get(("a", 0)) is None
    assert set(agg.reports()) == {("b", 0)}
    agg.update(report(worker_id="a", timestamp=1.0))
    assert agg.get(("a", 0)).timestamp == 1.0


def test_aggregator_remove():
    agg = LoadAggregator(clock=FakeClock())
    agg.update(report())
    agg.remove(("w0", 0))
    agg.remove(("w0", 0))
    assert agg.get(("w0", 0)) is None
    assert agg.reports() == {}


def test_aggregator_rejects_a_non_positive_max_age():
    with pytest.raises(ValueError):
        LoadAggregator(max_age_s=0)


# -- the subscriber, over real sockets ---------------------------------------------


async def test_subscriber_feeds_reports_from_the_load_publisher():
    agg = LoadAggregator()
    with LoadPublisher("tcp://127.0.0.1:*") as pub:
        sub = LoadSubscriber(agg, pub.bound_endpoint)
        sub.start()
        try:
            # A SUB misses what is sent before it joins: repeat until one lands.
            ts = 0.0
            while agg.get(("w0", 0)) is None:
                ts += 1.0
                assert pub.publish(report(timestamp=ts))
                await asyncio.sleep(0.01)
                assert ts < 500, "subscriber never joined"
            assert pub.publish(report(dp_rank=3, timestamp=ts, num_waiting=4))
            await wait_until(lambda: agg.get(("w0", 3)) is not None)
            assert agg.get(("w0", 3)).num_waiting == 4
            assert sub.num_malformed == 0
        finally:
            await sub.stop()
    assert sub.num_reports >= 2
    assert not pub.publish(report())  # closed
    assert pub.num_dropped == 1


async def test_subscriber_counts_and_skips_malformed_messages():
    agg = LoadAggregator()
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = LoadSubscriber(agg, f"tcp://127.0.0.1:{port}", topic="load", context=context)
    sub.start()
    try:
        ts = 0.0
        while agg.get(("w0", 0)) is None:
            ts += 1.0
            await pub.send_multipart([b"load", encode_report(report(timestamp=ts))])
            await asyncio.sleep(0.01)
        await pub.send_multipart([b"load"])
        await pub.send_multipart([b"load", b"garbage"])
        await pub.send_multipart([b"load", encode_report(report()), b"extra"])
        await pub.send_multipart([b"other", b"garbage"])  # another topic: never delivered
        await pub.send_multipart([b"load", encode_report(report(timestamp=ts + 1, num_running=7))])
        await wait_until(lambda: agg.get(("w0", 0)).num_running == 7)
        assert sub.num_malformed == 3
    finally:
        await sub.stop()
        pub.close(linger=0)
        context.term()


async def test_stop_closes_an_owned_context_and_is_idempotent():
    sub = LoadSubscriber(LoadAggregator(), "ipc:///tmp/kvgate-test-load-nobody-binds")
    task = sub.start()
    await asyncio.sleep(0.01)
    await sub.stop()
    await sub.stop()
    assert task.cancelled()
