"""`kvgate up`: a router and N local workers, started, watched and stopped as one.

Starts `--workers N` child processes `kvgate worker --engine torch` (the reference
engine and its tiny seeded model; `--engine sim` for the timing-model worker) on free
ports (HTTP port 0, ZMQ `tcp://127.0.0.1:*`), reads each one's JSON ready line for its real URL
and endpoints, then serves the router app in this process with those workers as
static workers, and prints the URL and a curl example (after one JSON ready line,
`{"event": "ready", "url", "workers": [each worker's ready line and "pid"]}`, for scripts).

With `--disagg`, `--prefill-workers` of the workers (default 1) run `--role prefill`
and the rest `--role decode`: the router decides per request whether a decode
worker's prompt is prefilled by a prefill worker (`router.disagg`). The global
prefill queue is `--redis URL` when given; otherwise this process hosts an in-process
`kvstore.memory_queue.MemoryPrefillQueue`, hands it to the router and serves it to the
workers over loopback HTTP (`kvstore.queue_server`), guarded by a random token passed
to the children in their environment.

Invariants:
- Every child started is stopped: on SIGTERM or Ctrl-C, on a startup failure, or on
  any error, each child gets SIGTERM, then SIGKILL after `--stop-timeout` seconds;
  if this process is killed outright, Linux sends every child SIGTERM (a parent-death
  signal set in the child).
- A child that exits while the fleet runs is reported on stderr with its exit code;
  the router keeps serving with the others (its health checks drop the dead one).
- Children do not inherit `KVGATE_*` variables: those configure this command, and
  would otherwise reconfigure every worker too.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import os
import secrets
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from router.app import GATEWAY
from router.router_cmd import (
    add_router_arguments, build_or_exit, freeze_startup_objects, gateway_config, setup_logging, start_app,
)
from kvstore.memory_queue import MemoryPrefillQueue
from kvstore.prefill_queue import PrefillQueue
from kvstore.queue_server import QueueServer
from router.worker_spec import SpecError, WorkerSpec, spec_from_dict

ENGINES = ("torch", "sim")  # what `kvgate worker --engine` runs

logger = logging.getLogger("kvgate.up")
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
_FREE_ZMQ = "tcp://127.0.0.1:*"
_PR_SET_PDEATHSIG = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_router_arguments(parser)
    fleet = parser.add_argument_group("local workers")
    fleet.add_argument("--engine", choices=ENGINES, default="torch",
                       help="the workers' engine: torch (the reference model, default) or sim (a timing model)")
    fleet.add_argument("--workers", type=int, default=2, help="how many workers to start")
    fleet.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker")
    fleet.add_argument("--speedup", type=float, default=1.0, help="sim engine: run its timing model this many times faster")
    fleet.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                       help="extra argument for every `kvgate worker` (repeatable, e.g. --worker-arg=--max-num-seqs=64)")
    fleet.add_argument("--startup-timeout", type=float, default=30.0, help="seconds a worker may take to be ready")
    fleet.add_argument("--stop-timeout", type=float, default=10.0, help="seconds a worker gets to exit on SIGTERM")
    disagg = parser.add_argument_group("disaggregation")
    disagg.add_argument("--disagg", action="store_true",
                        help="run prefill workers beside decode workers; the router sends long prefills to them")
    disagg.add_argument("--prefill-workers", type=int, default=1, help="with --disagg: how many of --workers prefill")
    disagg.add_argument("--redis", default="",
                        help="with --disagg: the global prefill queue's Redis URL (default: an in-process queue)")


@dataclass(frozen=True, slots=True)
class QueuePlan:
    """Where the prefill queue lives: the URL and token the workers use, the router's queue."""

    worker_url: str
    worker_token: str
    router_queue: PrefillQueue | None  # the in-process queue; None: the router opens the URL itself
    server: QueueServer | None


@dataclass
class Child:
    name: str
    process: asyncio.subprocess.Process
    ready: dict[str, Any] | None = None
    stopping: bool = False


