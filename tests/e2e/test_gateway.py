"""`kvgate router` in front of real `kvgate worker --engine sim` processes, driven by the openai SDK.

One fleet (a router and three sim workers, each its own process, on ephemeral ports)
serves most tests; the worker-kill test starts a fleet of its own.
"""

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import http.client
from urllib.parse import urlsplit

import openai
import pytest

REPO_ROOT = Path(__file__).parents[2]
MODEL = "kvgate-sim"
TOKEN = "admin-e2e"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
BLOCK_SIZE = 16
STARTUP_S = 20.0


class Response:
    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self):
        return json.loads(self.content)


class Http:
    """A minimal blocking HTTP client (one connection per call) for admin calls and fuzzing."""

    def __init__(self, base_url: str, timeout: float = 10.0, headers: dict | None = None) -> None:
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname, parts.port
        self.timeout = timeout
        self.headers = headers or {}

    def request(self, method: str, path: str, *, json=None, content: bytes | None = None, headers=None) -> Response:
        if json is not None:
            content = globals()["json"].dumps(json).encode()
        merged = {**self.headers, **(headers or {})}
        if content is not None:
            merged.setdefault("Content-Type", "application/json")
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            connection.request(method, path, body=content, headers=merged)
            response = connection.getresponse()
            return Response(response.status, response.read())
        finally:
            connection.close()

    def get(self, path: str, **kwargs) -> Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs) -> Response:
        return self.request("POST", path, **kwargs)

    def patch(self, path: str, **kwargs) -> Response:
        return self.request("PATCH", path, **kwargs)

    def delete(self, path: str, **kwargs) -> Response:
        return self.request("DELETE", path, **kwargs)


def _spawn(log_dir: Path, name: str, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", *args], stdout=subprocess.PIPE, stderr=log, text=True,
        env=env, cwd=REPO_ROOT,
    )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _ready_line(proc: subprocess.Popen, timeout_s: float = STARTUP_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        readable, _, _ = select.select([proc.stdout], [], [], 0.1)
        if readable:
            line = proc.stdout.readline()
            if not line:
                break
            message = json.loads(line)
            if message.get("event") == "ready":
                return message
    raise AssertionError(f"no ready line (exit code {proc.poll()}); see {proc.log.name}")


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    proc.stdout.close()
    proc.log.close()
    return code


class Fleet:
    """A router process and N sim worker processes."""

    def __init__(self, log_dir: Path, num_workers: int, *router_args: str, worker_args: tuple[str, ...] = ()) -> None:
        self.workers: dict[str, tuple[subprocess.Popen, dict]] = {}
        procs = {
            f"w{i}": _spawn(
                log_dir, f"w{i}", "worker", "--engine", "sim", "--port", "0", "--worker-id", f"w{i}",
                "--model", MODEL, "--block-size", str(BLOCK_SIZE), "--num-blocks", "4096", "--speedup", "20",
                "--events-endpoint", "tcp://127.0.0.1:*", "--replay-endpoint", "tcp://127.0.0.1:*",
                "--load-endpoint", "tcp://127.0.0.1:*", "--log-level", "WARNING", *worker_args,
            )
            for i in range(num_workers)
        }
        self.router: subprocess.Popen | None = None
        try:
            for name, proc in procs.items():
                self.workers[name] = (proc, _ready_line(proc))
            specs = [
                f"id={r['worker_id']},url={r['url']},events={r['events_endpoint']},replay={r['replay_endpoint']},"
                f"load={r['load_endpoint']},model={r['model']},block_size={r['block_size']}"
                for _, r in self.workers.values()
            ]
            self.router = _spawn(
                log_dir, "router", "router", "--port", "0", "--admin-token", TOKEN, "--log-level", "WARNING",
                "--health-interval", "0.2", "--health-timeout", "0.5", "--health-fail-threshold", "1",
                "--health-pass-threshold", "1", *[arg for spec in specs for arg in ("--worker", spec)], *router_args,
            )
            self.url = _ready_line(self.router)["url"]
            self.http = Http(self.url)
            self._warm_up()
        except BaseException:
            self.close()
            raise

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", **kwargs)

    def stats(self) -> dict:
        return self.http.get("/admin/stats", headers=ADMIN).json()

    def _warm_up(self) -> None:
        """Until every worker is in rotation and the router follows its KV events.

        Requests go straight to each worker (the router's subscribers may miss what is
        published before they connect, and catch up on the next batch they see).
        """
        deadline = time.monotonic() + STARTUP_S
        for attempt in range(10_000):
            workers = self.stats()["workers"]
            if all(w["eligible"] and w["kv_events"]["num_batches"] > 0 for w in workers.values()):
                return
            assert time.monotonic() < deadline, f"fleet never warmed up: {workers}"
            for name, (_, ready) in self.workers.items():
                if workers[name]["kv_events"]["num_batches"] == 0:
                    body = {"model": MODEL, "prompt": f"warm-up {attempt:>8} for {name} " * 2, "max_tokens": 1}
                    assert Http(ready["url"]).post("/v1/completions", json=body).status_code == 200
            time.sleep(0.05)

    def close(self) -> None:
        if self.router is not None:
            assert _stop(self.router) == 0, "the router did not exit cleanly"
        for proc, _ in self.workers.values():
            _stop(proc)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("fleet"), 3, "--max-body-bytes", "65536", "--max-prompt-tokens", "2048")
    yield fleet
    fleet.close()


