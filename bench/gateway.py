"""Gateway overhead benchmark: a fake backend hit directly vs through a router.

Owns: the measurement of what a router costs per request. It starts, as separate
processes on 127.0.0.1, `--backends` fake workers (`bench/fake_backend.py`), `kvgate
router` once per `--policies` entry (default `kv` and `round_robin`) and, with
`--peers`, sglang-router and vllm-router (both `cache_aware`), all over every backend.
The load generator is one more process: a raw HTTP/1.1 client on uvloop (asyncio
protocols, pre-built requests, persistent TCP_NODELAY connections, each a closed loop);
its CPU share (`loadgen_cpu_max`) shows it is not the bottleneck. "direct" spreads its
connections over the backends.

Per target, in the same run: latency at concurrency 1 over ONE keep-alive connection
and req/s at concurrency 32, non-streaming and streaming (SSE). Requests alternate
completions and chat; prompts are one of 8 shared 512-byte prefixes plus a 64-byte
suffix. Runs rotate over the targets in `--rounds` rounds so background load hits all
alike; a figure is the median over rounds, "added" latency the per-round difference to
direct. A streamed request slower than STALL_MS on the kept-alive connection counts as
stalled (`stream_<t>_num_stalled`): that exposes a Nagle / delayed-ACK stall in a relay.

Run: `.venv/bin/python bench/gateway.py [--quick] [--peers]` (logs: bench/out/gateway/).
The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import math
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = ROOT / "bench" / "out" / "gateway"
MODEL = "kvgate-bench"
NUM_CHUNKS = 4
STALL_MS = 10.0
DRAIN_TIMEOUT_S = 30.0  # for responses still in flight when a window closes
CONCURRENCY = 32
# The two targets, plus no keep-alive stall: a Nagle / delayed-ACK stall adds
# about 40 ms to a streamed request, far above this bound.
TARGETS = {"kv_rps_ratio": ("min", 0.6), "kv_added_p50_ms": ("max", 0.25), "stream_kv_added_p50_ms": ("max", 1.0)}
PEERS = {"sglang": "sglang-router", "vllm": "vllm-router"}  # key -> PyPI distribution
KINDS = ("lat", "stream_lat", "rps", "stream_rps")
LOOPBACK_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no HTTP(S)_PROXY detour


def build_requests(host: str, port: int, stream: bool) -> list[bytes]:
    """64 pre-encoded HTTP/1.1 requests: 8 shared prefixes x 8 suffixes, both APIs."""
    requests = []
    for i in range(64):
        prefix = (f"System prompt {i % 8}: you are a careful assistant. " * 12)[:512]
        prompt = prefix + f" User {i:02d} asks: what is {i} times {i + 7}?".ljust(64, ".")
        body: dict = {"model": MODEL, "max_tokens": NUM_CHUNKS, "temperature": 0.0, "stream": stream}
        if i % 2:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "system", "content": prefix}, {"role": "user", "content": prompt[512:]}]
        else:
            path = "/v1/completions"
            body["prompt"] = prompt
        data = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        requests.append(head.encode() + data)
    return requests


def parse_response(buf: bytearray) -> tuple[int, int, bool] | None:
    """(status, end offset, server closes) of the first complete response, None while partial."""
    head_end = buf.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    head = bytes(buf[:head_end]).lower()
    status, body_start = int(head[9:12]), head_end + 4
    closes = b"\r\nconnection: close" in head
    at = head.find(b"\r\ncontent-length:")
    if at >= 0:
        line_end = head.find(b"\r\n", at + 2)
        end = body_start + int(head[at + 17 : line_end if line_end >= 0 else None])
        return (status, end, closes) if len(buf) >= end else None
    if b"chunked" not in head:
        raise ValueError("response has neither Content-Length nor chunked framing")
    pos = body_start
    while True:
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return None
        size = int(bytes(buf[pos:line_end]).split(b";")[0], 16)
        if size == 0:
            end = buf.find(b"\r\n\r\n", line_end)
            return (status, end + 4, closes) if end >= 0 else None
        pos = line_end + 2 + size + 2
        if pos > len(buf):
            return None


@dataclass
class Job:
    urls: list[str]  # connection i goes to urls[i % len(urls)]
    stream: bool
    concurrency: int
    warmup_s: float
    duration_s: float


@dataclass
class LoadResult:
    num_done: int = 0  # completed inside the measured window
    num_total: int = 0  # completed in the whole run, warm-up and drain included
    num_errors: int = 0
    first_error: str | None = None
    latencies_ns: list[int] = field(default_factory=list)  # requests sent inside the window
    window_s: float = 0.0
    cpu_frac: float = 0.0  # load generator CPU seconds per wall second in the window
    target_cpu_s: float = math.nan  # CPU time of the target's processes over the whole run


class _Run:
    """Shared state of one load run: the window, the counters, the open connections."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.addrs = [(url.hostname, url.port) for url in map(urllib.parse.urlsplit, job.urls)]
        self.requests = {addr: build_requests(*addr, job.stream) for addr in self.addrs}
        self.result = LoadResult()
        self.start_ns = self.end_ns = 1 << 62
        self.stopping = False
        self.num_busy = 0
        self.idle = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.conns: set[_Conn] = set()

    def error(self, message: str) -> None:
        self.result.num_errors += 1
        self.result.first_error = self.result.first_error or message

    def connect(self, addr: tuple[str, int], seq: int) -> None:
        self.num_busy += 1
        task = asyncio.get_running_loop().create_task(self._connect(addr, seq))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _connect(self, addr: tuple[str, int], seq: int) -> None:
        try:
            await asyncio.get_running_loop().create_connection(lambda: _Conn(self, addr, seq), *addr)
        except OSError as exc:
            self.error(f"connect {addr}: {exc}")
            self.release()

    def release(self) -> None:
        self.num_busy -= 1
        if self.num_busy == 0:
            self.idle.set()


