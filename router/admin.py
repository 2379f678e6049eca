"""The admin REST API under `/admin`: the fleet, the routing config, stats and dry-run routing.

Owns the operator's endpoints, mounted as a sub-app (so the root app's error
middleware renders its errors as OpenAI JSON too):

- `GET /admin/workers`, `POST /admin/workers` (201 new or replaced, 200 identical:
  a heartbeat; such registrations lapse when their worker is down and stops
  heartbeating), `GET|DELETE /admin/workers/{id}`, `POST /admin/workers/{id}/drain`
  (body `{"draining": false}` undrains);
- `GET /admin/config`, `PATCH /admin/config` (`policy`, `policy_config` with any
  weights and thresholds of `PolicyConfig`, `max_retries`, `max_concurrent_requests`,
  and the disaggregation thresholds `max_local_prefill_tokens`,
  `max_prefill_queue_depth`): validated as a whole, then applied at once, for the
  next request;
- `GET /admin/stats`: per worker health, load (reported and predicted), requests,
  prefix hit rate, index blocks and KV event counters; the prefill queue as the
  router sees it (available, depth per model with a prefill worker);
- `POST /admin/route`: a completions or chat body (told apart by `messages`), routed
  exactly as the real route would but sent nowhere: the chosen worker and every
  candidate's matched blocks, load, scores and score, and under `disagg` the prefill
  decision for the chosen worker (`router.disagg`: `prefill`, `reason`,
  `uncached_tokens`, `queue_depth`). Nothing is dispatched, so no load, counter,
  queue depth or metric changes; a policy's own rotation or random draws (round
  robin, tie-breaks) advance as for any ranking.

With an admin token configured, every endpoint wants `Authorization: Bearer <token>`
(401 otherwise), compared in constant time.
"""

from __future__ import annotations

import dataclasses
import hmac
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from router.gateway import GATEWAY, Gateway
from router.errors import BadRequest, NotFound, Unauthorized
from router.policy import POLICY_NAMES, PolicyConfigError, build_policy
from router.policy.base import Candidate
from router.registry import Worker
from router.requests import CHAT, COMPLETIONS, decode_object, parse_request
from router.worker_spec import SpecError, spec_from_dict

_DISAGG_KEYS = ("max_local_prefill_tokens", "max_prefill_queue_depth")
_CONFIG_KEYS = frozenset({"policy", "policy_config", "max_retries", "max_concurrent_requests", *_DISAGG_KEYS})


def build_admin_app(token: str | None) -> web.Application:
    app = web.Application(middlewares=[_bearer_auth(token)] if token else [])
    app.router.add_get("/workers", list_workers)
    app.router.add_post("/workers", add_worker)
    app.router.add_get("/workers/{worker_id}", get_worker)
    app.router.add_delete("/workers/{worker_id}", delete_worker)
    app.router.add_post("/workers/{worker_id}/drain", drain_worker)
    app.router.add_get("/config", get_config)
    app.router.add_patch("/config", patch_config)
    app.router.add_get("/stats", stats)
    app.router.add_post("/route", dry_run_route)
    return app


def _bearer_auth(token: str):  # noqa: ANN202 - an aiohttp middleware
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise Unauthorized("the admin API wants the admin token (Authorization: Bearer <token>)", code="invalid_admin_token")
        return await handler(request)

    return check


def _gateway(request: web.Request) -> Gateway:
    return request.config_dict[GATEWAY]


def _worker_or_404(request: web.Request) -> Worker:
    worker_id = request.match_info["worker_id"]
    worker = _gateway(request).registry.get(worker_id)
    if worker is None:
        raise NotFound(f"no worker {worker_id!r}", param="worker_id")
    return worker


def describe_worker(worker: Worker) -> dict[str, Any]:
    return {
        **worker.spec.to_dict(),
        "health": worker.health.describe(),
        "draining": worker.draining,
        "eligible": worker.is_eligible,
        "breaker": worker.breaker.describe(),
        "registered_at": worker.registered_at,
        "last_heartbeat_at": worker.last_heartbeat_at,
        "expires": worker.expires,
    }


