"""`kvgate up --disagg` as a real process: greedy answers equal aggregated serving's, long prompts prefilled remotely.

Runs the reference torch engine (seeded tiny model): one fleet with an in-process
queue and one on Redis ($KVGATE_REDIS_URL, set by `make test`), each 1 prefill + 1
decode worker, against an aggregated `kvgate up` with one worker.
"""

from __future__ import annotations

import json
import os
import random
import re
import urllib.request
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from tests.e2e.test_gateway_up import Up, kvgate_up

REDIS_URL = os.environ.get("KVGATE_REDIS_URL", "redis://127.0.0.1:6379")
MODEL = "kvgate-moe-tiny"
# Short prompts stay local (<= --max-local-prefill-tokens 256 uncached), long ones go remote.
PROMPTS = {
    "short": "Hello there, how are you?",
    "long": "".join(random.Random(7).choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(1200)),
    "longer": "".join(random.Random(8).choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(2500)),
}


def disagg_up(tmp_path: Path, *args: str) -> AbstractContextManager[Up]:
    """`kvgate up` with this module's local-prefill limit; see `kvgate_up`."""
    return kvgate_up(tmp_path, "--max-local-prefill-tokens", "256", *args, ready_timeout_s=90)


def complete(url: str, prompt: str) -> tuple[str, str | None]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["text"], response.headers.get("x-kvgate-prefill")


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE)
    return sum(float(v) for v in values)


@pytest.fixture(scope="module")
def aggregated_answers(tmp_path_factory) -> dict[str, str]:
    with disagg_up(tmp_path_factory.mktemp("agg"), "--workers", "1") as up:
        return {name: complete(up.ready["url"], prompt)[0] for name, prompt in PROMPTS.items()}


# The in-process fleet moves KV over the default transport (NIXL when installed), the Redis one over TCP.
@pytest.mark.parametrize("queue", ["in-process", "redis"])
def test_disagg_fleet_answers_like_aggregated_serving(tmp_path, aggregated_answers, queue):
    extra = ("--redis", REDIS_URL, "--worker-arg=--kv-transport=tcp") if queue == "redis" else ()
    with disagg_up(tmp_path, "--disagg", "--workers", "2", *extra) as up:
        ready = up.ready
        roles = sorted(worker["role"] for worker in ready["workers"])
        assert roles == ["decode", "prefill"]
        assert "1 decode + 1 prefill torch workers" in up.banner[0]
        answers = {}
        for name, prompt in PROMPTS.items():
            text, prefill = complete(ready["url"], prompt)
            answers[name] = text
            assert prefill == ("local" if name == "short" else "remote"), name
        assert answers == aggregated_answers
        decode = next(w for w in ready["workers"] if w["role"] == "decode")
        prefill = next(w for w in ready["workers"] if w["role"] == "prefill")
        assert metric(decode["url"], "kvgate_worker_disagg_completed_total") == 2
        assert metric(decode["url"], "kvgate_worker_disagg_fallback_deadline_total") == 0
        assert metric(prefill["url"], "kvgate_worker_disagg_jobs_served_total") == 2
        assert metric(ready["url"], "kvgate_disagg_decisions_total") == 3
