"""The disaggregation decider: every reason, in order, thresholds at the boundary, in-flight depth."""

from array import array

import msgspec
import pytest

from router.disagg import DisaggConfig, PrefillDecider, PrefillDecision
from router.policy.base import Candidate, RouteRequest
from router.requests import COMPLETIONS, ParsedRequest, with_kv_transfer_params

BLOCK = 16


def _request(num_prompt_tokens: int) -> RouteRequest:
    return RouteRequest("r1", "m", array("I", range(num_prompt_tokens)), num_prompt_tokens, 16)


def _candidate(worker_id: str, role: str, matched_blocks: int = 0, *, healthy: bool = True,
               draining: bool = False) -> Candidate:
    candidate = Candidate(worker_id, 0, f"http://{worker_id}", role, "m", BLOCK, healthy, draining)
    candidate.matched_blocks = matched_blocks
    return candidate


def _decider(max_local: int = 512, max_depth: int = 4, depth: int | None = 0) -> PrefillDecider:
    decider = PrefillDecider(
        DisaggConfig(max_local_prefill_tokens=max_local, max_prefill_queue_depth=max_depth), is_enabled=True
    )
    decider.is_queue_available = True
    if depth is not None:
        decider.set_depth("m", depth, decider.begin_poll("m"))
    return decider


DECODE = _candidate("d0", "decode")
PREFILL = _candidate("p0", "prefill")


def test_a_long_uncached_prompt_goes_remote_with_its_cached_tokens():
    decode = _candidate("d0", "decode", matched_blocks=10)
    decision = _decider().decide(_request(1000), decode, [decode, PREFILL])
    assert decision == PrefillDecision(True, "long_prompt", 840, 160, 0)
    assert decision.label == "remote"
    assert decision.kv_transfer_params() == b'{"do_remote_prefill":true,"num_cached_tokens":160}'
    assert decision.describe() == {
        "prefill": "remote", "reason": "long_prompt", "uncached_tokens": 840, "queue_depth": 0,
    }


def test_uncached_tokens_at_the_limit_stay_local_one_over_goes_remote():
    decider = _decider(max_local=512)
    at_limit = _candidate("d0", "decode", matched_blocks=2)  # 544 - 32 = 512
    local = decider.decide(_request(544), at_limit, [at_limit, PREFILL])
    assert local == PrefillDecision(False, "short_prompt", 512, 32, 0)
    assert decider.decide(_request(545), at_limit, [at_limit, PREFILL]).reason == "long_prompt"
    assert local.kv_transfer_params() == b'{"do_remote_prefill":false}' and local.label == "local"


def test_depth_one_under_the_limit_goes_remote_at_the_limit_queue_full():
    assert _decider(max_depth=4, depth=3).decide(_request(600), DECODE, [DECODE, PREFILL]).reason == "long_prompt"
    full = _decider(max_depth=4, depth=4).decide(_request(600), DECODE, [DECODE, PREFILL])
    assert full == PrefillDecision(False, "queue_full", 600, 0, 4)
    assert _decider(max_depth=0, depth=0).decide(_request(600), DECODE, [DECODE, PREFILL]).reason == "queue_full"


def test_remote_decisions_since_the_poll_count_in_the_depth():
    decider = _decider(max_depth=3, depth=1)
    for expected_depth in (1, 2):
        decision = decider.decide(_request(600), DECODE, [DECODE, PREFILL])
        assert (decision.is_remote, decision.queue_depth) == (True, expected_depth)
        decider.on_dispatch("m", decision)
    assert decider.queue_depth("m") == 3
    assert decider.decide(_request(600), DECODE, [DECODE, PREFILL]).reason == "queue_full"
    # Local decisions add nothing.
    decider.on_dispatch("m", decider.decide(_request(10), DECODE, [DECODE, PREFILL]))
    assert decider.queue_depth("m") == 3
    # A poll replaces what it saw: the jobs are in the polled figure now.
    decider.set_depth("m", 2, decider.begin_poll("m"))
    assert decider.queue_depth("m") == 2


def test_a_decision_made_while_a_poll_is_in_flight_keeps_counting_after_it():
    decider = _decider(max_depth=10, depth=0)
    token = decider.begin_poll("m")
    decider.on_dispatch("m", decider.decide(_request(600), DECODE, [DECODE, PREFILL]))  # during the await
    decider.set_depth("m", 5, token)  # the queue did not have that job yet
    assert decider.queue_depth("m") == 6