# -- workers -------------------------------------------------------------------------


async def list_workers(request: web.Request) -> web.Response:
    workers = _gateway(request).registry.workers.values()
    return web.json_response({"workers": [describe_worker(worker) for worker in workers]})


async def add_worker(request: web.Request) -> web.Response:
    body = decode_object(await request.read())
    try:
        spec = spec_from_dict(body, where="worker")
    except SpecError as exc:
        raise BadRequest(str(exc)) from None
    worker, created = await _gateway(request).registry.add(spec, expires=True)
    return web.json_response(describe_worker(worker), status=201 if created else 200)


async def get_worker(request: web.Request) -> web.Response:
    return web.json_response(describe_worker(_worker_or_404(request)))


async def delete_worker(request: web.Request) -> web.Response:
    worker = _worker_or_404(request)
    await _gateway(request).registry.remove(worker.worker_id)
    return web.json_response({"worker_id": worker.worker_id, "removed": True})


async def drain_worker(request: web.Request) -> web.Response:
    worker = _worker_or_404(request)
    raw = await request.read()
    draining = True
    if raw.strip():
        body = decode_object(raw)
        draining = body.get("draining", True)
        if draining.__class__ is not bool:
            raise BadRequest("'draining' must be a boolean", param="draining")
    _gateway(request).registry.drain(worker.worker_id, draining)
    return web.json_response(describe_worker(worker))


# -- config --------------------------------------------------------------------------


def _config_view(gateway: Gateway) -> dict[str, Any]:
    return {
        "policy": gateway.core.policy.name,
        "policies": list(POLICY_NAMES),
        "policy_config": gateway.core.policy.config.to_dict(),
        "pipeline": gateway.core.policy.describe(),
        "max_retries": gateway.forwarder.config.max_retries,
        "max_concurrent_requests": gateway.max_concurrent_requests,
        "disagg_active": gateway.disagg.is_enabled,
        "max_local_prefill_tokens": gateway.disagg.max_local_prefill_tokens,
        "max_prefill_queue_depth": gateway.disagg.max_prefill_queue_depth,
    }


async def get_config(request: web.Request) -> web.Response:
    return web.json_response(_config_view(_gateway(request)))


async def patch_config(request: web.Request) -> web.Response:
    gateway = _gateway(request)
    body = decode_object(await request.read())
    unknown = sorted(set(body) - _CONFIG_KEYS)
    if unknown:
        raise BadRequest(f"unknown config key {unknown[0]!r} (known: {', '.join(sorted(_CONFIG_KEYS))})", param=unknown[0])
    max_retries = _optional_int(body, "max_retries", 0)
    max_concurrent = _optional_int(body, "max_concurrent_requests", 1)
    thresholds = {name: value for name in _DISAGG_KEYS if (value := _optional_int(body, name, 0)) is not None}
    current = gateway.core.policy
    name = body.get("policy", current.name)
    changes = body.get("policy_config") or {}
    if not isinstance(changes, dict):
        raise BadRequest("'policy_config' must be an object", param="policy_config")
    try:
        config = current.config.updated(changes)
        policy = build_policy(name, config) if name != current.name else None
    except PolicyConfigError as exc:
        raise BadRequest(str(exc), param=exc.field) from None
    # Everything is valid: apply it all at once.
    if policy is not None:
        gateway.core.set_policy(policy)
    else:
        current.reconfigure(config)
    if max_retries is not None:
        gateway.forwarder.config = dataclasses.replace(gateway.forwarder.config, max_retries=max_retries)
    if max_concurrent is not None:
        gateway.max_concurrent_requests = max_concurrent
    for name, value in thresholds.items():
        setattr(gateway.disagg, name, value)
    return web.json_response(_config_view(gateway))


def _optional_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if value.__class__ is not int or value < minimum:
        raise BadRequest(f"'{name}' must be an integer >= {minimum}", param=name)
    return value


