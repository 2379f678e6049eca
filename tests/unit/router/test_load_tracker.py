import pytest

from indexer.load import LoadReport
from router.load_tracker import LoadTracker, PredictedLoad
from router.policy import Candidate

A = ("a", 0)
B = ("b", 0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(worker=A, timestamp=1.0, running=0, waiting=0, used=0, prefill=0) -> LoadReport:
    return LoadReport(
        worker_id=worker[0], dp_rank=worker[1], timestamp=timestamp, num_running=running, num_waiting=waiting,
        num_kv_blocks_used=used, num_kv_blocks_total=100, num_prefill_tokens=prefill,
    )


def test_own_requests_count_prefill_until_first_token_and_blocks_until_finish():
    tracker = LoadTracker()
    tracker.on_dispatch("r1", A, num_prefill_tokens=300, num_blocks=5)
    tracker.on_dispatch("r2", A, num_prefill_tokens=100, num_blocks=2)
    tracker.on_dispatch("r3", B, num_prefill_tokens=50, num_blocks=1)
    assert tracker.load(A) == PredictedLoad(2, 400, 7)
    tracker.on_first_token("r1")
    tracker.on_first_token("r1")  # idempotent
    assert tracker.load(A) == PredictedLoad(2, 100, 7)
    tracker.on_finish("r1")
    tracker.on_finish("r1")  # idempotent
    tracker.on_finish("unknown")
    assert tracker.load(A) == PredictedLoad(1, 100, 2)
    tracker.on_finish("r2")  # finished before its first token: its prefill goes too
    assert tracker.load(A) == PredictedLoad(0, 0, 0)
    assert tracker.load(B) == PredictedLoad(1, 50, 1)
    assert tracker.load(("never", 0)) == PredictedLoad(0, 0, 0)
    assert tracker.num_in_flight == 1


def test_a_retry_moves_the_request_to_its_new_worker():
    tracker = LoadTracker()
    tracker.on_dispatch("r1", A, 300, 5)
    tracker.on_dispatch("r1", B, 200, 4)
    assert tracker.load(A) == PredictedLoad(0, 0, 0)
    assert tracker.load(B) == PredictedLoad(1, 200, 4)
    with pytest.raises(ValueError):
        tracker.on_dispatch("r2", A, -1, 0)


def test_a_report_is_the_base_and_later_dispatches_add_to_it():
    tracker = LoadTracker(clock=FakeClock())
    tracker.on_dispatch("r1", A, 300, 5)
    # The worker reports r1 plus 3 requests from elsewhere.
    assert tracker.apply_report(report(running=2, waiting=2, used=40, prefill=900))
    assert tracker.load(A) == PredictedLoad(4, 900, 40)
    tracker.on_dispatch("r2", A, 100, 3)
    assert tracker.load(A) == PredictedLoad(5, 1000, 43)
    tracker.on_first_token("r1")  # r1 is in the report: its prefill leaves the report's count
    assert tracker.load(A) == PredictedLoad(5, 700, 43)
    tracker.on_finish("r1")
    assert tracker.load(A) == PredictedLoad(4, 700, 38)


def test_a_request_already_in_a_report_is_never_counted_twice():
    tracker = LoadTracker(clock=FakeClock())
    tracker.on_dispatch("r1", A, 300, 5)
    tracker.on_dispatch("r2", A, 200, 5)
    tracker.apply_report(report(running=2, used=10, prefill=500))  # exactly our two
    assert tracker.load(A) == PredictedLoad(2, 500, 10)
    tracker.apply_report(report(timestamp=2.0, running=2, used=10, prefill=500))
    assert tracker.load(A) == PredictedLoad(2, 500, 10)


def test_own_counts_are_a_floor_under_a_report_that_missed_requests_in_flight():
    tracker = LoadTracker(clock=FakeClock())
    tracker.on_dispatch("r1", A, 300, 5)
    tracker.apply_report(report(running=0, used=0, prefill=0))  # taken before r1 arrived
    assert tracker.load(A) == PredictedLoad(1, 300, 5)
    tracker.on_first_token("r1")  # report + delta would go negative: own wins
    assert tracker.load(A) == PredictedLoad(1, 0, 5)


def test_older_reports_are_ignored_and_stale_reports_dropped():
    clock = FakeClock()
    tracker = LoadTracker(max_report_age_s=2.0, clock=clock)
    assert tracker.apply_report(report(timestamp=5.0, running=7))
    assert not tracker.apply_report(report(timestamp=4.0, running=1))
    assert tracker.load(A).num_requests == 7
    clock.now += 2.5
    assert tracker.load(A) == PredictedLoad(0, 0, 0)
    with pytest.raises(ValueError):
        LoadTracker(max_report_age_s=0)


def test_fill_sets_candidate_predictions():
    tracker = LoadTracker()
    tracker.on_dispatch("r1", A, 300, 5)
    cands = [Candidate("a", 0, "", "both", "m", 16), Candidate("b", 0, "", "both", "m", 16)]
    tracker.fill(cands)
    assert [(c.predicted_requests, c.predicted_prefill_tokens, c.predicted_blocks) for c in cands] == [
        (1, 300, 5),
        (0, 0, 0),
    ]


def test_remove_worker_forgets_every_rank_and_its_requests():
    tracker = LoadTracker(clock=FakeClock())
    tracker.on_dispatch("r1", A, 300, 5)
    tracker.on_dispatch("r2", ("a", 1), 300, 5)
    tracker.on_dispatch("r3", B, 300, 5)
    tracker.apply_report(report(running=3))
    tracker.remove_worker("a")
    assert tracker.workers() == [B]
    assert tracker.load(A) == PredictedLoad(0, 0, 0)
    assert tracker.num_in_flight == 1
    tracker.on_finish("r1")  # a late finish for a forgotten worker is harmless
    assert tracker.workers() == [B]
