import math
import random
from collections import Counter

from router.policy.base import PICKERS, rank_by_score
from router.policy.pickers import (
    CacheAwarePicker,
    MaxScorePicker,
    PowerOfTwoPicker,
    RandomPicker,
    RoundRobinPicker,
    SoftmaxPicker,
)


def ids(candidates):
    return [c.worker_id for c in candidates]


def scored(candidate, **scores):
    return [candidate(name, score=score) for name, score in scores.items()]


def test_every_picker_is_registered():
    assert PICKERS == {
        "cache-aware": CacheAwarePicker,
        "max-score": MaxScorePicker,
        "power-of-two": PowerOfTwoPicker,
        "random": RandomPicker,
        "round-robin": RoundRobinPicker,
        "softmax": SoftmaxPicker,
    }


def test_max_score_ranks_every_candidate_best_first(candidate, request_factory):
    cands = scored(candidate, a=0.1, b=0.9, c=-0.5, d=0.4)
    assert ids(MaxScorePicker(random.Random(0)).pick(request_factory(), cands)) == ["b", "d", "a", "c"]


def test_max_score_breaks_ties_at_random_and_reproducibly(candidate, request_factory):
    cands = scored(candidate, a=0.5, b=0.5 + 1e-12, c=0.5, d=0.1)
    firsts = Counter()
    picker = MaxScorePicker(random.Random(42))
    for _ in range(300):
        ranked = ids(picker.pick(request_factory(), cands))
        assert ranked[3] == "d"
        firsts[ranked[0]] += 1
    assert set(firsts) == {"a", "b", "c"}
    assert min(firsts.values()) > 60
    one, two = MaxScorePicker(random.Random(9)), MaxScorePicker(random.Random(9))
    assert [ids(one.pick(request_factory(), cands)) for _ in range(20)] == [
        ids(two.pick(request_factory(), cands)) for _ in range(20)
    ]


def test_rank_by_score_is_deterministic_for_a_seed(candidate):
    cands = scored(candidate, a=1.0, b=1.0, c=1.0, d=1.0)
    first = [ids(rank_by_score(cands, random.Random(7))) for _ in range(3)]
    assert first[0] == first[1] == first[2]
    assert sorted(first[0]) == ["a", "b", "c", "d"]
    assert rank_by_score([], random.Random(0)) == []


def test_softmax_samples_by_exp_score_over_temperature(candidate, request_factory):
    cands = scored(candidate, a=1.0, b=0.0, c=-1.0)
    picker = SoftmaxPicker(temperature=1.0, rng=random.Random(3))
    num_draws = 6000
    firsts = Counter(picker.pick(request_factory(), cands)[0].worker_id for _ in range(num_draws))
    total = sum(math.exp(s) for s in (1.0, 0.0, -1.0))
    for name, s in (("a", 1.0), ("b", 0.0), ("c", -1.0)):
        assert abs(firsts[name] / num_draws - math.exp(s) / total) < 0.02
    ranked = picker.pick(request_factory(), cands)
    assert sorted(ids(ranked)) == ["a", "b", "c"]


def test_softmax_at_low_temperature_is_argmax(candidate, request_factory):
    cands = scored(candidate, a=0.2, b=0.9, c=0.5)
    picker = SoftmaxPicker(temperature=0.001, rng=random.Random(0))
    assert all(ids(picker.pick(request_factory(), cands)) == ["b", "c", "a"] for _ in range(50))


def test_round_robin_rotates_over_sorted_keys(candidate, request_factory):
    picker = RoundRobinPicker()
    cands = [candidate("c"), candidate("a"), candidate("b")]
    rankings = [ids(picker.pick(request_factory(), cands)) for _ in range(4)]
    assert rankings == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert picker.pick(request_factory(), []) == []


def test_random_is_a_seeded_permutation(candidate, request_factory):
    cands = [candidate(name) for name in "abcdef"]
    first = ids(RandomPicker(random.Random(5)).pick(request_factory(), cands))
    assert first == ids(RandomPicker(random.Random(5)).pick(request_factory(), cands))
    assert sorted(first) == list("abcdef")
    assert ids(cands) == list("abcdef")  # the input is not shuffled in place


def test_power_of_two_puts_the_better_of_two_draws_first(candidate, request_factory):
    cands = scored(candidate, a=-0.9, b=-0.1, c=-0.5, d=-0.7)
    rng = random.Random(11)
    picker = PowerOfTwoPicker(rng)
    firsts = Counter()
    for _ in range(400):
        ranked = picker.pick(request_factory(), cands)
        assert sorted(ids(ranked)) == ["a", "b", "c", "d"]
        assert ranked[0].score >= ranked[1].score
        assert [c.score for c in ranked[2:]] == sorted((c.score for c in ranked[2:]), reverse=True)
        firsts[ranked[0].worker_id] += 1
    # The worst is never first; the best wins every draw it is in (half of them).
    assert firsts["a"] == 0
    assert 150 < firsts["b"] < 250
    assert ids(picker.pick(request_factory(), cands[:1])) == ["a"]


def _cache_aware(candidate, loads, matches):
    cands = []
    for (name, load), match in zip(loads.items(), matches):
        cand = candidate(name, num_running=load)
        cand.scores["approx-prefix"] = match
        cands.append(cand)
    return cands


def test_cache_aware_follows_the_best_match_above_the_threshold(candidate, request_factory):
    picker = CacheAwarePicker(random.Random(0), cache_threshold=0.3, balance_abs_threshold=4, balance_rel_threshold=1.5)
    cands = _cache_aware(candidate, {"a": 3, "b": 1, "c": 0}, [0.8, 0.8, 0.2])
    assert ids(picker.pick(request_factory(), cands)) == ["b", "a", "c"]


def test_cache_aware_takes_the_least_loaded_below_the_threshold(candidate, request_factory):
    picker = CacheAwarePicker(random.Random(0), cache_threshold=0.3, balance_abs_threshold=4, balance_rel_threshold=1.5)
    cands = _cache_aware(candidate, {"a": 3, "b": 1, "c": 2}, [0.3, 0.1, 0.0])
    assert ids(picker.pick(request_factory(), cands)) == ["b", "c", "a"]


def test_cache_aware_guard_needs_both_the_absolute_and_the_relative_gap(candidate, request_factory):
    picker = CacheAwarePicker(random.Random(0), cache_threshold=0.3, balance_abs_threshold=4, balance_rel_threshold=1.5)
    imbalanced = _cache_aware(candidate, {"a": 10, "b": 5, "c": 6}, [0.9, 0.0, 0.0])
    assert ids(picker.pick(request_factory(), imbalanced)) == ["b", "c", "a"]
    small_gap = _cache_aware(candidate, {"a": 9, "b": 5, "c": 6}, [0.9, 0.0, 0.0])
    assert ids(picker.pick(request_factory(), small_gap))[0] == "a"
    low_ratio = _cache_aware(candidate, {"a": 20, "b": 14, "c": 15}, [0.9, 0.0, 0.0])
    assert ids(picker.pick(request_factory(), low_ratio))[0] == "a"
    assert picker.is_imbalanced([10, 5]) and not picker.is_imbalanced([9, 5])
