from router.policy.base import FILTERS
from router.policy.filters import BusyFilter, HealthyFilter, NotDrainingFilter, RoleFilter, ServesModelFilter


def ids(candidates):
    return [c.worker_id for c in candidates]


def test_every_filter_is_registered_by_its_kebab_case_name():
    assert FILTERS == {
        "healthy": HealthyFilter,
        "serves-model": ServesModelFilter,
        "not-draining": NotDrainingFilter,
        "role": RoleFilter,
        "busy": BusyFilter,
    }


def test_healthy_keeps_healthy_workers_in_order(candidate, request_factory):
    cands = [candidate("a"), candidate("b", healthy=False), candidate("c")]
    assert ids(HealthyFilter().filter(request_factory(), cands)) == ["a", "c"]


def test_serves_model_needs_the_exact_model_name(candidate, request_factory):
    cands = [candidate("a", model="m"), candidate("b", model="m2"), candidate("c", model="M")]
    assert ids(ServesModelFilter().filter(request_factory(model="m"), cands)) == ["a"]


def test_not_draining_drops_draining_workers(candidate, request_factory):
    cands = [candidate("a", draining=True), candidate("b")]
    assert ids(NotDrainingFilter().filter(request_factory(), cands)) == ["b"]


def test_role_never_sends_client_requests_to_prefill_only_workers(candidate, request_factory):
    cands = [candidate("a", role="prefill"), candidate("b", role="decode"), candidate("c", role="both")]
    assert ids(RoleFilter().filter(request_factory(), cands)) == ["b", "c"]


def test_busy_drops_workers_over_either_threshold(candidate, request_factory):
    busy = BusyFilter(max_kv_usage=0.9, max_waiting=4)
    cands = [
        candidate("at-limits", kv_usage=0.9, num_waiting=4),
        candidate("kv-full", kv_usage=0.91),
        candidate("queued", num_waiting=5),
        candidate("idle"),
    ]
    assert ids(busy.filter(request_factory(), cands)) == ["at-limits", "idle"]


def test_busy_keeps_everyone_when_everyone_is_busy(candidate, request_factory):
    busy = BusyFilter(max_kv_usage=0.5, max_waiting=0)
    cands = [candidate("a", kv_usage=0.6), candidate("b", num_waiting=1)]
    assert busy.filter(request_factory(), cands) is cands
    assert BusyFilter().filter(request_factory(), []) == []
