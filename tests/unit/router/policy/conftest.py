"""Shared helpers for the policy tests: the simulated fleet of `bench/routing_sim.py`
(loaded from its file: `bench/` is scripts, not an installed package) and candidate
builders."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from indexer.hashing import token_array
from router.policy import Candidate, RouteRequest

_SIM_PATH = Path(__file__).resolve().parents[4] / "bench" / "routing_sim.py"


def _load_routing_sim():
    name = "kvgate_bench_routing_sim"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, _SIM_PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def routing_sim():
    return _load_routing_sim()


def make_candidate(worker_id: str, **fields) -> Candidate:
    base = dict(dp_rank=0, url=f"http://127.0.0.1/{worker_id}", role="both", model="m", block_size=4)
    base.update(fields)
    return Candidate(worker_id=worker_id, **base)


def make_request(num_tokens: int = 16, model: str = "m", request_id: str = "r1", tokens=None) -> RouteRequest:
    token_ids = token_array(tokens if tokens is not None else range(num_tokens))
    return RouteRequest(request_id, model, token_ids, len(token_ids), 16)


@pytest.fixture
def candidate():
    return make_candidate


@pytest.fixture
def request_factory():
    return make_request