class _Conn(asyncio.Protocol):
    """One keep-alive connection sending the next request as soon as a response ends."""

    def __init__(self, run: _Run, addr: tuple[str, int], seq: int) -> None:
        self.run, self.addr, self.seq = run, addr, seq
        self.requests = run.requests[addr]
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.sent_ns = 0
        self.in_flight = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = transport  # type: ignore[assignment]
        self.run.conns.add(self)
        self.send()

    def send(self) -> None:
        if self.run.stopping:
            self.transport.close()
            return
        self.seq += 1
        self.in_flight = True
        self.sent_ns = time.perf_counter_ns()
        self.transport.write(self.requests[self.seq % len(self.requests)])

    def data_received(self, data: bytes) -> None:
        self.buf += data
        try:
            parsed = parse_response(self.buf)
        except ValueError as exc:
            self.run.error(str(exc))
            self.transport.close()
            return
        if parsed is None:
            return
        done_ns, (status, end, closes) = time.perf_counter_ns(), parsed
        ok = status == 200 and (not self.run.job.stream or self.buf.find(b"[DONE]", 0, end) >= 0)
        del self.buf[:end]
        self.in_flight = False
        self.record(ok, status, done_ns)
        if closes:
            self.transport.close()
        else:
            self.send()

    def record(self, ok: bool, status: int, done_ns: int) -> None:
        run, result = self.run, self.run.result
        if not ok:  # errors count whenever they happen: a failing target must show
            run.error(f"status {status}" if status != 200 else "stream without [DONE]")
            return
        result.num_total += 1
        if run.start_ns <= done_ns <= run.end_ns:
            result.num_done += 1
            if self.sent_ns >= run.start_ns:
                result.latencies_ns.append(done_ns - self.sent_ns)

    def connection_lost(self, exc: Exception | None) -> None:
        self.run.conns.discard(self)
        if self.in_flight:
            self.run.error(f"connection to {self.addr} lost mid-response: {exc}")
        if self.run.stopping:
            self.run.release()
        else:  # the server closed a kept-alive connection: open another
            self.run.num_busy -= 1
            self.run.connect(self.addr, self.seq)


