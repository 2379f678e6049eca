"""A DP rank as the router sees it: the registration body a rank sends carries its
`dp_rank`, the router's spec keeps it, and routing builds that rank's candidate with
that rank's load report (the aggregator also holds rank 0's under the same id)."""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from indexer.load import LoadAggregator, LoadReport
from router.breaker import BreakerConfig
from router.health import HealthConfig
from router.load_tracker import LoadTracker
from router.registry import Worker
from router.routing import RoutingCore
from router.worker_spec import parse_worker_flag, spec_from_dict
from worker import worker_cmd


def report(worker_id: str, dp_rank: int, num_running: int) -> LoadReport:
    return LoadReport(worker_id, dp_rank, time.time(), num_running, 0, 8, 64, 0)


def rank_body(dp_rank: int) -> dict:
    args = argparse.Namespace(advertise_url=None, role="both")
    ready = {
        "worker_id": f"moe-dp{dp_rank}", "url": "http://127.0.0.1:9001", "model": "m", "block_size": 16,
        "events_endpoint": "tcp://127.0.0.1:5567", "replay_endpoint": None, "load_endpoint": "tcp://127.0.0.1:5569",
        "dp_rank": dp_rank,
    }
    return worker_cmd._registration(args, ready)


def test_the_registration_body_carries_dp_rank_into_the_spec():
    body = rank_body(1)
    assert body["dp_rank"] == 1
    assert spec_from_dict(body).dp_rank == 1
    assert spec_from_dict({k: v for k, v in body.items() if k != "dp_rank"}).dp_rank == 0
    assert parse_worker_flag("id=w,url=http://h:1,model=m,dp_rank=3", 0, {}).dp_rank == 3


def test_a_dp_rank_spec_yields_its_rank_candidate_and_load():
    spec = spec_from_dict(rank_body(1))
    aggregator = LoadAggregator()
    aggregator.update(report("moe-dp1", 0, num_running=5))  # not this rank's
    aggregator.update(report("moe-dp1", 1, num_running=2))
    worker = Worker(spec, HealthConfig(), BreakerConfig())
    routing = SimpleNamespace(
        registry=SimpleNamespace(workers={spec.worker_id: worker}), aggregator=aggregator, tracker=LoadTracker(),
    )
    [candidate] = RoutingCore.candidates(routing, "m")  # type: ignore[arg-type]
    assert (candidate.worker_id, candidate.dp_rank, candidate.key) == ("moe-dp1", 1, ("moe-dp1", 1))
    assert (candidate.num_running, candidate.kv_usage) == (2, 8 / 64)