def _worker_command(args: argparse.Namespace, name: str, model: str | None, role: str, queue_url: str) -> list[str]:
    roles = ("--role", role, "--prefill-queue", queue_url) if role != "both" else ()
    return [
        sys.executable, "-m", "router.cli", "worker", "--engine", args.engine, "--host", "127.0.0.1", "--port", "0",
        "--worker-id", name, *(("--model", model) if model else ()), "--block-size", str(args.block_size),
        "--num-blocks", str(args.num_blocks), "--tokenizer", args.tokenizer,
        *(("--speedup", str(args.speedup)) if args.engine == "sim" else ()),
        "--events-endpoint", _FREE_ZMQ, "--replay-endpoint", _FREE_ZMQ, "--load-endpoint", _FREE_ZMQ,
        "--log-level", args.log_level, *roles, *args.worker_arg,
    ]


def _child_env(queue_token: str = "") -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVGATE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (_REPO_ROOT, env.get("PYTHONPATH"))))
    if queue_token:
        env["KVGATE_PREFILL_QUEUE_TOKEN"] = queue_token  # not on the command line, where `ps` shows it
    return env


async def _start_child(
    args: argparse.Namespace, name: str, model: str | None, role: str = "both", queue: QueuePlan | None = None
) -> Child:
    queue_url, token = (queue.worker_url, queue.worker_token) if queue is not None else ("", "")
    process = await asyncio.create_subprocess_exec(
        *_worker_command(args, name, model, role, queue_url), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, env=_child_env(token), preexec_fn=_die_with_parent,
    )
    return Child(name, process)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it if this process dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


async def _open_queue(args: argparse.Namespace) -> QueuePlan | None:
    """The prefill queue of a `--disagg` fleet (None without `--disagg`)."""
    if not args.disagg:
        return None
    if args.redis:
        return QueuePlan(args.redis, "", None, None)
    queue = MemoryPrefillQueue()
    await queue.start()
    token = secrets.token_urlsafe(24)
    server = QueueServer(queue, host="127.0.0.1", port=0, token=token)
    return QueuePlan(await server.start(), token, queue, server)


async def _close_queue(plan: QueuePlan | None) -> None:
    if plan is not None and plan.server is not None:
        await plan.server.stop()
    if plan is not None and plan.router_queue is not None:
        await plan.router_queue.close()


def _roles(args: argparse.Namespace) -> list[str]:
    if not args.disagg:
        return ["both"] * args.workers
    return ["prefill"] * args.prefill_workers + ["decode"] * (args.workers - args.prefill_workers)


async def _read_ready(child: Child, timeout_s: float) -> dict[str, Any]:
    """The child's ready line; `RuntimeError` if it exits or stays silent too long."""
    assert child.process.stdout is not None
    async with asyncio.timeout(timeout_s):
        while True:
            line = await child.process.stdout.readline()
            if not line:
                code = await child.process.wait()
                raise RuntimeError(f"worker {child.name} exited with code {code} before it was ready")
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not the ready line: workers log to stderr, but be lenient
            if isinstance(message, dict) and message.get("event") == "ready":
                return message


async def _all_ready(children: list[Child], timeout_s: float, stop: asyncio.Event) -> bool:
    """Fills every child's ready line; False if stopped first. Raises the first failure."""

    async def read_all() -> None:
        async with asyncio.TaskGroup() as group:  # one failure cancels the other reads
            for child in children:
                group.create_task(_set_ready(child, timeout_s))

    startup = asyncio.create_task(read_all())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([startup, stopped], return_when=asyncio.FIRST_COMPLETED)
    for task in (startup, stopped):
        task.cancel()
    await asyncio.wait([startup, stopped])
    if stop.is_set():
        return False
    error = startup.exception()
    if isinstance(error, BaseExceptionGroup):
        raise error.exceptions[0]
    return True


async def _set_ready(child: Child, timeout_s: float) -> None:
    child.ready = await _read_ready(child, timeout_s)


def _spec(child: Child) -> WorkerSpec:
    ready = child.ready or {}
    body = {key: ready.get(key) for key in ("worker_id", "url", "model", "events_endpoint", "replay_endpoint",
                                            "load_endpoint", "block_size", "role")}
    try:
        return spec_from_dict(body, where=f"worker {child.name}'s ready line")
    except SpecError as exc:
        raise RuntimeError(str(exc)) from None


async def _drain_stdout(child: Child) -> None:
    """Keeps reading a child's stdout so it can never block on a full pipe."""
    assert child.process.stdout is not None
    while await child.process.stdout.readline():
        pass


async def _watch(child: Child) -> None:
    code = await child.process.wait()
    if not child.stopping:
        message = f"kvgate up: worker {child.name} (pid {child.process.pid}) exited with code {code}"
        print(message, file=sys.stderr, flush=True)


