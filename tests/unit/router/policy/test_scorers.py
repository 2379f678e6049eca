import pytest

from router.policy import PolicyConfig, PolicyState, request_hashes
from router.policy.base import SCORERS
from router.policy.scorers import (
    ApproxPrefixScorer,
    DispatchShareScorer,
    KVUsageScorer,
    LoadScorer,
    PrefixMatchScorer,
    QueueScorer,
)
from router.policy.scorers.dispatch_share import DispatchCounts


def test_every_scorer_is_registered_with_its_direction():
    assert SCORERS == {
        "approx-prefix": ApproxPrefixScorer,
        "dispatch-share": DispatchShareScorer,
        "kv-usage": KVUsageScorer,
        "load": LoadScorer,
        "prefix-match": PrefixMatchScorer,
        "queue": QueueScorer,
    }
    benefits = {name for name, cls in SCORERS.items() if cls.higher_is_better}
    assert benefits == {"approx-prefix", "prefix-match"}


def test_from_config_signs_the_weight_by_direction():
    state = PolicyState(0)
    config = PolicyConfig(prefix_weight=2.0, load_weight=0.5, queue_weight=3.0, share_weight=0.25)
    assert PrefixMatchScorer.from_config(config, state).weight == 2.0
    assert LoadScorer.from_config(config, state).weight == -0.5
    assert QueueScorer.from_config(config, state).weight == -3.0
    assert DispatchShareScorer.from_config(config, state).weight == -0.25


def test_prefix_match_is_the_share_of_full_blocks_at_each_block_size(candidate, request_factory):
    request = request_factory(18)  # 4 full blocks of 4, 2 of 8, none of 32
    cands = [
        candidate("none", matched_blocks=0),
        candidate("half", matched_blocks=2),
        candidate("all", matched_blocks=4),
        candidate("bs8", block_size=8, matched_blocks=1),
        candidate("bs32", block_size=32, matched_blocks=0),
    ]
    assert PrefixMatchScorer().score(request, cands) == [0.0, 0.5, 1.0, 0.5, 0.0]


def test_load_mixes_prefill_requests_and_kv_usage(candidate, request_factory):
    request = request_factory(1000)
    cands = [
        candidate("idle"),
        candidate(
            "some", predicted_prefill_tokens=500, predicted_requests=2, num_running=1, num_waiting=2,
            kv_usage=0.5, num_kv_blocks_total=100, predicted_blocks=60,
        ),
        candidate("most", predicted_prefill_tokens=2000, predicted_requests=8, kv_usage=0.2),
        candidate("full", predicted_prefill_tokens=2000, predicted_requests=8, kv_usage=1.0),
    ]
    # prefill / max(1000, 2000) * 0.7 + requests / max(8, 8) * 0.15 + kv * 0.15
    assert LoadScorer().score(request, cands) == pytest.approx([0.0, 0.32125, 0.88, 1.0])


def test_load_shares_are_normalised_and_the_floor_damps_small_counts(candidate, request_factory):
    request = request_factory(100)
    scorer = LoadScorer(prefill_share=0.0, requests_share=2.0, kv_share=0.0, requests_floor=4)
    cands = [candidate("a", predicted_requests=1), candidate("b", num_running=2)]
    assert scorer.score(request, cands) == [0.25, 0.5]
    with pytest.raises(ValueError):
        LoadScorer(prefill_share=0, requests_share=0, kv_share=0)


def test_load_prefill_is_relative_to_the_prompt_while_queues_are_short(candidate, request_factory):
    request = request_factory(4000)
    scorer = LoadScorer(prefill_share=1.0, requests_share=0.0, kv_share=0.0)
    cands = [candidate("a", predicted_prefill_tokens=1000), candidate("b", predicted_prefill_tokens=3000)]
    assert scorer.score(request, cands) == [0.25, 0.75]


def test_kv_usage_takes_the_report_or_the_prediction_capped_at_one(candidate, request_factory):
    cands = [
        candidate("reported", kv_usage=0.4, num_kv_blocks_total=100, predicted_blocks=10),
        candidate("predicted", kv_usage=0.1, num_kv_blocks_total=100, predicted_blocks=70),
        candidate("over", kv_usage=0.1, num_kv_blocks_total=100, predicted_blocks=150),
        candidate("unknown-total", kv_usage=0.3, predicted_blocks=150),
    ]
    assert KVUsageScorer().score(request_factory(), cands) == [0.4, 0.7, 1.0, 0.3]


