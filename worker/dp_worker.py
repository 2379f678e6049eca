"""`kvgate worker --engine torch --dp N --enable-expert-parallel`: N DP ranks, each a worker.

Owns the launcher (`run`) and the rank entry (`run_rank`).

The launcher starts one process per rank with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free loopback port), forwards
SIGTERM and SIGINT to them, and waits without polling. When a rank exits while the
group is not stopping, it logs it, gives the others `--dp-liveness-timeout` plus a
grace period to notice (their participants report `DPGroupLost`) and exit, kills the
ones left, and exits 1. It exits 0 only when every rank did. When RANK and
WORLD_SIZE are already set (torchrun), the process is one rank and spawns nothing.

A rank joins the process group (gloo on CPU, NCCL on CUDA), rank 0 starts the
`DPCoordinator` and sends its address to the others over the group, every rank joins
as a `DPParticipant`, builds its engine (`worker.torch_cmd.build_dp_engine`: the same
seeded model everywhere, then sharded) and serves it like `kvgate worker`, printing
the same ready line plus "dp_rank" and "pid" (its process). A rank is a full worker to the router: its id is
`<worker-id>-dp<r>`, it registers with `--router` itself (with "dp_rank"), and has
its own addresses:
- HTTP: `--port` + r (port 0: any free port);
- ZMQ endpoints: a fixed TCP port P becomes P + 10·r (so the default 5557/5558/5559
  of neighbouring ranks never meet), `:0`/`:*` stay any free port, ipc and inproc
  names get `-dp<r>`; `--advertise-url`'s port, when it has one, + r.
A rank whose engine dies (the group lost, a failed collective) exits 1; on SIGTERM a
rank stops like `kvgate worker`, its engine draining first (`worker.dp_engine`), and
exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import multiprocessing
import os
import re
import signal
import socket
import sys
import time
from contextlib import ExitStack
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from yarl import URL

from worker import torch_cmd

if TYPE_CHECKING:
    from worker.dp_engine import DPTorchEngine

logger = logging.getLogger("kvgate.worker")

ENDPOINT_PORT_STRIDE = 10
_EXIT_GRACE_S = 5.0
_TCP_PORT = re.compile(r"^(tcp://.+):(\d+)$")


# -- per-rank addresses ----------------------------------------------------------------


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Rank `rank`'s copy of a ZMQ endpoint flag (see the module docstring)."""
    if not endpoint:
        return endpoint
    match = _TCP_PORT.match(endpoint)
    if match is not None:
        port = int(match.group(2))
        return endpoint if port == 0 else f"{match.group(1)}:{port + ENDPOINT_PORT_STRIDE * rank}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}-dp{rank}"
    return endpoint  # tcp://host:* and anything the publisher will reject by name


def rank_args(args: argparse.Namespace, rank: int, base_worker_id: str) -> argparse.Namespace:
    """The flags of rank `rank`: its worker id, HTTP port and endpoints."""
    out = copy.copy(args)
    out.worker_id = f"{base_worker_id}-dp{rank}"
    out.port = args.port + rank if args.port else 0
    for name in ("events_endpoint", "replay_endpoint", "load_endpoint"):
        setattr(out, name, rank_endpoint(getattr(args, name), rank))
    if args.advertise_url:
        url = URL(args.advertise_url)
        if url.explicit_port is not None:
            out.advertise_url = str(url.with_port(url.explicit_port + rank))
    return out


# -- the launcher ------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """`kvgate worker` with DP or EP flags: one rank under torchrun, else launch them all."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_rank(args)
    from worker import worker_cmd

    worker_cmd._check_args(args)
    torch_cmd.check_parallel_args(args, args.dp)
    _setup_logging(args)
    launched = copy.copy(args)
    launched.worker_id = args.worker_id or f"torch-{socket.gethostname()}-{os.getpid()}"
    master_port = _free_port()
    context = multiprocessing.get_context("spawn")
    procs = [
        context.Process(target=_rank_process, args=(launched, rank, args.dp, master_port), name=f"dp-rank-{rank}")
        for rank in range(args.dp)
    ]
    # After SIGTERM a rank serves, then drains, for up to --shutdown-timeout each.
    supervisor = _Supervisor(
        procs, args.dp_liveness_timeout + _EXIT_GRACE_S, 2 * args.shutdown_timeout + _EXIT_GRACE_S
    )
    for proc in procs:
        proc.start()
    return supervisor.run()