async def _stop_children(children: list[Child], timeout_s: float) -> None:
    for child in children:
        child.stopping = True
        if child.process.returncode is None:
            child.process.send_signal(signal.SIGTERM)
    waits = [asyncio.create_task(child.process.wait()) for child in children]
    if not waits:
        return
    _, pending = await asyncio.wait(waits, timeout=timeout_s)
    for child in children:
        if child.process.returncode is None:
            logger.warning("worker %s did not stop in %.0f s: killing it", child.name, timeout_s)
            child.process.kill()
    if pending:
        await asyncio.wait(pending)


async def _wait_healthy(app: web.Application, timeout_s: float) -> None:
    """Returns once the router's health checks passed for every worker, so the first
    request after the banner is served (and can be prefilled remotely)."""
    registry = app[GATEWAY].registry
    async with asyncio.timeout(timeout_s):
        while not all(worker.health.is_healthy for worker in registry.workers.values()):
            await asyncio.sleep(0.02)


def _banner(url: str, model: str, engine: str, children: list[Child], queue: QueuePlan | None) -> str:
    workers = [{**(child.ready or {}), "pid": child.process.pid} for child in children]
    ready = {"event": "ready", "url": url, "workers": workers}
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "stream": True})
    fleet = f"{len(children)} {engine} worker(s)"
    if queue is not None:
        roles = [(child.ready or {}).get("role") for child in children]
        where = "Redis" if queue.router_queue is None else "an in-process queue"
        fleet = f"{roles.count('decode')} decode + {roles.count('prefill')} prefill {engine} workers ({where})"
    return "\n".join((
        json.dumps(ready),
        f"kvgate is up: {url} routes to {fleet} serving {model!r}.",
        "Try:",
        f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
        f"Admin: {url}/admin/stats   Metrics: {url}/metrics   Stop: Ctrl-C",
    ))


async def _up(args: argparse.Namespace, model: str | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    children: list[Child] = []
    tasks: list[asyncio.Task[None]] = []
    runner: web.AppRunner | None = None
    queue: QueuePlan | None = None
    try:
        queue = await _open_queue(args)
        for position, role in enumerate(_roles(args)):
            name = f"{args.engine}-{position}" if role == "both" else f"{args.engine}-{role}-{position}"
            children.append(await _start_child(args, name, model, role, queue))
        if not await _all_ready(children, args.startup_timeout, stop):
            return 0
        model = model or children[0].ready["model"]  # type: ignore[index]
        tasks = [asyncio.create_task(coro) for child in children for coro in (_watch(child), _drain_stdout(child))]
        config = gateway_config(args, tuple(_spec(child) for child in children))
        app = build_or_exit(config, queue.router_queue if queue is not None else None)
        runner, url = await start_app(app, args.host, args.port)
        await _wait_healthy(app, args.startup_timeout)
        freeze_startup_objects()
        print(_banner(url, model, args.engine, children, queue), flush=True)
        await stop.wait()
        logger.info("stopping")
        return 0
    except (RuntimeError, TimeoutError, OSError) as exc:
        reason = "a worker was not ready in time" if isinstance(exc, TimeoutError) else str(exc)
        print(f"kvgate up: {reason}", file=sys.stderr, flush=True)
        return 1
    finally:
        if runner is not None:
            await runner.cleanup()
        await _stop_children(children, args.stop_timeout)
        await _close_queue(queue)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise SystemExit("kvgate up: --workers must be at least 1")
    if args.disagg and not 1 <= args.prefill_workers < args.workers:
        raise SystemExit("kvgate up: with --disagg, --prefill-workers must be >= 1 and < --workers")
    if args.redis and not args.disagg:
        raise SystemExit("kvgate up: --redis is the prefill queue of --disagg; add --disagg")
    if args.prefill_queue and args.redis != args.prefill_queue:
        raise SystemExit("kvgate up: use --disagg --redis URL for the prefill queue, not --prefill-queue")
    args.prefill_queue = args.redis  # the router opens Redis itself; the in-process queue is handed in
    if not 0 <= args.port <= 65535:
        raise SystemExit("kvgate up: --port must be in [0, 65535]")
    setup_logging(args.log_level)
    model = args.model  # None: each engine's own default, read from the ready lines
    gateway_config(args, ())  # validates every router flag before any child starts
    return uvloop.run(_up(args, model))
