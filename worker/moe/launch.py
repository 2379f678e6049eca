"""Starting N local ranks of one script, torchrun-style, and collecting what they print.

Owns `launch_local_ranks`: one process per rank with torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free loopback port), gloo bound to the
loopback interface and one OpenMP thread each. Used by the expert-parallel and DBO
tests and by `bench/dbo.py`, whose rank processes run the calling script itself.

NOTE: a rank that fails leaves its peers blocked in a collective; once one rank is
reaped with an error or the timeout passes, every other rank is killed, so a caller
never waits on a hung group.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True, slots=True)
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str

    def last_line(self) -> str:
        """The last line the rank printed (where the scripts put their JSON result)."""
        lines = self.stdout.strip().splitlines()
        return lines[-1] if lines else ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local_ranks(argv: Sequence[str], world_size: int, timeout_s: float) -> list[RankResult]:
    """Runs `python *argv` as ranks 0..world_size-1 and returns each one's result."""
    port = str(_free_port())
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
            GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, (_REPO_ROOT, os.environ.get("PYTHONPATH")))),
        )
        procs.append(subprocess.Popen(
            [sys.executable, *argv], env=env, cwd=_REPO_ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    outputs: list[tuple[str, str]] = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s))
            if proc.returncode != 0:
                break
    finally:
        for proc in procs[len(outputs):]:
            proc.kill()
            outputs.append(proc.communicate())
    return [RankResult(rank, proc.returncode, out, err) for rank, (proc, (out, err)) in enumerate(zip(procs, outputs))]
