"""worker.scheduler: exact steps of continuous batching, chunked prefill, prefix hits, preemption.

The sim's `SimConfig` supplies the batch limits and its `OutputScript` (a one-token
passage) the output tokens: the real parts an engine plugs in.
"""

from __future__ import annotations

from indexer.tokenizer import ByteTokenizer
from worker.block_pool import BlockPool
from worker.scheduler import RequestState, Scheduler
from worker.sim import OutputScript, SimConfig

BS = 4
EOS = ByteTokenizer.EOS_ID
TOKEN = 100  # the one token of a one-token passage: outputs are TOKEN (then EOS, when given)


def scheduler(num_blocks: int = 64, **config) -> Scheduler:
    return Scheduler(SimConfig(block_size=BS, num_blocks=num_blocks, **config), BlockPool(num_blocks, BS))


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, eos: int | None = None) -> RequestState:
    token_source = OutputScript([TOKEN], prompt, None, eos)
    return RequestState(request_id, list(prompt), len(prompt), max_tokens, token_source, eos)


def plan(step) -> list[tuple[str, int]]:
    return [(request.request_id, num_tokens) for request, num_tokens in step.scheduled]


def run_step(sched: Scheduler) -> tuple[list[tuple[str, int]], list[tuple[str, int, str | None]]]:
    step = sched.schedule()
    results = sched.finish_step(step)
    return plan(step), [(r.request.request_id, r.token_id, r.finish_reason) for r in results]


def test_continuous_batching_prefills_together_then_decodes_together():
    sched = scheduler()
    for name in "abc":
        sched.add(make_request(name, list(range(8)), max_tokens=2))
    step = sched.schedule()
    assert plan(step) == [("a", 8), ("b", 8), ("c", 8)]
    assert (step.num_prefill_tokens, step.num_decode_seqs) == (24, 0)
    assert [(r.request.request_id, r.token_id, r.finish_reason) for r in sched.finish_step(step)] == [
        ("a", TOKEN, None), ("b", TOKEN, None), ("c", TOKEN, None)
    ]
    step = sched.schedule()
    assert plan(step) == [("a", 1), ("b", 1), ("c", 1)]
    assert (step.num_prefill_tokens, step.num_decode_seqs) == (0, 3)
    assert [r.finish_reason for r in sched.finish_step(step)] == ["length"] * 3
    assert not sched.has_work() and sched.pool.num_used_blocks == 0
    assert sched.num_generation_tokens == 6


def test_max_num_seqs_caps_the_batch_and_a_finished_slot_is_refilled():
    sched = scheduler(max_num_seqs=2)
    sched.add(make_request("a", [1, 2], max_tokens=1))
    sched.add(make_request("b", [1, 3], max_tokens=3))
    sched.add(make_request("c", [1, 4], max_tokens=1))
    assert run_step(sched) == ([("a", 2), ("b", 2)], [("a", TOKEN, "length"), ("b", TOKEN, None)])
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert run_step(sched)[0] == [("b", 1), ("c", 2)]  # running first, then the freed slot


def test_token_budget_chunks_a_long_prefill_and_running_requests_go_first():
    sched = scheduler(max_num_batched_tokens=10)
    sched.add(make_request("a", list(range(25)), max_tokens=2))
    sched.add(make_request("b", list(range(100, 106)), max_tokens=2))
    assert run_step(sched) == ([("a", 10)], [])  # a prefill chunk samples nothing
    assert run_step(sched) == ([("a", 10)], [])
    step = sched.schedule()
    assert plan(step) == [("a", 5), ("b", 5)]  # b's first chunk fills the budget
    assert (step.num_prefill_tokens, step.num_decode_seqs) == (10, 0)
    assert [r.request.request_id for r in sched.finish_step(step)] == ["a"]
    step = sched.schedule()
    assert plan(step) == [("a", 1), ("b", 1)]
    assert (step.num_prefill_tokens, step.num_decode_seqs) == (1, 1)


