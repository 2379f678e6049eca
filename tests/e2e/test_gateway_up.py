"""`kvgate up` as a real process: starts a fleet, serves a streamed answer, reports a dead child, stops cleanly.

Owns `kvgate_up`, the way every e2e test of `kvgate up` (here and `test_disagg_up.py`)
starts one and makes sure it is gone afterwards.
"""

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import openai

REPO_ROOT = Path(__file__).parents[2]
NUM_BANNER_LINES = 4  # after the JSON ready line: the summary, "Try:", the curl command, admin links


@dataclass(frozen=True)
class Up:
    """A running `kvgate up`: its ready line, the banner under it, and its stderr log."""

    ready: dict
    banner: list[str]
    log_path: Path
    pid: int

    def log_text(self) -> str:
        return self.log_path.read_text()


@contextmanager
def kvgate_up(tmp_path: Path, *args: str, ready_timeout_s: float = 60.0, stop_timeout_s: float = 20.0) -> Iterator[Up]:
    """`kvgate up --port 0 --log-level WARNING *args`, yielded once it printed its ready line and banner.

    Leaving the block normally sends SIGTERM and asserts exit status 0 within
    `stop_timeout_s`; however it is left, a process still running is killed.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    log_path = tmp_path / f"up-{len(list(tmp_path.iterdir()))}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "up", "--port", "0", "--log-level", "WARNING", *args],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=REPO_ROOT,
        )
    try:
        readable, _, _ = select.select([proc.stdout], [], [], ready_timeout_s)
        assert readable, f"kvgate up printed nothing in {ready_timeout_s:g} s"
        line = proc.stdout.readline()
        assert line, log_path.read_text()
        yield Up(json.loads(line), [proc.stdout.readline() for _ in range(NUM_BANNER_LINES)], log_path, proc.pid)
        if proc.poll() is None:  # a test may have killed it on purpose
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=stop_timeout_s) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still listed: a zombie waiting for its parent counts as gone too.
    status = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    return status == "Z"


def test_up_serves_reports_a_dead_worker_and_stops_on_sigterm(tmp_path):
    args = ("--engine", "sim", "--workers", "2", "--speedup", "20", "--health-interval", "0.2")
    with kvgate_up(tmp_path, *args, ready_timeout_s=30, stop_timeout_s=15) as up:
        ready = up.ready
        assert ready["event"] == "ready" and len(ready["workers"]) == 2
        assert up.banner[0].startswith(f"kvgate is up: {ready['url']}")
        assert f"curl -N {ready['url']}/v1/chat/completions" in up.banner[2]

        with openai.OpenAI(base_url=f"{ready['url']}/v1", api_key="unused") as client:
            stream = client.chat.completions.create(
                model="kvgate-sim", messages=[{"role": "user", "content": "Hello!"}], max_tokens=5, stream=True,
            )
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text

        victim = ready["workers"][1]
        os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while f"worker {victim['worker_id']} (pid {victim['pid']}) exited with code -9" not in up.log_text():
            assert time.monotonic() < deadline, up.log_text()
            time.sleep(0.05)
    # Stopped by SIGTERM with exit status 0 on leaving the block: no worker outlives it.
    assert all(_gone(worker["pid"]) for worker in ready["workers"])


def test_up_by_default_serves_the_reference_model_as_the_banner_says(tmp_path):
    # What a first-time user does: `make run` (kvgate up), then the printed curl command.
    with kvgate_up(tmp_path, "--workers", "1") as up:
        assert "1 torch worker(s) serving 'kvgate-moe-tiny'" in up.banner[0]
        curl = up.banner[2].strip()
        assert curl.startswith("curl -N ")
        done = subprocess.run(["sh", "-c", curl + " -sS --max-time 60"], capture_output=True, text=True, timeout=90)
        events = [line.removeprefix("data: ") for line in done.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", done.stdout + done.stderr
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert up.ready["workers"][0]["model"] == "kvgate-moe-tiny"


def test_workers_do_not_outlive_a_killed_up(tmp_path):
    with kvgate_up(tmp_path, "--engine", "sim", "--workers", "2", ready_timeout_s=30) as up:
        os.kill(up.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while not all(_gone(worker["pid"]) for worker in up.ready["workers"]):
            assert time.monotonic() < deadline, "a worker outlived its kvgate up"
            time.sleep(0.05)
