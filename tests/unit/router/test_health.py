"""Health: the pure state machine, and the monitor probing real HTTP servers."""

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from router.health import HEALTHY, UNHEALTHY, UNKNOWN, HealthConfig, HealthMonitor, HealthState, probe


def test_first_probe_decides_from_unknown():
    state = HealthState(HealthConfig(fail_threshold=3, pass_threshold=3))
    assert state.status == UNKNOWN and not state.is_healthy
    assert state.record(True) == HEALTHY
    other = HealthState(HealthConfig(fail_threshold=3, pass_threshold=3))
    assert other.record(False, "refused") == UNHEALTHY
    assert other.last_error == "refused"


def test_thresholds_need_consecutive_outcomes():
    state = HealthState(HealthConfig(fail_threshold=2, pass_threshold=3))
    state.record(True)
    assert state.record(False, "x") is None
    assert state.record(True) is None  # resets the failures
    assert state.record(False, "x") is None
    assert state.record(False, "y") == UNHEALTHY
    assert state.record(True) is None
    assert state.record(True) is None
    assert state.record(False, "z") is None  # resets the passes
    assert [state.record(True) for _ in range(3)] == [None, None, HEALTHY]
    assert state.describe() == {
        "status": HEALTHY, "consecutive_passes": 3, "consecutive_failures": 0, "last_error": None, "num_probes": 11,
    }


@pytest.mark.parametrize("field", ["interval_s", "timeout_s", "fail_threshold", "pass_threshold"])
def test_config_is_validated(field):
    with pytest.raises(ValueError):
        HealthConfig(**{field: 0})


class ToggleServer:
    """A real HTTP server whose /health answers 200, 503 or hangs, as the test says."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.num_probes = 0
        self.released = asyncio.Event()  # ends hanging probes at cleanup
        app = web.Application()
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)

    async def health(self, request: web.Request) -> web.Response:
        self.num_probes += 1
        if self.mode == "hang":
            await self.released.wait()
        return web.json_response({"status": self.mode}, status=200 if self.mode == "ok" else 503)

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def close(self) -> None:
        self.released.set()
        await self.runner.cleanup()


async def _wait_for(predicate, timeout_s: float = 3.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_monitor_follows_a_server_going_down_and_up():
    server = ToggleServer()
    url = await server.start()
    changes: list[tuple[str, str]] = []
    config = HealthConfig(interval_s=0.05, timeout_s=0.2, fail_threshold=2, pass_threshold=2)
    monitor = HealthMonitor(config, lambda worker_id, status: changes.append((worker_id, status)))
    state = HealthState(config)
    try:
        monitor.watch("w", url, state)
        await _wait_for(lambda: changes == [("w", HEALTHY)])
        server.mode = "stopping"
        await _wait_for(lambda: len(changes) == 2)
        assert changes[1] == ("w", UNHEALTHY)
        assert state.last_error == "/health answered 503"
        server.mode = "hang"
        probes = server.num_probes
        await _wait_for(lambda: server.num_probes > probes + 1)
        assert state.status == UNHEALTHY
        server.mode = "ok"
        await _wait_for(lambda: len(changes) == 3, timeout_s=5.0)
        assert changes[2] == ("w", HEALTHY)
    finally:
        await monitor.close()
        await server.close()


async def test_probe_reports_refused_and_timeout():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with aiohttp.ClientSession() as session:
        ok, error = await probe(session, f"http://127.0.0.1:{port}", 0.5)
        assert not ok and "ClientConnectorError" in error
        server = ToggleServer()
        url = await server.start()
        try:
            server.mode = "hang"
            ok, error = await probe(session, url, 0.1)
            assert (ok, error) == (False, "/health timed out after 0.1 s")
        finally:
            await server.close()


async def test_a_dead_worker_leaves_rotation_within_5s_with_defaults():
    server = ToggleServer()
    url = await server.start()
    changes: list[str] = []
    monitor = HealthMonitor(HealthConfig(), lambda worker_id, status: changes.append(status))
    try:
        monitor.watch("w", url, HealthState(HealthConfig()))
        await _wait_for(lambda: changes == [HEALTHY])
        server.mode = "hang"  # the worst case: every probe runs into its timeout
        loop = asyncio.get_running_loop()
        died_at = loop.time()
        await _wait_for(lambda: len(changes) == 2, timeout_s=6.0)
        assert changes[1] == UNHEALTHY
        assert loop.time() - died_at < 5.0
    finally:
        await monitor.close()
        await server.close()