def test_cached_prefix_tokens_are_not_prefilled_and_cost_less():
    sched = scheduler()
    prompt = list(range(20))
    sched.add(make_request("a", prompt, max_tokens=1))
    first = sched.schedule()
    sched.finish_step(first)
    sched.add(make_request("b", prompt[:16] + [90, 91, 92, 93], max_tokens=1))
    second = sched.schedule()
    assert (first.num_prefill_tokens, second.num_prefill_tokens) == (20, 4)
    assert second.scheduled[0][0].num_cached_tokens == 16
    config = sched.config
    assert config.step_seconds(second.num_prefill_tokens, 0) < config.step_seconds(first.num_prefill_tokens, 0)
    sched.finish_step(second)
    sched.add(make_request("c", prompt, max_tokens=1))  # all cached: the last block is recomputed
    third = sched.schedule()
    assert plan(third) == [("c", 4)] and third.scheduled[0][0].num_cached_tokens == 16
    assert (sched.num_prompt_tokens, sched.num_cached_prompt_tokens) == (60, 32)


def test_a_request_waits_while_its_blocks_do_not_fit():
    sched = scheduler(num_blocks=4)
    sched.add(make_request("a", list(range(12)), max_tokens=2))  # 3 blocks
    sched.add(make_request("b", list(range(50, 58)), max_tokens=1))  # 2 blocks: only 1 free
    assert run_step(sched)[0] == [("a", 12)]
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert run_step(sched) == ([("a", 1)], [("a", TOKEN, "length")])
    assert run_step(sched) == ([("b", 8)], [("b", TOKEN, "length")])


def test_preemption_frees_the_newest_request_and_recomputes_it_later():
    sched = scheduler(num_blocks=4)
    a, b = make_request("a", list(range(7)), max_tokens=3), make_request("b", list(range(40, 47)), max_tokens=3)
    sched.add(a)
    sched.add(b)
    assert run_step(sched)[0] == [("a", 7), ("b", 7)]  # 4 blocks used, 8 tokens each held
    assert run_step(sched)[0] == [("a", 1), ("b", 1)]
    # a's third output needs a third block: b (admitted last) is preempted for it.
    assert run_step(sched) == ([("a", 1)], [("a", TOKEN, "length")])
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.token_ids == list(range(40, 47)) + [TOKEN, TOKEN]
    assert not sched.pool.has_request("b")
    # b comes back with its output so far; its first (full, committed) block is still cached.
    step = sched.schedule()
    assert plan(step) == [("b", 5)] and step.num_prefill_tokens == 5
    assert b.num_cached_tokens == 0  # usage reports the hit of its first admission
    assert [r.finish_reason for r in sched.finish_step(step)] == ["length"]
    assert b.num_output_tokens == 3


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    sched = scheduler(num_blocks=4)
    sched.add(make_request("a", list(range(7)), max_tokens=5))
    sched.add(make_request("b", list(range(40, 48)), max_tokens=5))
    run_step(sched)
    # b's first output needs a third block; a needs none: b preempts itself, a goes on.
    step = sched.schedule()
    assert plan(step) == [("a", 1)] and [r.request_id for r in sched.waiting] == ["b"]
    assert sched.num_preemptions == 1 and not sched.pool.has_request("b")


def test_eos_stops_unless_ignored():
    sched = scheduler()
    sched.add(make_request("eos", [1, 2, 3], max_tokens=10, eos=EOS))
    ignoring = make_request("ignore", [1, 2, 4], max_tokens=3)
    ignoring.token_source = OutputScript([TOKEN], [1, 2, 4], None, EOS)  # the model emits EOS, the request ignores it
    sched.add(ignoring)
    outputs = [run_step(sched)[1] for _ in range(3)]
    assert outputs == [
        [("eos", TOKEN, None), ("ignore", TOKEN, None)],
        [("eos", EOS, "stop"), ("ignore", EOS, None)],
        [("ignore", TOKEN, "length")],
    ]


def test_abort_frees_running_and_drops_waiting_requests():
    sched = scheduler(max_num_seqs=1)
    sched.add(make_request("a", list(range(9))))
    sched.add(make_request("b", list(range(9))))
    run_step(sched)
    assert sched.pool.num_used_blocks == 3
    assert sched.abort("a") and sched.pool.num_used_blocks == 0 and not sched.running
    assert sched.abort("b") and not sched.has_work()
    assert not sched.abort("b")


def test_prefill_tokens_in_flight_are_reported():
    sched = scheduler(max_num_batched_tokens=4)
    sched.add(make_request("a", list(range(10))))
    sched.add(make_request("b", list(range(6))))
    assert sched.num_prefill_tokens() == 16
    run_step(sched)
    assert sched.num_prefill_tokens() == 12  # a: 6 left to compute, b: 6 waiting