def _rank_process(args: argparse.Namespace, rank: int, num_ranks: int, master_port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(num_ranks), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(num_ranks),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch

    # The ranks share this machine's cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_ranks))
    sys.exit(run_rank(args))


class _Supervisor:
    """Waits for the rank processes without polling; see the module docstring."""

    def __init__(self, procs: list[Any], broken_grace_s: float, stop_grace_s: float) -> None:
        self._procs = procs
        self._pending: dict[int, Any] = {}
        self._broken_grace_s = broken_grace_s
        self._stop_grace_s = stop_grace_s
        self._stopping = False
        self._failed = False
        self._deadline: float | None = None
        # The signal handler runs between waits; the wakeup fd ends the wait it interrupted.
        self._wakeup, wakeup_write = socket.socketpair()
        for sock in (self._wakeup, wakeup_write):
            sock.setblocking(False)
        self._wakeup_write = wakeup_write
        signal.set_wakeup_fd(wakeup_write.fileno())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)

    def run(self) -> int:
        """Call once every process has started; returns the launcher's exit code."""
        self._pending = {proc.sentinel: proc for proc in self._procs}
        while self._pending:
            timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            ready = wait([*self._pending, self._wakeup], timeout)
            if not ready:
                self._kill_left()
            for sentinel in ready:
                if sentinel is self._wakeup:
                    self._wakeup.recv(4096)
                else:
                    self._reap(self._pending.pop(sentinel))
        signal.set_wakeup_fd(-1)
        self._wakeup.close()
        self._wakeup_write.close()
        return 1 if self._failed else 0

    def _forward(self, signum: int, _frame: Any) -> None:
        if not self._stopping:
            self._stopping = True
            self._deadline = time.monotonic() + self._stop_grace_s
        for proc in self._procs:
            if proc.pid is not None and proc.exitcode is None:
                os.kill(proc.pid, signum)

    def _reap(self, proc: Any) -> None:
        proc.join()
        # A rank stopped before its server was up dies of the forwarded signal itself.
        if self._stopping and proc.exitcode in (0, -signal.SIGTERM, -signal.SIGINT):
            return
        self._failed = True
        logger.error("DP rank %s exited with code %s", proc.name, proc.exitcode)
        if self._deadline is None and self._pending:
            self._deadline = time.monotonic() + self._broken_grace_s

    def _kill_left(self) -> None:
        for proc in self._pending.values():
            logger.error("DP rank %s did not exit in time: killing it", proc.name)
            proc.kill()
        self._deadline = None  # SIGKILL: the sentinels follow


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _setup_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )


# -- one rank ------------------------------------------------------------------------------


def run_rank(args: argparse.Namespace) -> int:
    """This process as DP rank RANK of WORLD_SIZE: join the group, build the engine, serve."""
    import torch.distributed as dist
    import uvloop

    from indexer.tokenizer import TokenizerError, load_tokenizer
    from worker import worker_cmd
    from worker.dp_engine import CommMeter
    from worker.moe.a2a_stream import CommStreamBackend
    from worker.moe.a2a_torch import init_process_group_from_env

    rank, num_ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.dp not in (1, num_ranks):
        raise SystemExit(f"kvgate worker: --dp ({args.dp}) must equal WORLD_SIZE ({num_ranks}) under torchrun")
    worker_cmd._check_args(args)
    torch_cmd.check_parallel_args(args, num_ranks)
    _setup_logging(args)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except TokenizerError as exc:
        raise SystemExit(f"kvgate worker: --tokenizer: {exc}") from None
    base_id = args.worker_id or f"torch-{socket.gethostname()}-{os.getppid()}"
    mine = rank_args(args, rank, base_id)
    if args.device == "cuda":
        mine.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    backend = init_process_group_from_env("gloo" if mine.device == "cpu" else "nccl")
    with ExitStack() as cleanup:
        cleanup.callback(dist.destroy_process_group)
        participant = _join_dp_group(args, rank, num_ranks, cleanup)
        cleanup.callback(participant.close)
        model_name = args.model or torch_cmd.DEFAULT_MODEL_NAME
        # The stream issues each dispatch's count exchange and rows behind a handle, so a
        # micro-batch yields at once and the other computes while the ranks line up.
        stream = CommStreamBackend(backend)
        cleanup.callback(stream.close)
        engine = torch_cmd.build_dp_engine(mine, model_name, tokenizer, mine.worker_id, participant, CommMeter(stream))
        return uvloop.run(_serve(mine, engine, rank))


