"""A prompt prefix that is hot everywhere must not pile onto one worker.

8 simulated workers (real `BlockPool`s whose KV events feed a real `PrefixIndex`),
the real `LoadTracker` and the real policies, in simulated time. Every request starts
with the same 48 blocks (a long system prompt), then one of 48 conversations' 8 blocks
(each conversation recurs about 10 times), then a new half-block question. `kv` must
keep max/mean requests per worker <= 1.2 while its token hit rate beats round robin's.
"""

import random
import statistics
from array import array

import pytest

from router.policy import Candidate, RouteRequest, build_policy, fill_matches

BLOCK_SIZE = 16
NUM_WORKERS = 8
NUM_REQUESTS = 480
NUM_CONVERSATIONS = 48
PREFIX_BLOCKS = 48
CONVERSATION_BLOCKS = 8


def workload(sim, seed: int, gap_s: float):
    rng = random.Random(seed)
    shared = list(range(1, PREFIX_BLOCKS * BLOCK_SIZE + 1))
    requests = []
    now = 0.0
    for i in range(NUM_REQUESTS):
        conversation = rng.randrange(NUM_CONVERSATIONS)
        history = [100_000 + conversation * 10_000 + j for j in range(CONVERSATION_BLOCKS * BLOCK_SIZE)]
        question = [200_000_000 + i * 100 + j for j in range(BLOCK_SIZE // 2)]
        now += rng.expovariate(1.0 / gap_s)
        requests.append(sim.SimRequest(f"req-{i}", now, array("I", shared + history + question), 16))
    return requests


def replay(sim, policy_name: str, seed: int, gap_s: float, **policy_config):
    timing = sim.TimingModel(prefill_s_per_token=2e-4, decode_s_per_seq=1e-4, step_overhead_s=0.005)
    config = sim.FleetConfig(num_workers=NUM_WORKERS, num_blocks=512, block_size=BLOCK_SIZE, timing=timing)
    fleet = sim.SimFleet(build_policy(policy_name, {"seed": seed, **policy_config}), config)
    requests = workload(sim, seed, gap_s)
    fleet.run(requests)
    assert all(r.finish_s >= r.first_token_s >= r.arrival_s for r in requests)
    hit_rate = sum(r.num_cached_tokens for r in requests) / sum(len(r.token_ids) for r in requests)
    counts = fleet.requests_per_worker
    assert sum(counts) == NUM_REQUESTS
    return hit_rate, max(counts) / statistics.fmean(counts), fleet


@pytest.mark.parametrize(("seed", "gap_s"), [(1, 0.02), (2, 0.02), (3, 0.01)])
def test_kv_spreads_a_prefix_hot_everywhere_and_beats_round_robin_hits(routing_sim, seed, gap_s):
    kv_hit, kv_balance, fleet = replay(routing_sim, "kv", seed, gap_s)
    rr_hit, rr_balance, _ = replay(routing_sim, "round_robin", seed, gap_s)
    assert kv_balance <= 1.2
    assert kv_hit > rr_hit + 0.02
    assert rr_balance == 1.0
    # The index saw every worker cache the shared prefix: routing used the whole fleet.
    shared = workload(routing_sim, seed, gap_s)[0]
    request = RouteRequest("probe", "sim-model", shared.token_ids, len(shared.token_ids), 1)
    candidates = [Candidate(e.worker_id, 0, "", "both", "sim-model", BLOCK_SIZE) for e in fleet.engines]
    fill_matches(fleet.index, request, candidates)
    assert all(c.matched_blocks >= PREFIX_BLOCKS for c in candidates)


def test_prefix_affinity_alone_piles_onto_the_first_workers(routing_sim):
    # The same workload with kv's load and fair-share terms off: the scenario has teeth.
    _, balance, fleet = replay(routing_sim, "kv", 2, 0.02, load_weight=0.0, share_weight=0.0)
    assert balance > 1.5
    assert fleet.requests_per_worker.count(0) >= 2
