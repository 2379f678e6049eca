"""worker.scheduler's disaggregation states and worker.remote_prefill: exact blocks, deadlines, releases."""

from __future__ import annotations

import pytest

from worker.block_pool import BlockPool
from worker.remote_prefill import RemotePrefills
from worker.scheduler import RequestState, Scheduler
from worker.sim import OutputScript, SimConfig

BS = 4
TOKEN = 100


def scheduler(num_blocks: int = 16, **config) -> Scheduler:
    return Scheduler(SimConfig(block_size=BS, num_blocks=num_blocks, **config), BlockPool(num_blocks, BS))


def request(request_id: str, prompt: list[int], max_tokens: int = 2, *, remote: bool = True) -> RequestState:
    source = OutputScript([TOKEN], prompt, None, None)
    return RequestState(request_id, list(prompt), len(prompt), max_tokens, source, None, remote_prefill=remote)


def plan(step) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in step.scheduled]


def test_remote_request_waits_with_its_full_blocks_but_the_last_token_listed():
    sched = scheduler()
    sched.add(request("a", list(range(13))))  # 3 full blocks + 1 token; blocks 0..2 hold tokens 0..11
    step = sched.schedule()
    assert plan(step) == []
    assert list(sched.remote_prefilling) == ["a"] and sched.running == []
    [task] = sched.take_remote_tasks()
    assert (task.request.request_id, task.num_cached_tokens, task.block_ids) == ("a", 0, [0, 1, 2])
    assert sched.take_remote_tasks() == []
    assert sched.waits_on_transfers() and sched.num_active() == 1


def test_exact_multiple_of_the_block_size_leaves_its_last_block_to_compute():
    sched = scheduler()
    sched.add(request("a", list(range(12))))
    sched.schedule()
    [task] = sched.take_remote_tasks()
    assert task.block_ids == [0, 1]  # the last block holds the token whose logits are needed


def test_prompt_without_a_full_block_before_its_last_token_runs_locally():
    sched = scheduler()
    sched.add(request("a", list(range(4))))  # its one block holds the last token
    assert plan(sched.schedule()) == [("a", 4)]
    assert sched.take_remote_tasks() == [] and not sched.remote_prefilling
    sched.add(request("b", list(range(5))))  # block 0 is full before the last token
    sched.schedule()
    assert [t.block_ids for t in sched.take_remote_tasks()] == [[1]]  # "a" holds block 0


def test_completed_remote_prefill_commits_blocks_and_computes_only_the_tail():
    sched = scheduler()
    sched.add(request("a", list(range(13))))
    sched.schedule()
    sched.take_remote_tasks()
    assert sched.complete_remote("a", 12)
    assert sched.pool.num_computed_tokens("a") == 12
    assert len(sched.pool.cached_block_hashes()) == 3  # the filled blocks are cached like computed ones
    step = sched.schedule()
    assert plan(step) == [("a", 1)] and step.num_prefill_tokens == 1
    [result] = sched.finish_step(step)
    assert result.token_id == TOKEN
    assert not sched.complete_remote("a", 12)  # not remote-prefilling any more


def test_prefix_hit_is_not_asked_for_again():
    sched = scheduler()
    sched.add(request("warm", list(range(9)), max_tokens=1, remote=False))
    sched.finish_step(sched.schedule())  # caches blocks 0 and 1 (tokens 0..7)
    sched.add(request("a", list(range(17))))
    sched.schedule()
    [task] = sched.take_remote_tasks()
    assert task.num_cached_tokens == 8 and len(task.block_ids) == 2  # tokens 8..15


def test_fallback_computes_the_uncached_prompt_locally():
    sched = scheduler()
    sched.add(request("a", list(range(13))))
    sched.schedule()
    assert sched.fallback_remote("a")
    assert plan(sched.schedule()) == [("a", 13)]


