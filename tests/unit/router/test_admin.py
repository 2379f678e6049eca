"""The admin API: auth, the worker registry, runtime config, stats and the dry-run route."""

import json

import aiohttp
import pytest

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _call(method: str, url: str, body=None, headers=AUTH, raw: bytes | None = None):
    async with aiohttp.ClientSession() as http:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        async with http.request(method, url, data=data, headers=headers) as response:
            return response.status, await response.json()


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/admin/workers"), ("POST", "/admin/workers"), ("GET", "/admin/workers/x"),
     ("DELETE", "/admin/workers/x"), ("POST", "/admin/workers/x/drain"), ("GET", "/admin/config"),
     ("PATCH", "/admin/config"), ("GET", "/admin/stats"), ("POST", "/admin/route")],
)
async def test_every_endpoint_wants_the_token(gateway, method, path):
    url, _ = await gateway(admin_token=TOKEN)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        status, body = await _call(method, url + path, {}, headers=headers)
        assert status == 401
        assert body["error"]["type"] == "authentication_error"
    status, _ = await _call(method, url + path, {}, headers=AUTH)
    assert status != 401


async def test_worker_registration_heartbeat_replacement_and_removal(gateway, sim_worker, wait_until):
    url, state = await gateway(admin_token=TOKEN)
    spec = await sim_worker("s0")
    body = spec.to_dict()
    status, created = await _call("POST", f"{url}/admin/workers", body)
    assert status == 201
    assert created["worker_id"] == "s0" and created["url"] == spec.url and created["draining"] is False
    status, again = await _call("POST", f"{url}/admin/workers", body)  # a heartbeat
    assert status == 200 and again["registered_at"] == created["registered_at"]
    await wait_until(lambda: state.registry.get("s0").is_eligible)
    status, listed = await _call("GET", f"{url}/admin/workers")
    assert [w["worker_id"] for w in listed["workers"]] == ["s0"]
    assert listed["workers"][0]["health"]["status"] == "healthy" and listed["workers"][0]["eligible"] is True
    status, replaced = await _call("POST", f"{url}/admin/workers", {**body, "role": "decode"})
    assert status == 201 and replaced["role"] == "decode"
    status, drained = await _call("POST", f"{url}/admin/workers/s0/drain")
    assert status == 200 and drained["draining"] is True and drained["eligible"] is False
    status, undrained = await _call("POST", f"{url}/admin/workers/s0/drain", {"draining": False})
    assert undrained["draining"] is False
    status, error = await _call("POST", f"{url}/admin/workers/s0/drain", {"draining": "no"})
    assert status == 400 and error["error"]["param"] == "draining"
    status, one = await _call("GET", f"{url}/admin/workers/s0")
    assert status == 200 and one["role"] == "decode"
    assert await _call("DELETE", f"{url}/admin/workers/s0") == (200, {"worker_id": "s0", "removed": True})
    status, missing = await _call("DELETE", f"{url}/admin/workers/s0")
    assert status == 404 and missing["error"]["param"] == "worker_id"
    assert (await _call("GET", f"{url}/admin/workers/s0"))[0] == 404
    assert state.registry.workers == {}


@pytest.mark.parametrize(
    ("body", "raw", "message"),
    [
        ({"url": "http://127.0.0.1:1", "model": "m"}, None, "worker_id"),
        ({"worker_id": "w", "url": "nope", "model": "m"}, None, "url"),
        ({"worker_id": "w", "url": "http://127.0.0.1:1", "model": "m", "block_size": -4}, None, "block_size"),
        (None, b"{not json", "malformed JSON"),
        (None, b"[]", "JSON object"),
    ],
)
async def test_bad_worker_bodies_are_400(gateway, body, raw, message):
    url, state = await gateway(admin_token=TOKEN)
    status, error = await _call("POST", f"{url}/admin/workers", body, raw=raw)
    assert status == 400 and message in error["error"]["message"]
    assert state.registry.workers == {}


