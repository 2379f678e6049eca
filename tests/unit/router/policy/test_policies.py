import pytest

from router.policy import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    Policy,
    PolicyConfig,
    PolicyConfigError,
    build_policy,
)


def ids(candidates):
    return [c.worker_id for c in candidates]


def test_policy_names_and_default():
    assert POLICY_NAMES == ("kv", "round_robin", "random", "least_load", "power_of_two", "cache_aware")
    assert DEFAULT_POLICY == "kv"
    assert build_policy().name == "kv"


def test_unknown_policy_names_the_policy_field():
    with pytest.raises(PolicyConfigError) as caught:
        build_policy("fastest")
    assert caught.value.field == "policy"
    assert "round_robin" in str(caught.value)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_filters_then_ranks_every_survivor(name, candidate, request_factory):
    policy = build_policy(name, {"seed": 1})
    assert isinstance(policy, Policy)
    cands = [
        candidate("sick", healthy=False),
        candidate("other-model", model="x"),
        candidate("draining", draining=True),
        candidate("prefill", role="prefill"),
        candidate("a"),
        candidate("b", role="decode"),
    ]
    ranked = policy.rank(request_factory(), cands)
    assert sorted(ids(ranked)) == ["a", "b"]
    assert policy.rank(request_factory(), cands[:4]) == []
    assert policy.rank(request_factory(), []) == []


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_describe_names_plugins_and_config(name):
    described = build_policy(name, {"seed": 3}).describe()
    assert described["name"] == name
    assert [f["name"] for f in described["filters"]] == ["healthy", "serves-model", "not-draining", "role", "busy"]
    assert described["config"] == PolicyConfig(seed=3).to_dict()
    assert described["picker"]["name"]


def test_kv_scores_match_rate_minus_load(candidate, request_factory):
    policy = build_policy("kv", {"seed": 0})
    request = request_factory(32)  # 8 blocks of 4
    cands = [
        candidate("cached", matched_blocks=6, predicted_prefill_tokens=8),
        candidate("cold"),
    ]
    ranked = policy.rank(request, cands)
    assert ids(ranked) == ["cached", "cold"]
    cached = ranked[0]
    assert set(cached.scores) == {"prefix-match", "load", "dispatch-share"}
    assert cached.scores["prefix-match"] == 0.75
    # load: prefill 8 / max(32, 8) * 0.7, no requests, no KV usage.
    assert cached.scores["load"] == pytest.approx(0.175)
    assert cached.score == pytest.approx(0.75 - 0.175)
    assert ranked[1].score == 0.0


def test_kv_leaves_a_cached_worker_that_is_far_behind(candidate, request_factory):
    policy = build_policy("kv", {"seed": 0})
    request = request_factory(400)
    cands = [
        candidate("cached-busy", matched_blocks=50, predicted_prefill_tokens=40_000, predicted_requests=12,
                  kv_usage=0.9),
        candidate("cold-idle"),
    ]
    assert ids(policy.rank(request, cands)) == ["cold-idle", "cached-busy"]


def test_kv_weights_are_config(candidate, request_factory):
    request = request_factory(32)
    cands = [candidate("cached", matched_blocks=8, num_running=8), candidate("idle")]
    assert ids(build_policy("kv", {"seed": 0}).rank(request, cands))[0] == "cached"
    heavy = build_policy("kv", {"seed": 0, "load_weight": 10.0})
    assert ids(heavy.rank(request, cands))[0] == "idle"
    only_prefix = build_policy("kv", {"seed": 0, "load_weight": 0, "share_weight": 0})
    assert [s.name for s in only_prefix.pipeline.scorers] == ["prefix-match"]
    sampled = build_policy("kv", {"seed": 0, "temperature": 0.5})
    assert sampled.pipeline.picker.name == "softmax"


def test_rank_replaces_stale_scores(candidate, request_factory):
    policy = build_policy("least_load", {"seed": 0})
    stale = candidate("a", scores={"old": 1.0}, score=5.0)
    held = stale.scores
    policy.rank(request_factory(), [stale])
    assert stale.scores == {"load": 0.0} and stale.score == 0.0
    assert held == {"old": 1.0}


def test_least_load_and_power_of_two_ignore_a_zero_load_weight(candidate, request_factory):
    cands = [candidate("busy", predicted_prefill_tokens=900, num_running=5), candidate("idle")]
    for name in ("least_load", "power_of_two"):
        policy = build_policy(name, {"seed": 2, "load_weight": 0.0})
        assert ids(policy.rank(request_factory(100), cands)) == ["idle", "busy"]


def test_round_robin_position_survives_reconfiguration(candidate, request_factory):
    policy = build_policy("round_robin")
    cands = [candidate(name) for name in "abc"]
    assert ids(policy.rank(request_factory(), cands))[0] == "a"
    policy.reconfigure({"busy_max_waiting": 10})
    assert policy.config.busy_max_waiting == 10
    assert ids(policy.rank(request_factory(), cands))[0] == "b"


def test_a_bad_reconfiguration_changes_nothing():
    policy = build_policy("kv", {"load_weight": 0.5})
    pipeline = policy.pipeline
    with pytest.raises(PolicyConfigError):
        policy.reconfigure({"load_weight": -1})
    assert policy.config.load_weight == 0.5 and policy.pipeline is pipeline


def test_cache_aware_follows_what_it_routed_without_events(candidate, request_factory):
    policy = build_policy("cache_aware", {"seed": 0})
    cands = [candidate(name) for name in "abcd"]
    first = request_factory(tokens=range(64))
    chosen = policy.rank(first, cands)[0]
    policy.on_dispatch(first, chosen)
    follow_up = request_factory(tokens=[*range(64), 7, 7, 7, 7], request_id="r2")
    ranked = policy.rank(follow_up, [candidate(name) for name in "abcd"])
    assert ranked[0].worker_id == chosen.worker_id
    assert ranked[0].scores["approx-prefix"] == 16 / 17
    policy.reconfigure({"cache_threshold": 0.5})  # the trees are state: they survive
    assert policy.rank(follow_up, [candidate(name) for name in "abcd"])[0].worker_id == chosen.worker_id
    policy.on_worker_removed(chosen.worker_id)
    assert policy.rank(follow_up, [candidate(name) for name in "abcd"])[0].scores["approx-prefix"] == 0.0


def test_hooks_reach_only_plugins_that_use_them(candidate, request_factory):
    policy = build_policy("kv", {"seed": 0, "share_warmup": 0})
    # dispatch-share counts dispatches; nothing in kv listens to on_finish.
    assert len(policy._dispatch_hooks) == 1 and policy._finish_hooks == []
    request = request_factory()
    for _ in range(5):
        policy.on_dispatch(request, candidate("a"))
    policy.on_finish(request.request_id)
    ranked = policy.rank(request, [candidate("a"), candidate("b")])
    assert ids(ranked) == ["b", "a"]
    assert ranked[1].scores["dispatch-share"] == 1.0