async def run_load(job: Job) -> LoadResult:
    run = _Run(job)
    for i in range(job.concurrency):
        run.connect(run.addrs[i % len(run.addrs)], i * 7)
    await asyncio.sleep(job.warmup_s)
    run.start_ns, cpu0 = time.perf_counter_ns(), time.process_time()
    await asyncio.sleep(job.duration_s)
    run.end_ns, cpu1 = time.perf_counter_ns(), time.process_time()
    run.stopping = True
    try:
        await asyncio.wait_for(run.idle.wait(), timeout=DRAIN_TIMEOUT_S)
    except asyncio.TimeoutError:
        run.error(f"{len(run.conns)} responses outstanding {DRAIN_TIMEOUT_S:.0f} s after the window closed")
        for conn in list(run.conns):
            conn.transport.abort()
        await run.idle.wait()
    run.result.window_s = (run.end_ns - run.start_ns) / 1e9
    run.result.cpu_frac = (cpu1 - cpu0) / run.result.window_s
    return run.result


def loadgen_main(conn) -> None:
    """The load generator process: runs the jobs it is sent until it gets None."""
    while (job := conn.recv()) is not None:
        conn.send(uvloop.run(run_load(job)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Target:
    key: str  # JSON key prefix: direct, kv, rr, sglang, vllm, ...
    label: str
    urls: list[str]
    pids: list[int]  # the processes whose CPU time this target costs


class Fleet(contextlib.ExitStack):
    """Every process the benchmark starts; all are terminated on exit."""

    def start(self, key: str, label: str, argv_for: Callable[[int], list[str]], env: dict | None = None) -> Target:
        """Starts one server process on a free port and waits until requests get through it."""
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        port, log_path = free_port(), LOG_DIR / f"{key}.log"
        log = self.enter_context(open(log_path, "wb"))
        proc = subprocess.Popen(argv_for(port), cwd=ROOT, stdout=log, stderr=log, env=env)
        self.callback(stop_process, proc)
        url = f"http://127.0.0.1:{port}"
        wait_routable(url, proc, 60.0, log_path)
        return Target(key, label, [url], [proc.pid])


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the processes (all their threads), from /proc; NaN without it."""
    try:
        stats = [Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() for pid in pids]
    except OSError:
        return math.nan
    return sum(int(fields[11]) + int(fields[12]) for fields in stats) / os.sysconf("SC_CLK_TCK")


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)
    proc.kill()  # a no-op once the process has exited
    proc.wait()


def post(url: str, body: dict, timeout_s: float = 5.0) -> bytes:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with LOOPBACK_OPENER.open(request, timeout=timeout_s) as response:
        return response.read()


def wait_routable(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Until a completion and a streamed chat completion both get through `url`."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: see {log}")
        try:
            post(url + "/v1/completions", {"model": MODEL, "prompt": "ping", "max_tokens": 1})
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "stream": True}
            if b"[DONE]" in post(url + "/v1/chat/completions", chat):
                return
            last = "stream without [DONE]"
        except OSError as exc:  # URLError included
            last = str(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{url} not routable after {timeout_s:.0f} s ({last}): see {log}")


def start_targets(fleet: Fleet, args: argparse.Namespace) -> tuple[list[Target], dict[str, str]]:
    backend = [sys.executable, str(ROOT / "bench" / "fake_backend.py"), "--model", MODEL, "--num-chunks", str(NUM_CHUNKS)]
    backends = [fleet.start(f"backend{i}", "backend", lambda p: [*backend, "--port", str(p)])
                for i in range(args.backends)]
    urls = [url for b in backends for url in b.urls]
    targets = [Target("direct", "direct", urls, [pid for b in backends for pid in b.pids])]
    kvgate = [sys.executable, "-m", "router.cli", "router", "--host", "127.0.0.1", "--model", MODEL]
    kvgate += ["--log-level", "WARNING", *(arg for url in urls for arg in ("--worker", url))]
    for policy in args.policies:
        key = "rr" if policy == "round_robin" else policy
        targets.append(fleet.start(key, f"kvgate {policy}", lambda p: [*kvgate, "--policy", policy, "--port", str(p)]))
    installed = {dist.name: dist.version for dist in importlib.metadata.distributions()}
    peers = {key: installed.get(dist, "not installed") for key, dist in PEERS.items()} if args.peers else {}
    # sglang-router fetches the served model's tokenizer from the HF hub: point that at a
    # closed loopback port so no traffic leaves the machine.
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HUB_OFFLINE": "1"}
    for key, version in peers.items():
        if version != "not installed":
            label = f"{PEERS[key]} {version} cache_aware"
            targets.append(fleet.start(key, label, lambda p: peer_argv(key, p, urls), env))
    return targets, peers


def peer_argv(key: str, port: int, backends: list[str]) -> list[str]:
    bindir = Path(sys.executable).parent
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *backends, "--policy", "cache_aware"]
    common += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if key == "sglang":
        return [str(bindir / "smg"), "launch", *common, "--log-level", "warn"]
    return [str(bindir / "vllm-router"), *common, "--log-level", "warning"]


def measure(targets: list[Target], args: argparse.Namespace) -> dict[str, dict[str, list[LoadResult]]]:
    """results[kind][target key] = one LoadResult per round."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    loadgen = ctx.Process(target=loadgen_main, args=(child,), name="loadgen", daemon=True)
    loadgen.start()
    results: dict[str, dict[str, list[LoadResult]]] = {kind: {t.key: [] for t in targets} for kind in KINDS}
    try:
        for round_index in range(args.rounds):
            order = targets[round_index % len(targets) :] + targets[: round_index % len(targets)]
            for kind in KINDS:
                for target in order:
                    duration, concurrency = (args.lat_s, 1) if kind.endswith("lat") else (args.rps_s, CONCURRENCY)
                    cpu_s = cpu_seconds(target.pids)
                    parent.send(Job(target.urls, kind.startswith("stream"), concurrency, args.warmup_s, duration))
                    results[kind][target.key].append(result := parent.recv())
                    result.target_cpu_s = cpu_seconds(target.pids) - cpu_s
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        if loadgen.is_alive():
            parent.send(None)
        loadgen.join(timeout=10.0)
    return results


def percentile(values: list[int], q: float) -> float:
    """q-quantile of nanosecond values, in milliseconds (nearest rank); NaN for none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6 if ordered else math.nan


def median(values, digits: int) -> float | None:
    """Median over rounds, NaNs (rounds without a sample) left out; None if nothing is left."""
    finite = [v for v in values if not math.isnan(v)]
    return round(statistics.median(finite), digits) if finite else None


def kind_figures(name: str, kind: str, runs: list[LoadResult], direct: list[LoadResult] | None) -> dict:
    """Figures of one target for one kind of run; `direct` is None for direct itself."""
    if kind.endswith("rps"):
        figures = {f"{name}_rps": median((r.num_done / r.window_s for r in runs), 1)}
        per_request = (r.target_cpu_s / r.num_total * 1e6 if r.num_total else math.nan for r in runs)
        figures[f"{name}_cpu_us_per_req"] = median(per_request, 1)
        if direct is not None:
            ratios = (r.num_done / d.num_done if d.num_done else math.nan for r, d in zip(runs, direct))
            figures[f"{name}_rps_ratio"] = median(ratios, 3)
        return figures
    figures = {}
    for q, label in ((0.5, "p50"), (0.99, "p99")):
        figures[f"{name}_{label}_ms"] = median((percentile(r.latencies_ns, q) for r in runs), 4)
        if direct is not None:
            added = (percentile(r.latencies_ns, q) - percentile(d.latencies_ns, q) for r, d in zip(runs, direct))
            figures[f"{name}_added_{label}_ms"] = median(added, 4)
    if kind.startswith("stream"):
        figures[f"{name}_num_stalled"] = sum(lat > STALL_MS * 1e6 for r in runs for lat in r.latencies_ns)
    return figures


def summarize(targets: list[Target], results: dict, peers: dict[str, str], args: argparse.Namespace) -> dict:
    figures: dict = {}
    for kind in KINDS:
        prefix, direct = "stream_" * kind.startswith("stream"), results[kind]["direct"]
        for t in targets:
            figures |= kind_figures(prefix + t.key, kind, results[kind][t.key], None if t.key == "direct" else direct)
    if "stream_kv_p50_ms" in figures:
        figures["stream_keepalive_p50_ms"] = figures["stream_kv_p50_ms"]
    every = {t.key: [r for k in KINDS for r in results[k][t.key]] for t in targets}
    figures["errors"] = {key: sum(r.num_errors for r in runs) for key, runs in every.items()}
    figures["first_error"] = {key: next(r.first_error for r in runs if r.first_error) for key, runs in every.items()
                              if figures["errors"][key]}
    figures["loadgen_cpu_max"] = round(max(r.cpu_frac for runs in every.values() for r in runs), 3)
    figures["targets"] = {}
    for key, (sense, bound) in TARGETS.items() if "kv_rps" in figures else ():
        value = figures[key]
        met = value is not None and (value >= bound if sense == "min" else value <= bound)
        figures["targets"][key] = {"value": value, sense: bound, "met": met}
    figures["peers"] = peers
    figures["setup"] = {
        "backends": args.backends, "rounds": args.rounds, "concurrency": CONCURRENCY, "latency_s": args.lat_s,
        "rps_s": args.rps_s, "cpus": os.cpu_count(), "loadgen": "raw HTTP/1.1 asyncio protocols on uvloop",
    }
    return figures


def print_table(targets: list[Target], figures: dict) -> None:
    columns = ("p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms", "rps", "rps_ratio", "cpu_us_per_req")
    for prefix, title in (("", "non-streaming"), ("stream_", "streaming (SSE)")):
        print(f"\n{title}: latency at concurrency 1 (one keep-alive connection), req/s at {CONCURRENCY}")
        columns += ("num_stalled",) if prefix else ()
        print(f"{'target':<34}" + "".join(f"{c:>15}" for c in columns))
        for target in targets:
            cells = [figures.get(f"{prefix}{target.key}_{c}") for c in columns]
            print(f"{target.label:<34}" + "".join(f"{'-' if v is None else v:>15}" for v in cells))
    print(f"\nload generator CPU at most {figures['loadgen_cpu_max']:.0%} of a core; errors {figures['errors']}")
    print(f"peers: {figures['peers'] or 'not asked for (--peers)'}; first errors: {figures['first_error']}")
    for key, target in figures["targets"].items():
        print(f"target {key}: {target}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter windows (under two minutes)")
    parser.add_argument("--peers", action="store_true", help="also measure sglang-router and vllm-router when installed")
    parser.add_argument("--policies", nargs="*", default=["kv", "round_robin"], help="kvgate policies (none: skip kvgate)")
    parser.add_argument("--backends", type=int, default=2, help="fake backend processes")
    parser.add_argument("--rounds", type=int, help="rounds over all targets (default 5, --quick 2)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.warmup_s, args.lat_s, args.rps_s = (0.3, 1.0, 1.5) if args.quick else (0.5, 2.0, 3.0)
    if args.backends < 1 or args.rounds < 1:
        parser.error("--backends and --rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with Fleet() as fleet:
        try:
            targets, peers = start_targets(fleet, args)
        except RuntimeError as exc:
            print(f"gateway bench: {exc}", file=sys.stderr)
            return 1
        results = measure(targets, args)
    figures = summarize(targets, results, peers, args)
    print_table(targets, figures)
    print(json.dumps(figures, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