async def test_config_is_validated_and_applied_at_runtime(gateway, sim_worker):
    spec = await sim_worker("s0")
    url, state = await gateway(spec)
    status, config = await _call("GET", f"{url}/admin/config")
    assert status == 200 and config["policy"] == "kv"
    assert set(config["policies"]) == {"kv", "round_robin", "random", "least_load", "power_of_two", "cache_aware"}
    assert config["policy_config"]["prefix_weight"] == 1.0 and config["max_retries"] == 2
    for bad, param in [
        ({"policy": "fastest"}, "policy"),
        ({"policy_config": {"prefix_weight": -1}}, "prefix_weight"),
        ({"policy_config": {"no_such_weight": 1}}, "no_such_weight"),
        ({"policy_config": {"busy_max_kv_usage": 2.0}, "max_retries": 1}, "busy_max_kv_usage"),
        ({"max_retries": -1}, "max_retries"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"turbo": True}, "turbo"),
    ]:
        status, error = await _call("PATCH", f"{url}/admin/config", bad)
        assert status == 400 and error["error"]["param"] == param, (bad, error)
    # Nothing of a rejected patch was applied.
    assert state.forwarder.config.max_retries == 2 and state.core.policy.config.busy_max_kv_usage == 0.98
    policy = state.core.policy
    status, config = await _call("PATCH", f"{url}/admin/config", {"policy_config": {"load_weight": 0.5}, "max_retries": 1})
    assert status == 200 and config["policy_config"]["load_weight"] == 0.5 and config["max_retries"] == 1
    assert state.core.policy is policy and policy.config.load_weight == 0.5  # reconfigured in place
    status, config = await _call("PATCH", f"{url}/admin/config", {"policy": "round_robin", "max_concurrent_requests": 9})
    assert config["policy"] == "round_robin" and state.max_concurrent_requests == 9
    assert config["policy_config"]["load_weight"] == 0.5
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", json={"model": "sim", "prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 200
    assert 'kvgate_routing_decisions_total{policy="round_robin",worker="s0"} 1.0' in state.metrics.render().decode()


async def test_stats_and_dry_run_route(gateway, sim_worker, warm_up, wait_until):
    a, b = await sim_worker("a"), await sim_worker("b")
    url, state = await gateway(a, b)
    await warm_up(state, a)
    await warm_up(state, b)
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{a.url}/v1/completions", json={"model": "sim", "prompt": prompt, "max_tokens": 1}) as r:
            assert r.status == 200  # straight to "a": only "a" caches the prompt
    num_blocks = (len(prompt) + 1) // 4
    index = state.registry.indexes[4]
    await wait_until(lambda: index.num_blocks(("a", 0)) >= num_blocks + 1)
    blocks_before = {w: state.registry.num_index_blocks(w) for w in "ab"}
    status, route = await _call("POST", f"{url}/admin/route", {"model": "sim", "prompt": prompt})
    assert status == 200
    assert route["worker_id"] == "a" and route["ranked"] == ["a", "b"] and route["policy"] == "kv"
    assert route["num_prompt_tokens"] == len(prompt) + 1 and route["num_prompt_blocks"] == {"4": num_blocks}
    first, second = route["candidates"]
    assert (first["worker_id"], first["matched_blocks"], first["rank"]) == ("a", num_blocks, 0)
    assert (second["worker_id"], second["matched_blocks"], second["rank"]) == ("b", 0, 1)
    assert first["scores"]["prefix-match"] == 1.0 and second["scores"]["prefix-match"] == 0.0
    assert first["score"] > second["score"]
    for field in ("num_running", "num_waiting", "kv_usage", "predicted_requests", "predicted_prefill_tokens"):
        assert field in first
    # The dry run sent nothing and counted nothing.
    assert state.registry.get("a").num_requests == 0 and state.tracker.num_in_flight == 0
    assert {w: state.registry.num_index_blocks(w) for w in "ab"} == blocks_before
    # Chat bodies are told apart by their messages; bad ones get the real route's statuses.
    status, chat = await _call("POST", f"{url}/admin/route", {"model": "sim", "messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and chat["kind"] == "chat"
    assert (await _call("POST", f"{url}/admin/route", {"model": "zzz", "prompt": "x"}))[0] == 404
    assert (await _call("POST", f"{url}/admin/route", {"model": "sim", "prompt": "x", "max_tokens": -2}))[0] == 400

    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", json={"model": "sim", "prompt": prompt, "max_tokens": 1}) as r:
            assert r.headers["X-Kvgate-Worker"] == "a"
    status, stats = await _call("GET", f"{url}/admin/stats")
    assert status == 200 and stats["policy"] == "kv"
    worker = stats["workers"]["a"]
    assert (worker["health"], worker["eligible"], worker["breaker"], worker["num_requests"]) == ("healthy", True, "closed", 1)
    assert worker["num_matched_blocks"] == num_blocks and worker["prefix_hit_rate"] == 1.0
    assert worker["index_blocks"] >= num_blocks and worker["kv_events"]["num_malformed"] == 0
    assert set(worker["load"]) == {"num_running", "num_waiting", "kv_usage", "num_kv_blocks_total",
                                   "predicted_prefill_tokens", "predicted_blocks", "predicted_requests"}
    assert stats["workers"]["b"]["num_requests"] == 0 and stats["prefix_hit_rate"] == 1.0