# -- stats and dry run ----------------------------------------------------------------


def _load_view(candidate: Candidate | None) -> dict[str, Any] | None:
    if candidate is None:
        return None
    return {
        "num_running": candidate.num_running,
        "num_waiting": candidate.num_waiting,
        "kv_usage": candidate.kv_usage,
        "num_kv_blocks_total": candidate.num_kv_blocks_total,
        "predicted_prefill_tokens": candidate.predicted_prefill_tokens,
        "predicted_blocks": candidate.predicted_blocks,
        "predicted_requests": candidate.predicted_requests,
    }


async def stats(request: web.Request) -> web.Response:
    gateway = _gateway(request)
    registry = gateway.registry
    loads: dict[str, Candidate] = {}
    for model in {worker.spec.model for worker in registry.workers.values()}:
        loads.update((c.worker_id, c) for c in gateway.core.candidates(model))
    workers = {}
    for worker_id, worker in registry.workers.items():
        workers[worker_id] = {
            "health": worker.health.status,
            "draining": worker.draining,
            "eligible": worker.is_eligible,
            "breaker": worker.breaker.state,
            "load": _load_view(loads.get(worker_id)),
            "num_requests": worker.num_requests,
            "num_failures": worker.num_failures,
            "num_in_flight": worker.num_in_flight,
            "num_matched_blocks": worker.num_matched_blocks,
            "num_prompt_blocks": worker.num_prompt_blocks,
            "prefix_hit_rate": worker.prefix_hit_rate,
            "index_blocks": registry.num_index_blocks(worker_id),
            "kv_events": worker.event_stats(),
        }
    metrics = gateway.metrics
    total = metrics.num_prompt_blocks
    return web.json_response({
        "policy": gateway.core.policy.name,
        "num_in_flight": gateway.num_in_flight,
        "prefix_hit_rate": metrics.num_matched_blocks / total if total else 0.0,
        "index": {str(size): index.stats().num_blocks for size, index in registry.indexes.items()},
        "prefill_queue": _prefill_queue_view(gateway),
        "workers": workers,
    })


def _prefill_queue_view(gateway: Gateway) -> dict[str, Any]:
    monitor = gateway.prefill_monitor
    if monitor is None:
        return {"configured": False, "available": False, "depths": {}}
    disagg = gateway.disagg
    return {"configured": True, "available": monitor.is_available,
            "depths": {model: disagg.queue_depth(model) for model in sorted(disagg.polled_depths())}}


async def dry_run_route(request: web.Request) -> web.Response:
    gateway = _gateway(request)
    raw = await request.read()
    kind = CHAT if "messages" in decode_object(raw) else COMPLETIONS
    parsed = parse_request(raw, kind, gateway.tokenizer, gateway.limits, forward_token_ids=False)
    decision = gateway.core.route(parsed, gateway.next_request_id())
    chosen = decision.ranked[0]
    prefill = gateway.disagg.decide(decision.request, chosen, decision.candidates)
    ranks = {id(candidate): position for position, candidate in enumerate(decision.ranked)}
    candidates = sorted(decision.candidates, key=lambda c: ranks.get(id(c), len(ranks)))
    return web.json_response({
        "worker_id": chosen.worker_id,
        "url": chosen.url,
        "policy": decision.policy_name,
        "kind": kind,
        "num_prompt_tokens": decision.request.num_prompt_tokens,
        "num_prompt_blocks": {str(size): len(h) for size, h in decision.request.hashes_by_block_size.items()},
        "ranked": [candidate.worker_id for candidate in decision.ranked],
        "disagg": prefill.describe(),
        "candidates": [_candidate_view(c, ranks.get(id(c))) for c in candidates],
    })


def _candidate_view(candidate: Candidate, rank: int | None) -> dict[str, Any]:
    view = dataclasses.asdict(candidate)
    view["rank"] = rank  # None: filtered out
    return view