def test_openai_sdk_completions_and_chat_streaming_and_not(fleet):
    with fleet.client() as client:
        completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
        assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
        assert completion.usage.prompt_tokens == len("Once upon a time") + 1
        assert completion.usage.completion_tokens == 5
        pieces = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True) if c.choices]
        assert len("".join(pieces)) >= 1 and len(pieces) >= 2
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_completion_tokens=4,
        )
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
        assert chat.usage.completion_tokens == 4
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 4
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]


def test_requests_sharing_a_long_prefix_land_on_the_same_worker(fleet):
    rng = random.Random(7)
    with fleet.client() as client:
        for trial in range(4):
            prefix = f"trial {trial}: " + " ".join(f"{rng.random():.6f}" for _ in range(120))
            first = client.completions.with_raw_response.create(model=MODEL, prompt=prefix + " first question", max_tokens=2)
            holder = first.headers["x-kvgate-worker"]
            # Wait (bounded) until the holder's KV events reached the router's index.
            deadline = time.monotonic() + 5
            while True:
                route = fleet.http.post("/admin/route", headers=ADMIN, json={"model": MODEL, "prompt": prefix}).json()
                matched = {c["worker_id"]: c["matched_blocks"] for c in route["candidates"]}
                if matched[holder] >= len(prefix) // BLOCK_SIZE:
                    break
                assert time.monotonic() < deadline, f"the index never saw {holder}'s blocks: {matched}"
                time.sleep(0.02)
            body = {"model": MODEL, "prompt": prefix + " and another", "max_tokens": 2}
            dry_run = fleet.http.post("/admin/route", headers=ADMIN, json=body).json()
            second = client.completions.with_raw_response.create(**body)
            assert second.headers["x-kvgate-worker"] == holder, json.dumps(dry_run["candidates"])
            assert second.parse().usage.prompt_tokens_details.cached_tokens >= len(prefix) // BLOCK_SIZE * BLOCK_SIZE


def test_admin_route_agrees_with_the_actual_routing(fleet):
    rng = random.Random(11)
    with fleet.client() as client:
        for trial in range(6):
            prompt = f"agreement {trial} " + " ".join(str(rng.randrange(10**6)) for _ in range(60))
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            if trial % 2:  # half the prompts are already cached somewhere: a unique best worker
                client.completions.create(**body)
                time.sleep(0.3)
            route = fleet.http.post("/admin/route", headers=ADMIN, json=body).json()
            actual = client.completions.with_raw_response.create(**body).headers["x-kvgate-worker"]
            best = max(c["score"] for c in route["candidates"] if c["rank"] is not None)
            tied = {c["worker_id"] for c in route["candidates"] if c["rank"] is not None and abs(c["score"] - best) < 1e-9}
            assert actual in tied, (route, actual)  # ties are broken at random, per request
            if len(tied) == 1:
                assert actual == route["worker_id"]


def _status_of(call) -> int:
    try:
        call()
    except openai.APIStatusError as exc:
        body = exc.response.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}
        return exc.status_code
    return 200


