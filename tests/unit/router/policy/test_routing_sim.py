"""The simulated fleet behind the routing benchmark and the hot-prefix test: its timing
model and its wiring of real block pools into the real prefix index."""

from array import array

import pytest

from indexer.hashing import hash_prompt
from router.policy import build_policy

TIMING = dict(prefill_s_per_token=1e-3, decode_s_per_seq=1e-2, step_overhead_s=0.5, max_num_batched_tokens=64)


def fleet_of(sim, num_workers=1, policy="round_robin", num_blocks=64):
    config = sim.FleetConfig(
        num_workers=num_workers, num_blocks=num_blocks, block_size=16, timing=sim.TimingModel(**TIMING)
    )
    return sim.SimFleet(build_policy(policy, {"seed": 0}), config)


def request(sim, request_id, arrival_s, tokens, num_output=3):
    return sim.SimRequest(request_id, arrival_s, array("I", tokens), num_output)


def test_prefill_costs_uncached_tokens_and_decode_costs_steps(routing_sim):
    fleet = fleet_of(routing_sim)
    first = request(routing_sim, "a", 0.0, range(40))
    second = request(routing_sim, "b", 10.0, range(40))
    fleet.run([first, second])
    # Prefill: one step of 40 tokens; then two decode steps of one sequence.
    assert first.ttft_s == pytest.approx(0.5 + 40e-3)
    assert first.finish_s - first.first_token_s == pytest.approx(2 * (0.5 + 1e-2))
    # The second finds 2 of its 2.5 blocks cached (the engine recomputes the last token).
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert second.ttft_s == pytest.approx(0.5 + 8e-3)


def test_long_prompts_prefill_in_chunks_of_the_token_budget(routing_sim):
    fleet = fleet_of(routing_sim)
    long = request(routing_sim, "a", 0.0, range(150), num_output=1)
    fleet.run([long])
    assert long.ttft_s == pytest.approx(3 * 0.5 + 150e-3)  # chunks of 64, 64, 22
    assert long.finish_s == long.first_token_s


def test_the_index_mirrors_what_each_worker_cached(routing_sim):
    fleet = fleet_of(routing_sim, num_workers=2)
    requests = [request(routing_sim, f"r{i}", float(i), [i] * 48) for i in range(2)]
    fleet.run(requests)
    assert [r.worker for r in requests] == [0, 1]
    for r in requests:
        hashes = hash_prompt(r.token_ids, 16, "sim-model")
        assert fleet.index.find_matches(hashes) == {(f"worker-{r.worker}", 0): 3}
    assert fleet.tracker.num_in_flight == 0
    assert fleet.aggregator.get(("worker-0", 0)) is not None


def test_a_prompt_that_can_never_fit_is_rejected(routing_sim):
    fleet = fleet_of(routing_sim, num_blocks=4)
    too_long = request(routing_sim, "a", 0.0, range(80))
    fleet.run([too_long])
    assert too_long.rejected
    assert fleet.tracker.num_in_flight == 0


def test_decode_preempts_the_newest_sequence_when_blocks_run_out(routing_sim):
    fleet = fleet_of(routing_sim, num_blocks=4)
    first = request(routing_sim, "a", 0.0, range(1, 32), num_output=20)
    second = request(routing_sim, "b", 0.0, range(100, 131), num_output=20)
    fleet.run([first, second])
    assert fleet.engines[0].num_preempted >= 1
    assert first.finish_s < second.finish_s
    assert not first.rejected and not second.rejected