def test_remote_prefilling_request_is_never_preempted_and_counts_against_max_num_seqs():
    sched = scheduler(max_num_seqs=1)
    sched.add(request("a", list(range(13))))
    sched.add(request("b", list(range(3)), remote=False))
    assert plan(sched.schedule()) == []  # "a" holds the only slot while it waits
    sched.fallback_remote("a")
    assert plan(sched.schedule()) == [("a", 13)]


def test_abort_while_remote_prefilling_holds_the_blocks_until_released():
    sched = scheduler()
    sched.add(request("a", list(range(13))))
    sched.schedule()
    used = sched.pool.num_used_blocks
    assert sched.abort("a")
    assert "a" in sched.held and sched.pool.num_used_blocks == used
    assert sched.release("a") and sched.pool.num_used_blocks == 0
    assert not sched.release("a")


def test_hold_blocks_keeps_a_finished_request_blocks_until_release():
    sched = scheduler()
    state = request("p", list(range(9)), max_tokens=1, remote=False)
    state.hold_blocks = True
    sched.add(state)
    [result] = sched.finish_step(sched.schedule())
    assert result.finish_reason == "length"
    assert sched.pool.block_ids("p") == [0, 1, 2] and "p" in sched.held
    assert sched.release("p")
    assert not sched.pool.has_request("p")


def tracked(timeout_s: float = 5.0) -> tuple[Scheduler, RemotePrefills]:
    sched = scheduler()
    remote = RemotePrefills(sched, timeout_s, grace_s=1.0)
    sched.add(request("a", list(range(13))))
    sched.schedule()
    return sched, remote


def test_tracker_hands_out_requests_with_the_prompt_and_counts_completion():
    sched, remote = tracked()
    [req] = remote.take_requests(now=100.0)
    assert (req.request_id, req.token_ids, req.num_cached_tokens, req.block_ids) == ("a", list(range(13)), 0, [0, 1, 2])
    assert remote.next_due() == 106.0  # the job's deadline plus the grace
    assert remote.on_ready("a") and not remote.on_ready("a")
    assert remote.counters.num_completed == 1 and remote.counters.num_remote_tokens == 12
    assert sched.running[0].request_id == "a" and remote.next_due() is None


def test_tracker_falls_back_at_the_deadline_and_ignores_a_late_notification():
    sched, remote = tracked()
    remote.take_requests(now=100.0)
    assert remote.expire(now=105.9) == []  # the prefill worker may still write until 105 + grace
    assert remote.expire(now=106.0) == ["a"]
    assert remote.counters.num_fallback_deadline == 1
    assert not remote.on_ready("a")
    assert plan(sched.schedule()) == [("a", 13)]


def test_tracker_unqueued_job_falls_back_at_once():
    sched, remote = tracked()
    remote.take_requests(now=0.0)
    assert remote.on_failed("a") and not remote.on_failed("a")
    assert remote.counters.num_fallback_unqueued == 1 and sched.running[0].request_id == "a"


def test_tracker_frees_an_aborted_request_blocks_after_deadline_plus_grace():
    sched, remote = tracked()
    remote.take_requests(now=10.0)
    sched.abort("a")
    remote.on_abort("a")
    assert remote.next_due() == 16.0
    remote.expire(now=15.9)
    assert sched.pool.num_used_blocks == 4
    remote.expire(now=16.0)
    assert sched.pool.num_used_blocks == 0 and not sched.held
    assert remote.counters.num_aborted == 1


def test_tracker_rejects_a_nonpositive_timeout():
    with pytest.raises(ValueError, match="timeout"):
        RemotePrefills(scheduler(), 0.0)


def test_tracker_applies_queued_events_by_name():
    sched, remote = tracked()
    remote.take_requests(now=0.0)
    remote.apply("ready", "a")
    assert remote.counters.num_completed == 1
    with pytest.raises(ValueError, match="unknown remote prefill event 'late'"):
        remote.apply("late", "a")
