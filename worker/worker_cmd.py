"""`kvgate worker`: one worker process: an engine, its OpenAI HTTP server and its publishers.

Builds the engine named by `--engine` (`sim`, the simulated engine, or `torch`, the
reference engine and model, whose flags live in `worker/torch_cmd.py`), serves it with
`worker.server`, and once the HTTP port and the ZMQ endpoints are bound prints ONE
JSON line on stdout:

    {"event": "ready", "url", "events_endpoint", "replay_endpoint", "load_endpoint",
     "worker_id", "model", "block_size"}

Port 0 (HTTP) and `:0` or `:*` (ZMQ) pick free ports; the ready line has the real ones,
which is how `kvgate up` and the tests find them. Logs go to stderr only.

With `--router URL` the worker registers itself through the router's admin API
(`POST {router}/admin/workers`), re-posts the same body every `--heartbeat-interval`
seconds (the router answers 200 to an identical re-registration), and deregisters
(`DELETE {router}/admin/workers/{id}`) on shutdown; `--router-token` (or
KVGATE_ROUTER_TOKEN) is sent as a bearer token. A router that is down only delays
registration: the worker keeps trying.

`--role decode` or `--role prefill` (with `--prefill-queue URL`) adds the worker's
half of decode-first disaggregation (`worker.disagg_service`): a decode worker has
prefill workers compute long prompts when the router asks for it, a prefill worker
serves the global prefill queue.

SIGTERM or SIGINT: deregister, stop accepting (new requests get 503), let requests in
flight finish for up to `--shutdown-timeout` seconds, stop the engine, close the
publishers and sockets, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

import uvloop
import zmq

from indexer.tokenizer import TokenizerError, load_tokenizer
from worker import torch_cmd
from worker.api import ServedModel
from kvstore.prefill_queue import QueueConfig, open_prefill_queue
from worker.disagg_service import DisaggCollector, DisaggService
from worker.registration import Registrar
from worker.server import ServerConfig, create_app, start_server
from worker.sim import SimConfig, SimEngine
from worker.sim_transfer import SimEgress, SimIngress, SimLink

if TYPE_CHECKING:
    from worker.torch_engine import TorchEngine

logger = logging.getLogger("kvgate.worker")

ENGINES = ("sim", "torch")
DEFAULT_MODEL_NAMES = {"sim": "kvgate-sim", "torch": torch_cmd.DEFAULT_MODEL_NAME}
ROLES = ("both", "decode", "prefill")
_QUEUE_DEFAULTS = QueueConfig()
# SimConfig field -> the flag that sets it, where the two names differ.
_FLAG_OF_FIELD = {"load_interval_s": "--load-interval"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--engine", choices=ENGINES, default="sim", help="the engine to run (default: sim)")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8001, help="HTTP port (0: any free port)")
    server.add_argument(
        "--model", help="the model name served, also the KV hash namespace (default: kvgate-sim or kvgate-moe-tiny)"
    )
    server.add_argument("--worker-id", help="this worker's id (default: <engine>-<hostname>-<pid>)")
    server.add_argument(
        "--role", choices=ROLES, default="both",
        help="both: aggregated serving; decode: long prompts' KV comes from prefill workers when the router "
        "asks; prefill: computes jobs from the global prefill queue",
    )
    server.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path, as the router uses")
    server.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024, help="largest request body accepted")
    server.add_argument(
        "--shutdown-timeout", type=float, default=5.0, help="seconds in-flight requests get on shutdown"
    )
    server.add_argument("--log-level", default="INFO", help="logging level (to stderr)")
    kv = parser.add_argument_group("KV cache and batching")
    kv.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    kv.add_argument("--num-blocks", type=int, default=4096, help="KV blocks in the pool")
    kv.add_argument("--max-model-len", type=int, default=0, help="max prompt + output tokens (0: the whole pool)")
    kv.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    kv.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens computed per step")
    events = parser.add_argument_group("KV events and load reports (empty string: off)")
    events.add_argument("--events-endpoint", default="tcp://127.0.0.1:5557", help="ZMQ PUB endpoint of KV events")
    events.add_argument("--replay-endpoint", default="tcp://127.0.0.1:5558", help="ZMQ ROUTER endpoint for replay")
    events.add_argument("--load-endpoint", default="tcp://127.0.0.1:5559", help="ZMQ PUB endpoint of load reports")
    events.add_argument("--load-interval", type=float, default=0.1, help="seconds between periodic load reports")
    timing = parser.add_argument_group("sim engine timing (milliseconds, divided by --speedup)")
    timing.add_argument("--speedup", type=float, default=1.0, help="run the timing model this many times faster")
    timing.add_argument("--step-overhead-ms", type=float, default=1.0, help="fixed cost of every step")
    timing.add_argument("--prefill-ms-per-token", type=float, default=0.05, help="cost per uncached prompt token")
    timing.add_argument("--decode-ms-per-step", type=float, default=12.0, help="cost of a step that decodes")
    timing.add_argument("--decode-ms-per-seq", type=float, default=0.1, help="extra cost per decoding sequence")
    disagg = parser.add_argument_group("disaggregation (--role decode or prefill)")
    disagg.add_argument(
        "--prefill-queue", default="",
        help="the global prefill queue: redis://HOST:PORT[/DB] or the http:// URL of `kvgate up`'s embedded queue",
    )
    disagg.add_argument("--prefill-queue-token", default="",
                        help="bearer token of an http:// prefill queue (env: KVGATE_PREFILL_QUEUE_TOKEN)")
    disagg.add_argument("--remote-prefill-timeout", type=float, default=30.0,
                        help="decode: seconds to wait for a remote prefill before prefilling locally")
    disagg.add_argument("--prefill-queue-idle-timeout", type=float, default=_QUEUE_DEFAULTS.idle_timeout_s,
                        help="seconds a claimed job may go unrenewed before another prefill worker takes it over "
                        "(a holder renews every third of it: use the same value on every prefill worker)")
    disagg.add_argument("--prefill-queue-max-deliveries", type=int, default=_QUEUE_DEFAULTS.max_deliveries,
                        help="deliveries of a job before it goes to the dead-letter stream")
    disagg.add_argument("--max-prefill-jobs", type=int, default=8, help="prefill: jobs run at once")
    disagg.add_argument("--kv-host", default="127.0.0.1", help="decode: address the KV receiver listens on and prefill workers write to")
    disagg.add_argument("--kv-transport", choices=("auto", "tcp", "nixl"), default="auto",
                        help="torch engine: the KV transport (auto: NIXL when installed, else TCP)")
    disagg.add_argument("--sim-kv-bytes-per-token", type=int, default=131_072,
                        help="sim engine: KV bytes per token on the modeled link")
    disagg.add_argument("--sim-kv-link-gbps", type=float, default=25.0,
                        help="sim engine: modeled KV link bandwidth, GB/s")
    torch_cmd.add_arguments(parser)
    router = parser.add_argument_group("router registration")
    router.add_argument("--router", help="router base URL to register with (e.g. http://127.0.0.1:8000)")
    router.add_argument("--router-token", help="the router's admin bearer token (env: KVGATE_ROUTER_TOKEN)")
    router.add_argument("--heartbeat-interval", type=float, default=2.0, help="seconds between re-registrations")
    router.add_argument("--advertise-url", help="URL the router should use for this worker (default: the bound one)")


def sim_config(args: argparse.Namespace) -> SimConfig:
    """The engine config from the flags; `SystemExit` naming the flag when one is invalid."""
    try:
        return SimConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            step_overhead_ms=args.step_overhead_ms,
            prefill_ms_per_token=args.prefill_ms_per_token,
            decode_ms_per_step=args.decode_ms_per_step,
            decode_ms_per_seq=args.decode_ms_per_seq,
            speedup=args.speedup,
            load_interval_s=args.load_interval,
        )
    except ValueError as exc:
        field_name, _, rest = str(exc).partition(" ")
        flag = _FLAG_OF_FIELD.get(field_name, "--" + field_name.replace("_", "-"))
        raise SystemExit(f"kvgate worker: {flag} {rest}") from None


def _check_args(args: argparse.Namespace) -> None:
    problems = []
    if not 0 <= args.port <= 65535:
        problems.append("--port must be in [0, 65535]")
    if args.max_body_bytes <= 0 or args.shutdown_timeout < 0 or args.heartbeat_interval <= 0:
        problems.append("--max-body-bytes and --heartbeat-interval must be positive, --shutdown-timeout >= 0")
    if args.model is not None and not args.model:
        problems.append("--model must not be empty")
    if args.role != "both" and torch_cmd.wants_parallel(args):
        problems.append(f"--role {args.role} runs on a single-rank worker: drop --dp, --enable-expert-parallel "
                        "and --enable-dbo, or use --role both")
    if args.role != "both" and not args.prefill_queue:
        problems.append(f"--role {args.role} needs --prefill-queue (a Redis URL or kvgate up's queue URL)")
    if args.remote_prefill_timeout <= 0 or args.max_prefill_jobs < 1:
        problems.append("--remote-prefill-timeout must be > 0 and --max-prefill-jobs >= 1")
    if not args.prefill_queue_idle_timeout > 0 or args.prefill_queue_max_deliveries < 1:
        problems.append("--prefill-queue-idle-timeout must be > 0 and --prefill-queue-max-deliveries >= 1")
    if args.sim_kv_bytes_per_token < 0 or args.sim_kv_link_gbps <= 0:
        problems.append("--sim-kv-bytes-per-token must be >= 0 and --sim-kv-link-gbps > 0")
    if not isinstance(logging.getLevelName(args.log_level.upper()), int):
        problems.append(f"--log-level must be a logging level name, got {args.log_level!r}")
    if problems:
        raise SystemExit("kvgate worker: " + "; ".join(problems))


def run(args: argparse.Namespace) -> int:
    if torch_cmd.wants_parallel(args):  # DP ranks / expert parallelism: one process per rank
        from worker import dp_worker

        return dp_worker.run(args)
    _check_args(args)
    config = sim_config(args)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except TokenizerError as exc:
        raise SystemExit(f"kvgate worker: --tokenizer: {exc}") from None
    model_name = args.model or DEFAULT_MODEL_NAMES[args.engine]
    worker_id = args.worker_id or f"{args.engine}-{socket.gethostname()}-{os.getpid()}"
    engine: SimEngine | TorchEngine
    if args.engine == "torch":
        engine = torch_cmd.build_torch_engine(args, model_name, tokenizer, worker_id)
    else:
        engine = SimEngine(
            config, ServedModel(model_name, tokenizer, config.context_len), worker_id=worker_id,
            events_endpoint=args.events_endpoint or None,
            replay_endpoint=args.replay_endpoint or None,
            load_endpoint=args.load_endpoint or None,
            remote_prefill_timeout_s=args.remote_prefill_timeout,
        )
    service = _disagg_service(args, engine, worker_id, config) if args.role != "both" else None
    return uvloop.run(_serve(args, engine, worker_id, config.block_size, service))


def _disagg_service(
    args: argparse.Namespace, engine: SimEngine | TorchEngine, worker_id: str, config: SimConfig
) -> DisaggService:
    """The decode or prefill half of this worker, over its engine's KV port."""
    try:
        # A worker's loop shares the CPU with its engine: a looser per-operation deadline
        # than the router's keeps a busy moment from reading as an outage.
        queue_config = QueueConfig(
            idle_timeout_s=args.prefill_queue_idle_timeout, max_deliveries=args.prefill_queue_max_deliveries,
            op_timeout_s=2.0,
        )
        queue = open_prefill_queue(args.prefill_queue, queue_config, token=args.prefill_queue_token or None)
    except ValueError as exc:
        raise SystemExit(f"kvgate worker: --prefill-queue: {exc}") from None
    if args.engine == "torch":
        from worker.kv_ports import torch_kv_ports  # imports torch

        ingress, egress = torch_kv_ports(engine.core, host=args.kv_host, transport=args.kv_transport)
    else:
        link = SimLink(args.sim_kv_bytes_per_token, args.sim_kv_link_gbps * 1e9, speedup=config.speedup)

        async def ingress() -> SimIngress:
            port = SimIngress(config.block_size, config.num_blocks, host=args.kv_host)
            await port.start()
            return port

        def egress() -> SimEgress:
            return SimEgress(link)

    return DisaggService(
        args.role, queue, engine, model=engine.served.name, worker_id=worker_id, block_size=config.block_size,
        ingress=ingress, egress=egress, max_jobs=args.max_prefill_jobs,
    )


