"""The disaggregation benchmark's fleets: `kvgate up --engine sim` as a real process tree.

Owns: `Fleet`, one `kvgate up` (a router and N sim worker processes; with
`prefill_workers > 0`, `--disagg` with that many prefill workers and an in-process
prefill queue), started, read for its JSON ready line, and stopped; and the scrape
of the counters the benchmark reports: the router's `kvgate_disagg_decisions_total`
and the decode workers' `kvgate_worker_disagg_fallback_*_total`.

Invariants: every fleet started is stopped (SIGTERM, then SIGKILL), also when the
benchmark fails; its stderr goes to `bench/out/disagg/<label>.log`.
Callers: `bench/disagg.py`.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = ROOT / "bench" / "out" / "disagg"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy detour


@dataclass(frozen=True, slots=True)
class FleetConfig:
    num_workers: int
    prefill_workers: int  # 0: aggregated, every worker role both
    speedup: float
    worker_args: tuple[str, ...] = ()  # extra `kvgate worker` flags, e.g. the sim timing model
    router_args: tuple[str, ...] = ()


@dataclass
class Fleet:
    label: str
    config: FleetConfig
    url: str = ""
    workers: list[dict] = field(default_factory=list)  # the workers' ready lines
    _proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        c = self.config
        argv = [sys.executable, "-m", "router.cli", "up", "--engine", "sim", "--workers", str(c.num_workers),
                "--port", "0", "--speedup", str(c.speedup), "--log-level", "WARNING",
                "--startup-timeout", "90"]  # a busy machine may take a while to import a worker
        if c.prefill_workers:
            argv += ["--disagg", "--prefill-workers", str(c.prefill_workers)]
        return argv + [f"--worker-arg={arg}" for arg in c.worker_args] + list(c.router_args)

    def start(self, timeout_s: float = 120.0) -> None:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log_path = LOG_DIR / f"{self.label}.log"
        with open(log_path, "wb") as log:
            self._proc = subprocess.Popen(self.argv(), cwd=ROOT, stdout=subprocess.PIPE, stderr=log)
        deadline = time.monotonic() + timeout_s
        assert self._proc.stdout is not None
        # NOTE: readline blocks; `kvgate up` exits (EOF) on a startup failure and has its own timeout.
        for raw in self._proc.stdout:
            with contextlib.suppress(ValueError):
                ready = json.loads(raw)
                if isinstance(ready, dict) and ready.get("event") == "ready":
                    self.url, self.workers = ready["url"], ready["workers"]
                    return  # the few banner lines after it fit the pipe's buffer
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError(f"{self.label}: kvgate up did not get ready: see {log_path}")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=20.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._proc = None

    def counters(self) -> dict[str, float]:
        """Remote / local decisions (router) and fallbacks summed over decode workers."""
        router = scrape(self.url)
        decisions = 'kvgate_disagg_decisions_total{decision="%s"'
        figures = {
            "num_remote": sum(v for k, v in router.items() if k.startswith(decisions % "remote")),
            "num_local": sum(v for k, v in router.items() if k.startswith(decisions % "local")),
            "num_fallback_deadline": 0.0, "num_fallback_unqueued": 0.0, "num_remote_completed": 0.0,
        }
        for worker in self.workers:
            if worker.get("role") != "decode":
                continue
            values = scrape(worker["url"])
            figures["num_fallback_deadline"] += values.get("kvgate_worker_disagg_fallback_deadline_total", 0.0)
            figures["num_fallback_unqueued"] += values.get("kvgate_worker_disagg_fallback_unqueued_total", 0.0)
            figures["num_remote_completed"] += values.get("kvgate_worker_disagg_completed_total", 0.0)
        return {key: int(value) for key, value in figures.items()}


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value of a Prometheus text page (empty when unreachable)."""
    try:
        with _OPENER.open(url + "/metrics", timeout=10.0) as response:
            text = response.read().decode()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                values[key] = float(value)
    return values
