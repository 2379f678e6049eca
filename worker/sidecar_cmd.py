"""`kvgate sidecar`: runs `worker.sidecar` beside one vLLM or SGLang engine.

Turns flags into a validated `SidecarConfig`, binds the load (and, with `--relay`,
the event relay) sockets, serves the sidecar's own status on `--port` (`GET /health`:
200 with the sidecar's state while the engine is healthy, 503 otherwise; `GET
/metrics`: Prometheus counters), and prints ONE JSON line on stdout once bound:

    {"event": "ready", "url", "worker_id", "load_endpoint", "events_endpoint", "replay_endpoint"}

(`events_endpoint`/`replay_endpoint` are the relay's with `--relay`, else the
engine's). Registration with the router follows as soon as the engine is healthy.
SIGTERM or SIGINT: deregister from the router, close everything, exit 0. Logs go to
stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator, Iterator

import uvloop
import zmq
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.sidecar import HEALTHY, Sidecar, SidecarConfig

logger = logging.getLogger("kvgate.sidecar")

ROLES = ("both", "decode", "prefill")
SIDECAR = web.AppKey("sidecar", Sidecar)
METRICS = web.AppKey("metrics", CollectorRegistry)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    engine.add_argument("--engine-url", help="the engine's HTTP base URL (required), e.g. http://127.0.0.1:8000")
    engine.add_argument("--events", help="the engine's KV events endpoint, e.g. tcp://127.0.0.1:5557")
    engine.add_argument("--replay", help="the engine's KV event replay endpoint, e.g. tcp://127.0.0.1:5558")
    engine.add_argument("--topic", default="", help="KV event topic to follow with --relay (default: all)")
    engine.add_argument("--model", help="the model name to register (default: the first of /v1/models)")
    engine.add_argument("--block-size", type=int, help="the engine's KV block size (default: from /metrics, else 16)")
    engine.add_argument("--num-kv-blocks", type=int, help="the engine's KV blocks, where /metrics gives no count")
    router = parser.add_argument_group("router registration")
    router.add_argument("--router", help="the router's base URL (required)")
    router.add_argument("--router-token", help="the router's admin bearer token (env: KVGATE_ROUTER_TOKEN)")
    router.add_argument("--worker-id", help="the worker id to register (default: <hostname>-<engine port>)")
    router.add_argument("--role", choices=ROLES, default="both", help="the role announced to the router")
    router.add_argument("--advertise-url", help="the engine URL the router should use (default: --engine-url)")
    router.add_argument("--advertise-host", help="host put in place of a wildcard in bound endpoints")
    router.add_argument("--heartbeat-interval", type=float, default=2.0, help="seconds between re-registrations")
    relay = parser.add_argument_group("event relay and load reports")
    relay.add_argument("--relay", action="store_true", help="republish the engine's KV events (with replay)")
    relay.add_argument("--relay-endpoint", default="tcp://127.0.0.1:5567", help="where the relay publishes")
    relay.add_argument("--relay-replay-endpoint", default="tcp://127.0.0.1:5568", help="the relay's replay socket")
    relay.add_argument("--load-endpoint", default="tcp://127.0.0.1:5569", help="where load reports are published")
    relay.add_argument("--scrape-interval", type=float, default=0.1, help="seconds between /metrics scrapes")
    relay.add_argument("--replay-timeout", type=float, default=1.0, help="seconds to wait for the engine's replay")
    health = parser.add_argument_group("engine health")
    health.add_argument("--health-interval", type=float, default=0.5, help="seconds between /health probes")
    health.add_argument("--health-timeout", type=float, default=1.0, help="seconds a probe (or scrape) may take")
    health.add_argument("--fail-threshold", type=int, default=2, help="failed probes that make the engine unhealthy")
    health.add_argument("--deregister-after", type=float, default=10.0,
                        help="seconds an unhealthy engine stays registered before it is deregistered")
    status = parser.add_argument_group("the sidecar's own status server")
    status.add_argument("--host", default="127.0.0.1", help="address of the sidecar's /health and /metrics")
    status.add_argument("--port", type=int, default=8100, help="port of the sidecar's /health and /metrics (0: any)")
    status.add_argument("--log-level", default="INFO", help="logging level (to stderr)")


def sidecar_config(args: argparse.Namespace) -> SidecarConfig:
    """The validated config; `SystemExit` naming the flag on any error."""
    missing = [flag for flag, value in (("--engine-url", args.engine_url), ("--router", args.router)) if not value]
    if missing:
        raise SystemExit(f"kvgate sidecar: {' and '.join(missing)} required")
    if args.replay and not args.events:
        raise SystemExit("kvgate sidecar: --replay needs --events")
    if not 0 <= args.port <= 65535:
        raise SystemExit("kvgate sidecar: --port must be in [0, 65535]")
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        raise SystemExit(f"kvgate sidecar: --log-level must be a logging level name, got {args.log_level!r}")
    try:
        return SidecarConfig(
            engine_url=args.engine_url, router_url=args.router, events_endpoint=args.events or None,
            replay_endpoint=args.replay or None, worker_id=args.worker_id, role=args.role, model=args.model,
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, relay=args.relay,
            relay_endpoint=args.relay_endpoint, relay_replay_endpoint=args.relay_replay_endpoint,
            load_endpoint=args.load_endpoint, topic=args.topic, advertise_host=args.advertise_host,
            advertise_url=args.advertise_url, router_token=args.router_token,
            heartbeat_interval_s=args.heartbeat_interval, health_interval_s=args.health_interval,
            health_timeout_s=args.health_timeout, fail_threshold=args.fail_threshold,
            deregister_after_s=args.deregister_after, scrape_interval_s=args.scrape_interval,
            replay_timeout_s=args.replay_timeout,
        )
    except ValueError as exc:
        # The fields are named after the flags: `health_interval_s` is --health-interval.
        field_name, _, rest = str(exc).partition(" ")
        flag = "--" + field_name.removesuffix("_s").replace("_", "-")
        flag = {"--router-url": "--router"}.get(flag, flag)
        raise SystemExit(f"kvgate sidecar: {flag} {rest}") from None


class _SidecarCollector(Collector):
    """The sidecar's counters, read at scrape time."""

    def __init__(self, sidecar: Sidecar) -> None:
        self._sidecar = sidecar

    def collect(self) -> Iterator[Metric]:
        sidecar = self._sidecar
        status = sidecar.describe()
        yield GaugeMetricFamily("kvgate_sidecar_engine_healthy", "1 while the engine passes its health probes",
                                value=float(sidecar.state == HEALTHY))
        yield GaugeMetricFamily("kvgate_sidecar_registered", "1 while registered with the router",
                                value=float(status["registered"]))
        yield CounterMetricFamily("kvgate_sidecar_scrapes", "scrapes of the engine's /metrics",
                                  value=sidecar.num_scrapes)
        yield CounterMetricFamily("kvgate_sidecar_scrape_failures", "scrapes that failed",
                                  value=sidecar.num_scrape_failures)
        yield CounterMetricFamily("kvgate_sidecar_load_reports", "load reports published", value=sidecar.num_reports)
        if sidecar.relay is not None:
            for name in ("num_forwarded", "num_gaps", "num_lost", "num_restarts"):
                yield CounterMetricFamily(f"kvgate_sidecar_relay_{name.removeprefix('num_')}",
                                          f"relay batches/events: {name}", value=getattr(sidecar.relay.stats, name))