def test_every_bad_input_gets_its_status(fleet):
    with fleet.client(max_retries=0) as client:
        messages = [{"role": "user", "content": "x"}]
        cases = [
            (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=-1), 400),
            (lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"temperature": "hot"}), 400),
            (lambda: client.completions.create(model=MODEL, prompt={"not": "a prompt"}), 400),  # type: ignore[arg-type]
            (lambda: client.chat.completions.create(model=MODEL, messages=[]), 400),
            (lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens="5"), 400),  # type: ignore[arg-type]
            (lambda: client.completions.create(model="no-such-model", prompt="x"), 404),
            (lambda: client.completions.create(model=MODEL, prompt="x" * 3000), 413),
            (lambda: client.completions.create(model=MODEL, prompt="x", extra_body={"pad": "y" * 70000}), 413),
        ]
        assert [_status_of(call) for call, _ in cases] == [status for _, status in cases]
    for raw in (b'{"model": "kvgate-sim", "prompt": "x"', b"not json at all", b"[]"):
        response = fleet.http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_admission_limit_and_no_eligible_worker(fleet):
    patch = fleet.http.patch("/admin/config", headers=ADMIN, json={"max_concurrent_requests": 1})
    assert patch.status_code == 200
    try:
        with fleet.client(max_retries=0) as client, client.completions.create(
            model=MODEL, prompt="a slow one", max_tokens=400, stream=True,
        ) as stream:
            next(iter(stream))  # it is in flight now
            assert _status_of(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1)) == 429
    finally:
        fleet.http.patch("/admin/config", headers=ADMIN, json={"max_concurrent_requests": 4096})
    for name in fleet.workers:
        assert fleet.http.post(f"/admin/workers/{name}/drain", headers=ADMIN).json()["draining"] is True
    try:
        with fleet.client(max_retries=0) as client:
            assert _status_of(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=1)) == 503
        assert fleet.http.get("/ready").status_code == 503
    finally:
        for name in fleet.workers:
            fleet.http.post(f"/admin/workers/{name}/drain", headers=ADMIN, json={"draining": False})
    assert fleet.http.get("/ready").status_code == 200


def test_admin_api_wants_its_token(fleet):
    for path in ("/admin/workers", "/admin/stats", "/admin/config"):
        assert fleet.http.get(path).status_code == 401
        assert fleet.http.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert fleet.http.get(path, headers=ADMIN).status_code == 200
    assert fleet.http.post("/admin/workers", json={"worker_id": "x"}).status_code == 401


def _fuzz_bodies(rng: random.Random):
    valid = [
        json.dumps({"model": MODEL, "prompt": "hello fuzz", "max_tokens": 2}).encode(),
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}).encode(),
        json.dumps({"worker_id": "fz", "url": "http://127.0.0.1:9", "model": "fuzz-model", "block_size": 16}).encode(),
        json.dumps({"policy": "kv", "policy_config": {"load_weight": 1.0}}).encode(),
    ]
    junk = [None, True, -1, 0, 2**70, -1e308, 1.5, "", "x" * 50, "\ud800", [], [1, "a"], {}, {"a": {"b": [None]}},
            [[[[[[]]]]]], "<|im_start|>", [2**33], [-5]]
    fields = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
              "temperature", "top_p", "n", "stop", "seed", "role", "content", "worker_id", "url", "block_size",
              "policy", "policy_config", "draining", "prompt_token_ids"]
    for _ in range(120):
        kind = rng.randrange(4)
        base = rng.choice(valid)
        if kind == 0:  # truncated
            yield base[: rng.randrange(len(base))]
        elif kind == 1:  # random bytes
            yield bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        elif kind == 2:  # valid JSON, wrong values
            body = json.loads(base)
            for _ in range(rng.randrange(1, 4)):
                body[rng.choice(fields)] = rng.choice(junk)
            yield json.dumps(body).encode()
        else:  # byte flips
            data = bytearray(base)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            yield bytes(data)


def test_fuzzed_and_truncated_bodies_never_500_or_hang(fleet):
    rng = random.Random(2024)
    paths = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/admin/route"),
             ("POST", "/admin/workers"), ("PATCH", "/admin/config"), ("POST", "/admin/workers/w0/drain")]
    allowed = {200, 201, 400, 404, 413}
    seen: dict[int, int] = {}
    http = Http(fleet.url, timeout=5, headers=ADMIN)
    for body in _fuzz_bodies(rng):
        method, path = rng.choice(paths)
        response = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code in allowed, (method, path, body[:200], response.text[:300])
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert seen.get(400, 0) > 50  # the fuzz mostly hit validation, as it should
    # Put back what the fuzz may have changed.
    http = fleet.http
    http.post("/admin/workers/w0/drain", headers=ADMIN, json={"draining": False})
    http.delete("/admin/workers/fz", headers=ADMIN)
    http.patch("/admin/config", headers=ADMIN, json={"policy": "kv", "policy_config": {"load_weight": 1.0}})
    assert http.get("/ready").status_code == 200