def test_decide_changes_nothing():
    decider = _decider(depth=2)
    for _ in range(3):
        assert decider.decide(_request(600), DECODE, [DECODE, PREFILL]).queue_depth == 2
    assert decider.queue_depth("m") == 2


def test_reasons_in_their_order():
    both = _candidate("b0", "both")
    disabled = PrefillDecider(DisaggConfig(), is_enabled=False)
    assert disabled.decide(_request(600), DECODE, [DECODE, PREFILL]).reason == "disabled"
    decider = _decider(depth=None)
    decider.is_queue_available = False
    # role before no_prefill_workers before queue_unavailable before short_prompt
    assert decider.decide(_request(5), both, [both]).reason == "role"
    assert decider.decide(_request(5), DECODE, [DECODE]).reason == "no_prefill_workers"
    assert decider.decide(_request(5), DECODE, [DECODE, PREFILL]).reason == "queue_unavailable"
    decider.set_depth("m", 100, decider.begin_poll("m"))
    assert decider.decide(_request(5), DECODE, [DECODE, PREFILL]).reason == "queue_unavailable"  # not available
    decider.is_queue_available = True
    # short_prompt before queue_full
    short = decider.decide(_request(5), DECODE, [DECODE, PREFILL])
    assert short == PrefillDecision(False, "short_prompt", 5, 0, 100)
    assert decider.decide(_request(600), DECODE, [DECODE, PREFILL]).reason == "queue_full"


def test_only_a_healthy_non_draining_prefill_worker_counts():
    decider = _decider()
    for prefill in (_candidate("p1", "prefill", healthy=False), _candidate("p2", "prefill", draining=True)):
        assert decider.decide(_request(600), DECODE, [DECODE, prefill]).reason == "no_prefill_workers"
    other_decode = _candidate("d1", "decode")
    assert decider.decide(_request(600), DECODE, [DECODE, other_decode]).reason == "no_prefill_workers"


def test_an_unknown_depth_is_queue_unavailable_and_forgotten_models_too():
    decider = _decider(depth=1)
    decider.set_unknown("m")
    unknown = decider.decide(_request(600), DECODE, [DECODE, PREFILL])
    assert unknown == PrefillDecision(False, "queue_unavailable", 600, 0, None)
    decider.set_depth("m", 1, decider.begin_poll("m"))
    decider.keep_models(set())
    assert decider.polled_depths() == {} and decider.queue_depth("m") is None


@pytest.mark.parametrize(("field", "value"), [
    ("max_local_prefill_tokens", -1), ("max_prefill_queue_depth", 1.5), ("max_prefill_queue_depth", True),
    ("poll_interval_s", 0), ("prefill_queue_url", "tcp://127.0.0.1:6379"),
])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DisaggConfig(**{field: value})


def test_queue_urls_accepted():
    for url in ("", "redis://127.0.0.1:6379", "rediss://h:6380/0", "unix:///tmp/r.sock", "http://127.0.0.1:9000"):
        assert DisaggConfig(prefill_queue_url=url).prefill_queue_url == url


def _parsed(raw: bytes, has_params: bool) -> ParsedRequest:
    return ParsedRequest(COMPLETIONS, "m", False, 16, array("I"), raw, has_params)


def test_kv_transfer_params_are_spliced_in_or_replace_the_clients():
    remote = b'{"do_remote_prefill":true,"num_cached_tokens":32}'
    spliced = with_kv_transfer_params(_parsed(b'{"model":"m","prompt":"hi"} \n', False), remote)
    assert spliced == (
        b'{"model":"m","prompt":"hi","kv_transfer_params":{"do_remote_prefill":true,"num_cached_tokens":32}}'
    )
    replaced = with_kv_transfer_params(
        _parsed(b'{"model":"m","kv_transfer_params":{"do_remote_prefill":true,"x":1},"prompt":"hi"}', True),
        b'{"do_remote_prefill":false}',
    )
    assert msgspec.json.decode(replaced) == {
        "model": "m", "kv_transfer_params": {"do_remote_prefill": False}, "prompt": "hi",
    }
