"""`kvgate up` as a real process: starts a fleet, serves a streamed answer, reports a dead child, stops cleanly."""

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai

REPO_ROOT = Path(__file__).parents[2]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Still listed: a zombie waiting for its parent counts as gone too.
    status = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    return status == "Z"


def test_up_serves_reports_a_dead_worker_and_stops_on_sigterm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    stderr = open(tmp_path / "up.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "up", "--engine", "sim", "--workers", "2", "--port", "0", "--speedup", "20",
         "--log-level", "WARNING", "--health-interval", "0.2"],
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=REPO_ROOT,
    )
    try:
        readable, _, _ = select.select([proc.stdout], [], [], 30)
        assert readable, "kvgate up printed nothing in 30 s"
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and len(ready["workers"]) == 2
        banner = [proc.stdout.readline() for _ in range(4)]
        assert banner[0].startswith(f"kvgate is up: {ready['url']}")
        assert f"curl -N {ready['url']}/v1/chat/completions" in banner[2]

        with openai.OpenAI(base_url=f"{ready['url']}/v1", api_key="unused") as client:
            stream = client.chat.completions.create(
                model="kvgate-sim", messages=[{"role": "user", "content": "Hello!"}], max_tokens=5, stream=True,
            )
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text

        victim = ready["workers"][1]
        os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while f"worker {victim['worker_id']} (pid {victim['pid']}) exited with code -9" not in stderr_text(stderr):
            assert time.monotonic() < deadline, stderr_text(stderr)
            time.sleep(0.05)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, stderr_text(stderr)
        assert all(_gone(worker["pid"]) for worker in ready["workers"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        stderr.close()


def test_up_by_default_serves_the_reference_model_as_the_banner_says(tmp_path):
    # What a first-time user does: `make run` (kvgate up), then the printed curl command.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    stderr = open(tmp_path / "up.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "up", "--workers", "1", "--port", "0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=REPO_ROOT,
    )
    try:
        readable, _, _ = select.select([proc.stdout], [], [], 60)
        assert readable, "kvgate up printed nothing in 60 s"
        ready = json.loads(proc.stdout.readline())
        banner = [proc.stdout.readline() for _ in range(4)]
        assert "1 torch worker(s) serving 'kvgate-moe-tiny'" in banner[0]
        curl = banner[2].strip()
        assert curl.startswith("curl -N ")
        done = subprocess.run(["sh", "-c", curl + " -sS --max-time 60"], capture_output=True, text=True, timeout=90)
        events = [line.removeprefix("data: ") for line in done.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", done.stdout + done.stderr
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert ready["workers"][0]["model"] == "kvgate-moe-tiny"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, stderr_text(stderr)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        stderr.close()


def stderr_text(stderr) -> str:
    stderr.flush()
    return Path(stderr.name).read_text()