def create_app(sidecar: Sidecar) -> web.Application:
    app = web.Application()
    app[SIDECAR] = sidecar
    registry = CollectorRegistry()
    registry.register(_SidecarCollector(sidecar))
    app[METRICS] = registry
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.cleanup_ctx.append(_sidecar_ctx)
    return app


async def _sidecar_ctx(app: web.Application) -> AsyncIterator[None]:
    sidecar = app[SIDECAR]
    sidecar.start()
    yield
    await sidecar.close()


async def _health(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR]
    return web.json_response(sidecar.describe(), status=200 if sidecar.state == HEALTHY else 503)


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def run(args: argparse.Namespace) -> int:
    config = sidecar_config(args)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    return uvloop.run(_serve(args, config))


async def _serve(args: argparse.Namespace, config: SidecarConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sidecar = Sidecar(config)
    runner = web.AppRunner(create_app(sidecar), access_log=None)
    try:
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
    except (OSError, zmq.ZMQError) as exc:
        logger.error("cannot start the sidecar: %s", exc)
        await runner.cleanup()
        return 1
    host, port = runner.addresses[0][:2]
    relay = sidecar.relay
    print(json.dumps({
        "event": "ready",
        "url": f"http://{host}:{port}",
        "worker_id": sidecar.worker_id,
        "load_endpoint": sidecar.load_endpoint,
        "events_endpoint": relay.bound_endpoint if relay else config.events_endpoint,
        "replay_endpoint": relay.bound_replay_endpoint if relay else config.replay_endpoint,
    }), flush=True)
    logger.info("sidecar %s watching %s, registering with %s", sidecar.worker_id, config.engine_url, config.router_url)
    try:
        await stop.wait()
        logger.info("sidecar %s shutting down", sidecar.worker_id)
    finally:
        await runner.cleanup()
    return 0
