"""`worker.engine_io`: publisher lifecycle, the load-report throttle and the token-rate window,
on real ZMQ sockets (127.0.0.1, ephemeral ports) and a hand-driven clock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from indexer.events import AllBlocksCleared
from indexer.load import LoadReport
from worker.engine_io import EnginePublishers, TokenRate, load_key

_ANY_PORT = "tcp://127.0.0.1:*"
# Binary fractions, so the clock arithmetic below is exact.
_MIN_INTERVAL_S = 0.25
_INTERVAL_S = 1.0


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def report(num_running: int = 0, *, timestamp: float = 0.0) -> LoadReport:
    return LoadReport(
        worker_id="w",
        dp_rank=0,
        timestamp=timestamp,
        num_running=num_running,
        num_waiting=0,
        num_kv_blocks_used=0,
        num_kv_blocks_total=8,
        num_prefill_tokens=0,
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def open_publishers(clock: FakeClock, load_interval_s: float | None) -> EnginePublishers:
    publishers = EnginePublishers(
        load_endpoint=_ANY_PORT, min_load_interval_s=_MIN_INTERVAL_S, load_interval_s=load_interval_s, clock=clock
    )
    publishers.open()
    return publishers


@pytest.fixture
def forced(clock: FakeClock) -> Iterator[EnginePublishers]:
    """The sim's throttle: no interval of its own, a timer forces periodic reports."""
    publishers = open_publishers(clock, None)
    yield publishers
    publishers.close()


@pytest.fixture
def periodic(clock: FakeClock) -> Iterator[EnginePublishers]:
    """The torch engine's throttle: unchanged load is re-reported every interval."""
    publishers = open_publishers(clock, _INTERVAL_S)
    yield publishers
    publishers.close()


# -- lifecycle ---------------------------------------------------------------------


def test_open_binds_the_configured_publishers_and_close_is_idempotent():
    publishers = EnginePublishers(_ANY_PORT, _ANY_PORT, _ANY_PORT, min_load_interval_s=0.02)
    publishers.close()  # before open: nothing to close
    publishers.open()
    assert publishers.kv_publisher is not None and publishers.load_publisher is not None
    assert publishers.kv_publisher.bound_endpoint.startswith("tcp://127.0.0.1:")
    assert publishers.kv_publisher.bound_replay_endpoint.startswith("tcp://127.0.0.1:")
    assert publishers.load_publisher.bound_endpoint.startswith("tcp://127.0.0.1:")
    publishers.close()
    publishers.close()


def test_without_endpoints_nothing_is_opened_or_published():
    publishers = EnginePublishers(min_load_interval_s=0.02)
    publishers.open()
    assert (publishers.kv_publisher, publishers.load_publisher) == (None, None)
    publishers.publish_events([AllBlocksCleared()])

    def never() -> LoadReport:
        pytest.fail("no report is built without a load publisher")

    assert publishers.may_report(never, force=True) is False
    publishers.close()


def test_a_failed_bind_closes_the_publishers_already_bound():
    publishers = EnginePublishers(_ANY_PORT, None, "tcp://127.0.0.1:notaport", min_load_interval_s=0.02)
    with pytest.raises(zmq.ZMQError):
        publishers.open()
    assert publishers.load_publisher is None
    assert publishers.kv_publisher is not None
    assert publishers.kv_publisher.publish([AllBlocksCleared()]) is False  # closed: dropped


def test_publish_events_sends_a_batch_per_non_empty_step():
    publishers = EnginePublishers(_ANY_PORT, min_load_interval_s=0.02)
    publishers.open()
    kv_publisher = publishers.kv_publisher
    assert kv_publisher is not None
    publishers.publish_events([])
    publishers.publish_events([AllBlocksCleared()])
    publishers.publish_events([AllBlocksCleared(), AllBlocksCleared()])
    publishers.close()  # drains the queue
    assert (kv_publisher.num_published, kv_publisher.num_dropped) == (2, 0)


# -- the load-report throttle --------------------------------------------------------


def test_load_key_ignores_the_timestamp_and_the_totals():
    assert load_key(report(3, timestamp=1.0)) == load_key(report(3, timestamp=2.0)) == (3, 0, 0, 0)


def test_changed_load_is_reported_at_most_every_min_interval(forced: EnginePublishers, clock: FakeClock):
    assert forced.may_report(lambda: report(1)) is True  # the first report differs from "none yet"
    clock.now += 0.125
    assert forced.may_report(lambda: report(2)) is False  # changed, but too soon
    clock.now += 0.125
    assert forced.may_report(lambda: report(2)) is True
    clock.now += 5.0
    assert forced.may_report(lambda: report(2)) is False  # unchanged: only a forced report goes out
    assert forced.may_report(lambda: report(2), force=True) is True
    assert forced.may_report(lambda: report(3), force=True) is True  # force ignores the min interval
    assert forced.load_publisher is not None and forced.load_publisher.num_published == 4


def test_unchanged_load_is_reported_every_load_interval(periodic: EnginePublishers, clock: FakeClock):
    assert periodic.may_report(lambda: report(1)) is True
    clock.now += 0.875
    assert periodic.may_report(lambda: report(1)) is False
    clock.now += 0.125
    assert periodic.may_report(lambda: report(1)) is True
    clock.now += 0.25
    assert periodic.may_report(lambda: report(4)) is True  # changed after the min interval
    clock.now += 0.125
    assert periodic.may_report(lambda: report(5)) is False
    clock.now += 0.75
    assert periodic.may_report(lambda: report(4)) is False  # back to the last sent load, not due yet
    clock.now += 0.125
    assert periodic.may_report(lambda: report(4)) is True
    assert periodic.load_publisher is not None and periodic.load_publisher.num_published == 4


def test_the_report_sent_is_the_one_built(forced: EnginePublishers, clock: FakeClock):
    built: list[LoadReport] = []

    def make_report() -> LoadReport:
        built.append(report(len(built) + 1))
        return built[-1]

    assert forced.may_report(make_report) is True
    clock.now += 0.125
    assert forced.may_report(make_report) is False  # built (to compare its load), not sent
    clock.now += 0.125
    assert forced.may_report(make_report) is True
    assert [r.num_running for r in built] == [1, 2, 3]
    assert forced.load_publisher is not None and forced.load_publisher.num_published == 2


# -- the token-rate window -----------------------------------------------------------


def test_token_rate_averages_over_the_whole_window(clock: FakeClock):
    rate = TokenRate(5.0, clock=clock)
    assert rate.per_second() == 0.0
    rate.add(10)
    clock.now += 1.0
    rate.add(0)
    rate.add(15)
    assert rate.per_second() == 5.0  # 25 tokens / 5 s, though only 1 s has passed


def test_token_rate_forgets_steps_older_than_the_window(clock: FakeClock):
    rate = TokenRate(5.0, clock=clock)
    rate.add(10)  # at 100
    clock.now += 2.0
    rate.add(20)  # at 102
    clock.now += 3.0
    assert rate.per_second() == 6.0  # at 105 the window [100, 105] still holds both
    clock.now += 0.5
    assert rate.per_second() == 4.0  # the step at 100 has left the window
    clock.now += 2.0
    assert rate.per_second() == 0.0
    rate.add(5)  # adding also drops the expired steps
    assert rate.per_second() == 1.0