async def test_a_worker_killed_mid_run_fails_no_request_that_had_not_started_streaming(tmp_path):
    import asyncio

    fleet = Fleet(tmp_path, 3, "--max-retries", "3")
    try:
        client = openai.AsyncOpenAI(base_url=f"{fleet.url}/v1", api_key="unused", max_retries=0)
        outcomes: list[tuple[bool, bool, str | None]] = []  # (streamed, got a byte, error)
        stop_at = time.monotonic() + 2.5

        async def one(i: int) -> None:
            stream = i % 2 == 1
            got_byte = False
            try:
                prompt = f"request {i} " + "z" * 200
                if stream:
                    async for _ in await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True):
                        got_byte = True
                else:
                    await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
                outcomes.append((stream, got_byte, None))
            except openai.APIError as exc:
                outcomes.append((stream, got_byte, repr(exc)))

        async def client_loop(offset: int) -> None:
            i = offset
            while time.monotonic() < stop_at:
                await one(i)
                i += 8

        loops = [asyncio.create_task(client_loop(k)) for k in range(8)]
        await asyncio.sleep(0.8)
        victim, _ = fleet.workers["w1"]
        victim.kill()
        await asyncio.gather(*loops)
        await client.close()
        errors = [o for o in outcomes if o[2] is not None]
        assert len(outcomes) > 40
        # Only a stream that had already sent bytes may break; nothing else fails.
        assert all(streamed and got_byte for streamed, got_byte, _ in errors), errors
        stats = fleet.stats()
        assert stats["workers"]["w1"]["num_failures"] >= 1  # requests did run into the dead worker
        assert stats["workers"]["w1"]["health"] == "unhealthy"
        assert stats["workers"]["w1"]["index_blocks"] == 0  # a dead worker's entries are dropped
    finally:
        fleet.close()


def test_a_worker_registers_itself_heartbeats_and_deregisters(tmp_path):
    router = _spawn(tmp_path, "router", "router", "--port", "0", "--admin-token", TOKEN, "--log-level", "WARNING",
                    "--health-interval", "0.2", "--health-pass-threshold", "1")
    worker = None
    try:
        http = Http(_ready_line(router)["url"])
        worker = _spawn(
            tmp_path, "worker", "worker", "--engine", "sim", "--port", "0", "--worker-id", "self-registered",
            "--model", MODEL, "--speedup", "20", "--events-endpoint", "tcp://127.0.0.1:*",
            "--replay-endpoint", "tcp://127.0.0.1:*", "--load-endpoint", "tcp://127.0.0.1:*", "--log-level", "WARNING",
            "--router", http_url(http), "--router-token", TOKEN, "--heartbeat-interval", "0.2",
        )
        ready = _ready_line(worker)
        deadline = time.monotonic() + 10
        while not [w for w in http.get("/admin/workers", headers=ADMIN).json()["workers"] if w["eligible"]]:
            assert time.monotonic() < deadline, "the worker never entered rotation"
            time.sleep(0.05)
        (registered,) = http.get("/admin/workers", headers=ADMIN).json()["workers"]
        assert (registered["worker_id"], registered["url"]) == ("self-registered", ready["url"])
        assert registered["events_endpoint"] == ready["events_endpoint"]
        with openai.OpenAI(base_url=f"{http_url(http)}/v1", api_key="unused") as client:
            assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2).choices[0].text
        time.sleep(0.5)  # heartbeats keep it registered, unchanged
        assert http.get("/admin/workers/self-registered", headers=ADMIN).json()["registered_at"] == registered["registered_at"]
        assert _stop(worker) == 0
        worker = None
        assert http.get("/admin/workers", headers=ADMIN).json()["workers"] == []
    finally:
        if worker is not None:
            _stop(worker)
        assert _stop(router) == 0


def http_url(http: Http) -> str:
    return f"http://{http.host}:{http.port}"
