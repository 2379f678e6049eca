"""The circuit breaker's state machine, on a hand-driven clock."""

import pytest

from router.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _breaker(threshold: int = 3, open_s: float = 5.0) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker(BreakerConfig(failure_threshold=threshold, open_s=open_s), clock=clock), clock


def test_opens_after_consecutive_failures_only():
    breaker, _ = _breaker(threshold=3)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # a success in between resets the count
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == CLOSED and breaker.allows()
    assert breaker.num_failures == 2
    breaker.record_failure()
    assert breaker.state == OPEN
    assert not breaker.allows()
    assert breaker.num_opened == 1


def test_half_open_allows_one_trial_and_its_success_closes():
    breaker, clock = _breaker(threshold=1, open_s=5.0)
    breaker.record_failure()
    clock.now += 4.99
    assert breaker.state == OPEN and not breaker.allows()
    clock.now += 0.01
    assert breaker.state == HALF_OPEN and breaker.allows()
    breaker.on_dispatch()
    assert not breaker.allows()  # the trial is in flight: nobody else goes
    breaker.record_success()
    assert breaker.state == CLOSED and breaker.allows()
    assert breaker.num_failures == 0


def test_failed_trial_reopens_for_another_period():
    breaker, clock = _breaker(threshold=2, open_s=5.0)
    breaker.record_failure()
    breaker.record_failure()
    clock.now += 5.0
    breaker.on_dispatch()
    breaker.record_failure()
    assert breaker.state == OPEN and breaker.num_opened == 2
    clock.now += 4.0
    assert not breaker.allows()
    clock.now += 1.0
    assert breaker.allows()


def test_a_trial_that_never_reports_stops_blocking_after_open_s():
    breaker, clock = _breaker(threshold=1, open_s=2.0)
    breaker.record_failure()
    clock.now += 2.0
    breaker.on_dispatch()
    clock.now += 1.9
    assert not breaker.allows()
    clock.now += 0.1
    assert breaker.allows()


def test_late_failures_of_requests_sent_before_opening_change_nothing():
    breaker, clock = _breaker(threshold=1, open_s=5.0)
    breaker.record_failure()
    opened = breaker.num_opened
    clock.now += 3.0
    breaker.record_failure()  # a straggler: does not push the reopening further
    clock.now += 2.0
    assert breaker.state == HALF_OPEN
    assert breaker.num_opened == opened


def test_dispatch_while_closed_is_free_and_reset_closes():
    breaker, _ = _breaker(threshold=1)
    breaker.on_dispatch()
    assert breaker.state == CLOSED
    breaker.record_failure()
    breaker.reset()
    assert breaker.state == CLOSED and breaker.allows()
    assert breaker.describe() == {"state": CLOSED, "num_failures": 0, "num_opened": 1}


@pytest.mark.parametrize(("threshold", "open_s"), [(0, 1.0), (1, 0.0), (1, -1.0)])
def test_config_is_validated(threshold, open_s):
    with pytest.raises(ValueError):
        BreakerConfig(failure_threshold=threshold, open_s=open_s)
