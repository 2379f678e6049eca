"""`kvstore.reconnect.Reconnector`: down/up state, the backoff schedule, one probe at a time."""

from __future__ import annotations

import asyncio
import time

from kvstore.reconnect import Reconnector


class Probe:
    """Fails `num_failures` times, then answers; records when it was called."""

    def __init__(self, num_failures: int) -> None:
        self.num_failures = num_failures
        self.called_at: list[float] = []

    async def __call__(self) -> None:
        self.called_at.append(time.monotonic())
        if len(self.called_at) <= self.num_failures:
            raise ConnectionRefusedError(f"refused #{len(self.called_at)}")


def make(probe, **overrides) -> Reconnector:
    knobs = {"probe_timeout_s": 0.2, "backoff_initial_s": 0.02, "backoff_max_s": 0.08, **overrides}
    return Reconnector("test backend", probe, **knobs)


async def test_probes_with_doubling_backoff_until_up() -> None:
    probe = Probe(num_failures=4)
    ups: list[bool] = []
    link = make(probe, on_up=lambda: ups.append(True))
    link.mark_down("first failure")
    down_at = time.monotonic()
    assert (link.is_up, link.reason) == (False, "first failure")
    while not link.is_up:
        assert time.monotonic() - down_at < 2.0
        await asyncio.sleep(0.005)
    assert (link.reason, ups, len(probe.called_at)) == ("", [True], 5)
    gaps = [b - a for a, b in zip([down_at, *probe.called_at], probe.called_at)]
    for gap, expected in zip(gaps, [0.02, 0.04, 0.08, 0.08, 0.08]):
        assert expected - 0.005 <= gap < expected + 0.1
    await link.close()


async def test_reason_is_the_last_probe_failure_and_one_probe_runs_at_a_time() -> None:
    probe = Probe(num_failures=1000)
    link = make(probe, backoff_initial_s=0.01, backoff_max_s=0.01)
    link.mark_down("a")
    link.mark_down("b")
    await asyncio.sleep(0.1)
    num_calls = len(probe.called_at)
    assert 3 <= num_calls <= 11  # one loop at 10 ms, not two
    assert link.reason.startswith("refused #")
    await link.close()
    await asyncio.sleep(0.03)
    assert len(probe.called_at) <= num_calls + 1
    assert (link.is_up, link.is_closed) == (False, True)


async def test_check_marks_down_on_timeout_and_stays_up_on_success() -> None:
    async def hangs() -> None:
        await asyncio.Event().wait()

    slow = make(hangs, probe_timeout_s=0.05, backoff_initial_s=10.0, backoff_max_s=10.0)
    assert await slow.check() is False
    assert (slow.is_up, slow.reason) == (False, "no answer within 0.05 s")
    await slow.close()
    fine = make(Probe(num_failures=0))
    assert await fine.check() is True and fine.is_up
    await fine.close()
