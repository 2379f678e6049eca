"""`kvgate router`: the gateway process, and the flags and server startup `kvgate up` reuses.

Turns flags (with the CLI's config-file and `KVGATE_*` layering) into a validated
`GatewayConfig`, builds the app (`router.app`), serves it on uvloop with handler
cancellation (a client that disconnects aborts its upstream request) through
`router.runner.GatewayRunner` with no access log, prints one JSON line
`{"event": "ready", "url": ...}` on stdout once listening, and on SIGTERM or SIGINT
stops accepting, closes every connection, probe and feed, and exits 0. Logs go to
stderr. Once serving, the process freezes its startup objects out of the cyclic
garbage collector's reach (`freeze_startup_objects`).

Disaggregation (`router.disagg`) is on with `--prefill-queue URL` (Redis, or kvgate's
queue server over HTTP with `--prefill-queue-token`); `kvgate up` may instead hand its in-process queue
to `build_or_exit(config, prefill_queue=...)`.

Workers come from `--worker` (repeatable: `URL` or `id=..,url=..,events=..,replay=..,
load=..,model=..,role=..,block_size=..`), from `--workers-file` (TOML `[[workers]]`,
YAML or JSON `workers:` list of admin-API bodies), from `[[router.worker]]` tables in
the `--config` file, and at runtime from the admin API.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import sys
from collections.abc import Mapping
from typing import Any

import uvloop
from aiohttp import web

from indexer.tokenizer import TokenizerError
from router.app import build_app
from kvstore.prefill_queue import PrefillQueue
from router.breaker import BreakerConfig
from router.disagg import DisaggConfig
from router.gateway import GatewayConfig
from router.health import HealthConfig
from router.policy import DEFAULT_POLICY, POLICY_NAMES, PolicyConfigError, load_config
from router.proxy import ProxyConfig
from router.requests import RequestLimits
from router.runner import GatewayRunner
from router.worker_spec import SpecError, WorkerSpec, collect_specs

logger = logging.getLogger("kvgate.router")


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of the gateway itself (shared with `kvgate up`)."""
    net = parser.add_argument_group("gateway")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    net.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    net.add_argument("--model", help="model of --worker entries that name none")
    net.add_argument("--block-size", type=int, default=16, help="KV block size of workers that name none")
    net.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path (must match the workers)")
    net.add_argument("--policy", choices=POLICY_NAMES, default=DEFAULT_POLICY, help="routing policy")
    net.add_argument("--policy-config", help="JSON object of policy weights and thresholds (see GET /admin/config)")
    net.add_argument("--api-key", action="append", default=[], help="API key accepted on /v1 (repeatable)")
    net.add_argument("--admin-token", help="bearer token the /admin API demands (env: KVGATE_ADMIN_TOKEN)")
    net.add_argument("--log-level", default="INFO", help="logging level (to stderr)")
    net.add_argument("--no-prompt-token-ids", action="store_true",
                     help="do not forward the router's token ids to workers as prompt_token_ids")
    limits = parser.add_argument_group("limits and timeouts")
    limits.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024, help="largest request body (413 above)")
    limits.add_argument("--max-prompt-tokens", type=int, default=131072, help="longest prompt (413 above)")
    limits.add_argument("--max-concurrent-requests", type=int, default=4096, help="requests in flight (429 above)")
    limits.add_argument("--max-retries", type=int, default=2, help="retries on other workers before the first byte")
    limits.add_argument("--retry-backoff", type=float, default=0.01, help="seconds before the first retry (doubles)")
    limits.add_argument("--connect-timeout", type=float, default=2.0, help="seconds to connect to a worker")
    limits.add_argument("--read-timeout", type=float, default=300.0, help="longest silence inside a worker's answer")
    limits.add_argument("--request-timeout", type=float, default=0.0, help="whole-request limit in seconds (0: none)")
    health = parser.add_argument_group("health checks and circuit breaker")
    health.add_argument("--health-interval", type=float, default=1.0, help="seconds between probes of a worker")
    health.add_argument("--health-timeout", type=float, default=1.0, help="seconds a probe may take")
    health.add_argument("--health-fail-threshold", type=int, default=2, help="failed probes that take a worker out")
    health.add_argument("--health-pass-threshold", type=int, default=2, help="passed probes that bring it back")
    health.add_argument("--breaker-failures", type=int, default=5, help="consecutive failures that open the breaker")
    health.add_argument("--breaker-open-time", type=float, default=5.0, help="seconds the breaker stays open")
    health.add_argument("--load-max-age", type=float, default=2.0, help="seconds a load report stays fresh")
    health.add_argument("--replay-timeout", type=float, default=1.0, help="seconds to wait for a KV event replay")
    health.add_argument("--worker-expiry", type=float, default=60.0,
                        help="seconds a self-registered worker may be down without re-registering before it is removed")
    disagg = parser.add_argument_group("disaggregation (conditional decode-first)")
    disagg.add_argument("--prefill-queue", default="", metavar="URL",
                        help="global prefill queue: redis://, rediss://, unix:// or the http(s):// URL of kvgate's "
                             "queue server; enables disaggregation (default: off)")
    disagg.add_argument("--prefill-queue-token", metavar="TOKEN",
                        help="bearer token of kvgate's queue server (http(s) queues; env: KVGATE_PREFILL_QUEUE_TOKEN)")
    disagg.add_argument("--max-local-prefill-tokens", type=int, default=512,
                        help="uncached prompt tokens a decode worker prefills itself; above: remote prefill")
    disagg.add_argument("--max-prefill-queue-depth", type=int, default=32,
                        help="prefill jobs in the queue at which prefill stays local")
    disagg.add_argument("--prefill-queue-poll-interval", type=float, default=0.05,
                        help="seconds between reads of the prefill queue's depth")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_router_arguments(parser)
    workers = parser.add_argument_group("workers")
    workers.add_argument("--worker", action="append", default=[], metavar="SPEC",
                         help="a worker: URL, or id=..,url=..,events=..,replay=..,load=..,model=..,block_size=..")
    workers.add_argument("--workers-file", help="TOML, YAML or JSON file with a 'workers' list")


