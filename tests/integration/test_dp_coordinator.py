"""DP step coordinator with every rank a real process on a real ZMQ ipc socket.

Each rank runs this file as a script: a small engine loop driven by
`DPParticipant` (rank 0 also hosts the `DPCoordinator`), taking JSON-line commands
on stdin and answering `stats` on stdout. A rank starts paused, so work handed out
before `go` is seen by every rank from step 0, which makes the step counts exact.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

HEARTBEAT_S = 0.1
LIVENESS_S = 1.0
REPO_ROOT = Path(__file__).resolve().parents[2]


# --- the rank process -----------------------------------------------------------------


class _SimEngine:
    """The engine loop of one rank: real steps while it has work, else what DP says."""

    def __init__(self, address: str, dp_rank: int, num_ranks: int) -> None:
        from worker.dp_coordinator import DPCoordinator, DPCoordinatorConfig
        from worker.dp_participant import DPParticipant, DPParticipantConfig

        self.coordinator = None
        if dp_rank == 0:
            self.coordinator = DPCoordinator(DPCoordinatorConfig(
                address, num_ranks, heartbeat_interval_s=HEARTBEAT_S,
                liveness_timeout_s=LIVENESS_S,
            ))
            self.coordinator.start()
        self.part = DPParticipant(DPParticipantConfig(
            address, dp_rank, heartbeat_interval_s=HEARTBEAT_S, liveness_timeout_s=LIVENESS_S,
        ))
        self.lock = threading.Lock()
        self.num_pending = 0
        self.go = threading.Event()
        self.stopping = False
        self.lost: str | None = None

    def run(self) -> None:
        from worker.dp_participant import Decision, DPGroupLost

        self.go.wait()
        while not self.stopping:
            with self.lock:
                has_work = self.num_pending > 0
            try:
                decision = self.part.wait_for_work_or_step(has_work)
            except DPGroupLost as exc:
                self.lost = exc.reason
                return
            if decision is Decision.IDLE:
                continue
            if decision is Decision.RUN_REAL:
                time.sleep(0.002)  # a forward pass
                with self.lock:
                    self.num_pending -= 1
            self.part.finish_step()

    def stats(self) -> dict:
        part = self.part
        return {
            "local_step": part.local_step, "coord_step": part.coord_step,
            "real": part.num_real_steps, "dummy": part.num_dummy_steps,
            "idle_waits": part.num_idle_waits, "pending": self.num_pending,
            "cpu_s": time.process_time(), "lost": self.lost,
            "dead_ranks": self.coordinator.dead_ranks if self.coordinator else None,
        }

    def serve_commands(self) -> None:
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "work":
                with self.lock:
                    self.num_pending += command["steps"]
                self.part.wake()
            elif command["cmd"] == "go":
                self.go.set()
            elif command["cmd"] == "stats":
                sys.stdout.write(json.dumps(self.stats()) + "\n")
                sys.stdout.flush()
            elif command["cmd"] == "stop":
                break
        self.stopping = True
        self.go.set()
        self.part.wake()


def _rank_main(address: str, dp_rank: int, num_ranks: int) -> None:
    engine = _SimEngine(address, dp_rank, num_ranks)
    loop = threading.Thread(target=engine.run)
    loop.start()
    engine.serve_commands()
    loop.join()
    engine.part.close()
    if engine.coordinator is not None:
        engine.coordinator.close()


# --- the test side --------------------------------------------------------------------


class _Rank:
    def __init__(self, address: str, dp_rank: int, num_ranks: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, address, str(dp_rank), str(num_ranks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO_ROOT, env=env, bufsize=0,
        )
        self._buffer = b""

    def send(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")

    def stats(self, timeout_s: float = 10.0) -> dict:
        self.send(cmd="stats")
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "rank did not answer stats"
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                assert chunk, f"rank exited with {self.proc.wait()}"
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="stop")
                self.proc.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture
def start_group(tmp_path):
    groups: list[list[_Rank]] = []

    def start(num_ranks: int) -> list[_Rank]:
        address = f"ipc://{tmp_path}/dp.sock"
        ranks = [_Rank(address, r, num_ranks) for r in range(num_ranks)]
        groups.append(ranks)
        return ranks

    yield start
    for ranks in groups:
        for rank in ranks:
            rank.stop()


def _wait_until(ranks: list[_Rank], predicate, timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [rank.stats() for rank in ranks]
        if predicate(stats):
            return stats
        assert time.monotonic() < deadline, f"timed out; last stats {stats}"
        time.sleep(0.02)


def _all_idle_at(step: int):
    return lambda stats: all(
        s["local_step"] == step and s["coord_step"] == step and s["pending"] == 0
        for s in stats
    )


def test_one_request_steps_every_rank_then_all_block(start_group):
    ranks = start_group(3)
    for rank in ranks:
        rank.send(cmd="go")
    _wait_until(ranks, lambda stats: all(s["idle_waits"] >= 1 for s in stats))

    ranks[1].send(cmd="work", steps=5)
    stats = _wait_until(ranks, _all_idle_at(5))
    assert [(s["real"], s["dummy"]) for s in stats] == [(0, 5), (5, 0), (0, 5)]

    time.sleep(0.1)  # let the last idle wait begin
    before = [rank.stats() for rank in ranks]
    time.sleep(0.5)
    after = [rank.stats() for rank in ranks]
    for b, a in zip(before, after):
        assert a["cpu_s"] - b["cpu_s"] < 0.05
        assert (a["idle_waits"], a["local_step"]) == (b["idle_waits"], b["local_step"])
        assert a["lost"] is None


def test_bursts_on_several_ranks_keep_step_counts_equal(start_group):
    ranks = start_group(4)
    work = [3, 0, 7, 1]
    for rank, num_steps in zip(ranks, work):
        if num_steps:
            rank.send(cmd="work", steps=num_steps)
        rank.send(cmd="go")
    stats = _wait_until(ranks, _all_idle_at(7))
    assert [(s["real"], s["dummy"]) for s in stats] == [(3, 4), (0, 7), (7, 0), (1, 6)]

    # A second, unsynchronised burst: counts depend on arrival times, but every rank
    # must run the same number of steps and all its work as real steps.
    for rank, num_steps in zip(ranks, [0, 4, 2, 6]):
        if num_steps:
            rank.send(cmd="work", steps=num_steps)
    stats = _wait_until(ranks, lambda stats: all(s["pending"] == 0 for s in stats) and len(
        {(s["local_step"], s["coord_step"]) for s in stats}) == 1)
    assert [s["real"] for s in stats] == [3, 4, 9, 7]
    assert len({s["real"] + s["dummy"] for s in stats}) == 1
    assert stats[0]["local_step"] >= 13


def test_killed_rank_is_reported_and_survivors_stop_waiting(start_group):
    ranks = start_group(3)
    ranks[1].send(cmd="work", steps=100_000)
    for rank in ranks:
        rank.send(cmd="go")
    _wait_until(ranks, lambda stats: all(s["local_step"] >= 20 for s in stats))

    ranks[2].proc.kill()
    ranks[2].proc.wait()
    started = time.monotonic()
    survivors = ranks[:2]
    stats = _wait_until(survivors, lambda stats: all(s["lost"] for s in stats), timeout_s=5)
    assert time.monotonic() - started < LIVENESS_S + 2.0
    assert [s["lost"] for s in stats] == ["DP rank 2 died"] * 2
    assert stats[0]["dead_ranks"] == [2]


def test_killed_coordinator_is_detected_by_participants(start_group):
    ranks = start_group(2)
    for rank in ranks:
        rank.send(cmd="go")
    _wait_until(ranks, lambda stats: all(s["idle_waits"] >= 1 for s in stats))

    ranks[0].proc.kill()
    ranks[0].proc.wait()
    stats = _wait_until(ranks[1:], lambda stats: stats[0]["lost"] is not None, timeout_s=5)
    assert stats[0]["lost"].startswith("DP coordinator silent for ")


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