def test_queue_counts_unreported_dispatches_relative_to_the_longest(candidate, request_factory):
    cands = [
        candidate("reported", num_waiting=2),
        candidate("dispatched", num_running=3, predicted_requests=9),
        candidate("idle"),
    ]
    assert QueueScorer(floor=4).score(request_factory(), cands) == [2 / 6, 1.0, 0.0]
    assert QueueScorer(floor=4).score(request_factory(), cands[:1]) == [0.5]


def test_dispatch_share_penalises_only_workers_over_their_fair_share(candidate, request_factory):
    request = request_factory()
    a, b, c = candidate("a"), candidate("b"), candidate("c")
    scorer = DispatchShareScorer(tolerance=0.1, counts=DispatchCounts(half_life=10**9), warmup=0)
    assert scorer.score(request, [a, b, c]) == [0.0, 0.0, 0.0]
    for chosen in (a, a, a, b):
        scorer.on_dispatch(request, chosen)
    assert scorer.score(request, [a, b, c]) == [1.0, 0.0, 0.0]
    # a holds 3 of 4 recent dispatches, 2.25 times its fair share of 4/3.
    wide = DispatchShareScorer(tolerance=2.0, counts=scorer.counts, warmup=0)
    assert wide.score(request, [a, b, c]) == pytest.approx([0.625, 0.0, 0.0])
    scorer.on_worker_removed("a")
    assert scorer.score(request, [b, c]) == [1.0, 0.0]


def test_dispatch_share_weighs_in_only_as_evidence_accumulates(candidate, request_factory):
    request = request_factory()
    a, b, c = candidate("a"), candidate("b"), candidate("c")
    scorer = DispatchShareScorer(tolerance=0.1, counts=DispatchCounts(half_life=10**9), warmup=8)
    scorer.on_dispatch(request, a)
    # One dispatch is no evidence of imbalance: 1 / (1 + 8 * 3) of the full penalty.
    assert scorer.score(request, [a, b, c]) == pytest.approx([1 / 25, 0.0, 0.0])
    for _ in range(99):
        scorer.on_dispatch(request, a)
    assert scorer.score(request, [a, b, c]) == pytest.approx([100 / 124, 0.0, 0.0])


def test_dispatch_counts_decay_by_half_life_and_survive_rescaling(monkeypatch):
    import router.policy.scorers.dispatch_share as module

    counts = DispatchCounts(half_life=1)
    counts.add(("a", 0))
    counts.add(("b", 0))
    assert counts.counts[("b", 0)] == 2 * counts.counts[("a", 0)]
    monkeypatch.setattr(module, "_RESCALE_ABOVE", 10.0)
    for _ in range(6):
        counts.add(("c", 0))
    assert counts._unit <= 10.0  # rescaled at least once
    # 8 dispatches ago, 7 ago, then 6 to c: c = 1 + 2 + ... + 32 in units of b's weight * 2.
    ratio = counts.counts[("c", 0)] / counts.counts[("b", 0)]
    assert ratio == pytest.approx(sum(2.0**k for k in range(1, 7)))


def test_approx_prefix_scores_what_was_routed_to_each_worker(candidate, request_factory):
    scorer = ApproxPrefixScorer.from_config(PolicyConfig(approx_tree_max_blocks=64), PolicyState(0))
    first = request_factory(tokens=range(16))
    a, b = candidate("a"), candidate("b")
    assert scorer.score(first, [a, b]) == [0.0, 0.0]
    scorer.on_dispatch(first, a)
    second = request_factory(tokens=[*range(8), *[99] * 8], request_id="r2")
    assert scorer.score(second, [a, b]) == [0.5, 0.0]
    assert request_hashes(second, 4) == second.hashes_by_block_size[4]
    scorer.on_worker_removed("a")
    assert scorer.score(second, [a, b]) == [0.0, 0.0]