async def _serve(
    args: argparse.Namespace, engine: SimEngine | TorchEngine, worker_id: str, block_size: int,
    service: DisaggService | None,
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    served = engine.served
    server_config = ServerConfig(max_body_bytes=args.max_body_bytes)
    if service is None:
        app = create_app(engine, server_config)
    else:
        app = create_app(engine, server_config, status=service.status, collectors=[DisaggCollector(service)])
        app.cleanup_ctx.append(service.cleanup_ctx)
    try:
        runner, url = await start_server(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout)
    except (OSError, zmq.ZMQError) as exc:
        logger.error("cannot start the worker: %s", exc)
        return 1
    ready = ready_message(engine, url, worker_id, block_size, role=args.role)
    print(json.dumps(ready), flush=True)
    logger.info("worker %s serving %s at %s", worker_id, served.name, url)
    registrar = None
    if args.router:
        registrar = Registrar(args.router, _registration(args, ready), args.router_token, args.heartbeat_interval)
        registrar.start()
    try:
        await stop.wait()
        logger.info("worker %s shutting down", worker_id)
    finally:
        if registrar is not None:
            await registrar.close()
        await runner.cleanup()
    return 0


def ready_message(
    engine: SimEngine | TorchEngine, url: str, worker_id: str, block_size: int, **extra: Any
) -> dict[str, Any]:
    """The JSON ready line: where this worker serves and publishes (bound addresses)."""
    kv, load = engine.kv_publisher, engine.load_publisher
    return {
        "event": "ready",
        "url": url,
        "events_endpoint": kv.bound_endpoint if kv else None,
        "replay_endpoint": kv.bound_replay_endpoint if kv else None,
        "load_endpoint": load.bound_endpoint if load else None,
        "worker_id": worker_id,
        "model": engine.served.name,
        "block_size": block_size,
        **extra,
    }


def _registration(args: argparse.Namespace, ready: dict[str, Any]) -> dict[str, Any]:
    """The admin API's worker body for this worker."""
    return {
        "worker_id": ready["worker_id"],
        "url": args.advertise_url or ready["url"],
        "role": args.role,
        "model": ready["model"],
        "events_endpoint": ready["events_endpoint"],
        "replay_endpoint": ready["replay_endpoint"],
        "load_endpoint": ready["load_endpoint"],
        "block_size": ready["block_size"],
        "dp_rank": ready.get("dp_rank", 0),
    }