def _join_dp_group(args: argparse.Namespace, rank: int, num_ranks: int, cleanup: ExitStack) -> Any:
    """Rank 0 starts the coordinator; its address goes to every rank over the process group."""
    import torch.distributed as dist

    from worker.dp_coordinator import DPCoordinator, DPCoordinatorConfig
    from worker.dp_participant import DPParticipant, DPParticipantConfig

    timing = {"heartbeat_interval_s": args.dp_heartbeat_interval, "liveness_timeout_s": args.dp_liveness_timeout}
    address: list[str | None] = [None]
    if rank == 0:
        host = os.environ["MASTER_ADDR"]
        is_local = host in ("127.0.0.1", "localhost")
        coordinator = DPCoordinator(
            DPCoordinatorConfig("tcp://127.0.0.1:*" if is_local else "tcp://*:*", num_ranks, **timing)
        )
        coordinator.start()
        cleanup.callback(coordinator.close)
        port = coordinator.address.rsplit(":", 1)[1]
        address[0] = f"tcp://{'127.0.0.1' if is_local else host}:{port}"
    dist.broadcast_object_list(address, src=0)
    assert address[0] is not None
    return DPParticipant(DPParticipantConfig(
        address[0], rank, register_timeout_s=max(30.0, 3 * args.dp_liveness_timeout), **timing,
    ))


async def _serve(args: argparse.Namespace, engine: DPTorchEngine, dp_rank: int) -> int:
    """`kvgate worker`'s serve loop for one rank; also returns 1 when the engine dies."""
    import zmq

    from worker import worker_cmd
    from worker.registration import Registrar
    from worker.server import METRICS, ServerConfig, create_app, start_server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = create_app(engine, ServerConfig(max_body_bytes=args.max_body_bytes))
    engine.metrics.register(app[METRICS].registry)
    try:
        runner, url = await start_server(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout)
    except (OSError, zmq.ZMQError) as exc:
        logger.error("cannot start DP rank %d: %s", dp_rank, exc)
        return 1
    ready = worker_cmd.ready_message(
        engine, url, args.worker_id, args.block_size, role=args.role, dp_rank=dp_rank, pid=os.getpid()
    )
    # NOTE: one write() per line: the ranks share the launcher's stdout.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(ready) + "\n").encode())
    logger.info("DP rank %d (worker %s) serving %s at %s", dp_rank, args.worker_id, engine.served.name, url)
    registrar = None
    if args.router:
        body = worker_cmd._registration(args, ready)
        registrar = Registrar(args.router, body, args.router_token, args.heartbeat_interval)
        registrar.start()
    try:
        ended = [asyncio.create_task(stop.wait()), asyncio.create_task(engine.dead.wait())]
        await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
        for task in ended:
            task.cancel()
        # NOTE: a stop asked for wins: ranks told to stop at once may break each other's last step.
        if engine.dead.is_set() and not stop.is_set():
            reason = engine.lost.reason if engine.lost is not None else "its engine failed"
            logger.error("DP rank %d exits: %s", dp_rank, reason)
            return 1
        logger.info("DP rank %d shutting down", dp_rank)
        return 0
    finally:
        if registrar is not None:
            await registrar.close()
        await runner.cleanup()