def gateway_config(args: argparse.Namespace, workers: tuple[WorkerSpec, ...]) -> GatewayConfig:
    """The validated config; `SystemExit` naming the flag or field on any error."""
    try:
        policy_config = load_config(_json_object(args.policy_config, "--policy-config"))
        return GatewayConfig(
            workers=workers, policy=args.policy, policy_config=policy_config, tokenizer=args.tokenizer,
            limits=RequestLimits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens),
            proxy=ProxyConfig(
                connect_timeout_s=args.connect_timeout, read_timeout_s=args.read_timeout,
                request_timeout_s=args.request_timeout, max_retries=args.max_retries,
                retry_backoff_s=args.retry_backoff,
            ),
            health=HealthConfig(
                interval_s=args.health_interval, timeout_s=args.health_timeout,
                fail_threshold=args.health_fail_threshold, pass_threshold=args.health_pass_threshold,
            ),
            breaker=BreakerConfig(failure_threshold=args.breaker_failures, open_s=args.breaker_open_time),
            disagg=DisaggConfig(
                prefill_queue_url=args.prefill_queue or "", max_local_prefill_tokens=args.max_local_prefill_tokens,
                max_prefill_queue_depth=args.max_prefill_queue_depth,
                poll_interval_s=args.prefill_queue_poll_interval, prefill_queue_token=args.prefill_queue_token or None,
            ),
            max_concurrent_requests=args.max_concurrent_requests,
            api_keys=tuple(args.api_key), admin_token=args.admin_token or None,
            forward_token_ids=not args.no_prompt_token_ids,
            load_max_age_s=args.load_max_age, replay_timeout_s=args.replay_timeout,
            worker_expiry_s=args.worker_expiry,
        )
    except (ValueError, PolicyConfigError) as exc:
        raise SystemExit(f"kvgate: {exc}") from None


def _json_object(value: Any, flag: str) -> Mapping[str, Any] | None:
    if value is None or isinstance(value, Mapping):
        return value  # a table from the --config file arrives already decoded
    try:
        decoded = json.loads(value)
    except ValueError as exc:
        raise SystemExit(f"kvgate: {flag}: not JSON: {exc}") from None
    if not isinstance(decoded, dict):
        raise SystemExit(f"kvgate: {flag}: expected a JSON object")
    return decoded


def static_workers(args: argparse.Namespace) -> tuple[WorkerSpec, ...]:
    defaults = {"model": args.model, "block_size": args.block_size}
    try:
        return tuple(collect_specs(args.worker, args.workers_file, defaults))
    except SpecError as exc:
        raise SystemExit(f"kvgate router: {exc}") from None


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


async def start_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Serves `app` (handler cancellation on, no access log); returns the runner and URL."""
    runner = GatewayRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return runner, f"http://{shown}:{bound_port}"


def freeze_startup_objects() -> None:
    """Moves everything alive once the app is serving out of the cyclic GC's reach.

    Modules, the app and its config live as long as the process; without this, every
    full collection walks them all again (a few percent of the CPU of a busy router).
    Only for a process that serves the app: never in a test process.
    """
    gc.collect()
    gc.freeze()


def build_or_exit(config: GatewayConfig, prefill_queue: PrefillQueue | None = None) -> web.Application:
    """The app (see `router.app.build_app`); `SystemExit` naming the field on invalid config."""
    try:
        return build_app(config, prefill_queue)
    except (TokenizerError, PolicyConfigError, ValueError) as exc:
        raise SystemExit(f"kvgate: {exc}") from None


async def _serve(app: web.Application, args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        runner, url = await start_app(app, args.host, args.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        return 1
    freeze_startup_objects()
    print(json.dumps({"event": "ready", "url": url}), flush=True)
    logger.info("kvgate router listening at %s (policy %s)", url, args.policy)
    try:
        await stop.wait()
        logger.info("shutting down")
    finally:
        await runner.cleanup()
    return 0


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise SystemExit("kvgate router: --port must be in [0, 65535]")
    setup_logging(args.log_level)
    config = gateway_config(args, static_workers(args))
    if args.host not in ("127.0.0.1", "localhost", "::1") and config.admin_token is None:
        logger.warning("listening on %s with no --admin-token: the admin API is open to the network", args.host)
    app = build_or_exit(config)
    return uvloop.run(_serve(app, args))
