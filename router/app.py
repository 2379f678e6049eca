"""The gateway's aiohttp application: its factory, its lifecycle and the OpenAI-facing routes.

Owns `build_app(config, prefill_queue=None)`: validates the whole `GatewayConfig` up
front (tokenizer, policy, limits, disaggregation), and opens every resource in one
`cleanup_ctx` (the `Gateway` state of `router.gateway`: registry with its health
probes and ZMQ feeds, the upstream connection pool, static workers, the prefill queue
and its depth poller) so that closing the app closes everything. A caller that hosts
its own prefill queue (`kvgate up`'s in-process one) passes it, started, as
`prefill_queue`: the app uses it but never starts or closes it; a queue the app opens
from `DisaggConfig.prefill_queue_url` it starts and closes itself. Routes:
`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
`GET /ready`, `GET /metrics`, and the admin API under `/admin` (`router.admin`).

The request path (`serve`): API key, admission limit (429), read (413 over
`max_body_bytes`), parse and tokenize once (`router.requests`), route
(`router.routing`), forward (`router.proxy`). No logging on it, and its metrics are
plain counters (`router.metrics`). The app's routes call it; `router.runner`, which
`kvgate router` and `kvgate up` serve the app with, calls it directly for the two
POST routes (skipping aiohttp's routing and middleware chain, with the same results).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from aiohttp import web

from indexer.tokenizer import Tokenizer, load_tokenizer
from kvstore.prefill_queue import PrefillQueue
from router.admin import build_admin_app
from router.errors import GatewayError, NoEligibleWorker, RateLimited, error_middleware
from router.gateway import CONFIG, GATEWAY, Gateway, GatewayConfig
from router.metrics import CONTENT_TYPE
from router.policy import Policy, build_policy
from router.policy.filters.role import SERVING_ROLES
from router.policy.config import load_config
from router.proxy import CLIENT_GONE
from router.requests import CHAT, COMPLETIONS, parse_request

# The OpenAI routes `serve` answers, by request kind.
OPENAI_ROUTES = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}


def build_app(config: GatewayConfig, prefill_queue: PrefillQueue | None = None) -> web.Application:
    """The router app; invalid config raises here (ValueError subclasses naming the field).

    Disaggregation is active when `config.disagg.prefill_queue_url` is set or
    `prefill_queue` (already started, owned by the caller) is given; not both.
    """
    if prefill_queue is not None and not isinstance(prefill_queue, PrefillQueue):
        raise TypeError(f"prefill_queue must be a PrefillQueue, not {type(prefill_queue).__name__}")
    if prefill_queue is not None and config.disagg.prefill_queue_url:
        raise ValueError("prefill_queue_url: set a prefill queue URL or hand in a queue, not both")
    tokenizer = load_tokenizer(config.tokenizer)
    policy = build_policy(config.policy, load_config(config.policy_config))
    app = web.Application(middlewares=[error_middleware], client_max_size=config.limits.max_body_bytes)
    app[CONFIG] = config
    app.cleanup_ctx.append(_gateway_ctx(tokenizer, policy, prefill_queue))
    app.router.add_post(OPENAI_ROUTES[COMPLETIONS], completions)
    app.router.add_post(OPENAI_ROUTES[CHAT], chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.add_subapp("/admin", build_admin_app(config.admin_token))
    return app


def _gateway_ctx(tokenizer: Tokenizer, policy: Policy, prefill_queue: PrefillQueue | None):  # noqa: ANN202
    async def context(app: web.Application) -> AsyncIterator[None]:
        gateway = Gateway(app[CONFIG], tokenizer, policy, prefill_queue)
        app[GATEWAY] = gateway
        try:
            for spec in app[CONFIG].workers:
                await gateway.registry.add(spec)
            await gateway.start()
            yield
        finally:
            await gateway.close()

    return context


# -- OpenAI routes -------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, request.app[GATEWAY], COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, request.app[GATEWAY], CHAT)


async def serve(request: web.Request, gateway: Gateway, kind: str) -> web.StreamResponse:
    """One completions or chat request, from its body to the worker's last byte."""
    started = time.perf_counter()
    status = 500
    try:
        gateway.authorize(request)
        if gateway.num_in_flight >= gateway.max_concurrent_requests:
            raise RateLimited(f"the router is serving its limit of {gateway.max_concurrent_requests} requests")
        gateway.num_in_flight += 1
        try:
            raw = await _read_body(request, gateway.limits.max_body_bytes)
            parsed = parse_request(
                raw, kind, gateway.tokenizer, gateway.limits, forward_token_ids=gateway.forward_token_ids
            )
            decision = gateway.core.route(parsed, gateway.next_request_id())
            response = await gateway.forwarder.forward(request, parsed, decision, gateway.core, started)
        finally:
            gateway.num_in_flight -= 1
        status = CLIENT_GONE if decision.client_gone else response.status
        return response
    except (GatewayError, web.HTTPException) as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = CLIENT_GONE
        raise
    finally:
        gateway.metrics.route(OPENAI_ROUTES[kind]).observe(status, time.perf_counter() - started)


async def _read_body(request: web.Request, max_bytes: int) -> bytes:
    """The whole body, as `request.read()` returns it, with no await when it all came with the head."""
    content = request.content
    if not content.is_eof():
        return await request.read()
    raw = content.read_nowait()
    if len(raw) >= max_bytes:  # the limit exactly as `request.read()` applies it
        raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=len(raw))
    return raw


async def models(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    gateway.authorize(request)
    data = [
        {"id": model, "object": "model", "created": gateway.started_at, "owned_by": "kvgate"}
        for model in gateway.registry.healthy_models(SERVING_ROLES)  # prefill workers answer no client
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """200 while the router runs; an unreachable prefill queue only makes prefill local."""
    monitor = request.app[GATEWAY].prefill_monitor
    queue = {"configured": monitor is not None, "available": monitor is not None and monitor.is_available}
    return web.json_response({"status": "ok", "prefill_queue": queue})


async def ready(request: web.Request) -> web.Response:
    """200 once some worker that answers clients is in rotation: a load balancer may send traffic here."""
    # NOTE: prefill-only workers never answer a client (the `role` filter), so they do not count.
    num_eligible = sum(1 for w in request.app[GATEWAY].registry.eligible() if w.spec.role in SERVING_ROLES)
    if not num_eligible:
        raise NoEligibleWorker("no worker is in rotation yet")
    return web.json_response({"status": "ready", "num_eligible_workers": num_eligible})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[GATEWAY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
