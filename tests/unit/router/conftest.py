"""Shared helpers for the gateway's tests: real HTTP servers on 127.0.0.1 and bounded waits."""

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web


@pytest.fixture
async def serve():
    """`await serve(app, runner_class=web.AppRunner) -> base URL`: runs an app on a free port until the test ends."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application, runner_class: type[web.AppRunner] = web.AppRunner) -> str:
        runner = runner_class(app, handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


@pytest.fixture
def wait_until() -> Callable[..., Awaitable[None]]:
    """`await wait_until(predicate, timeout_s=3)`: polls every 10 ms, fails the test on timeout."""

    async def wait(predicate: Callable[[], bool], timeout_s: float = 3.0, what: str = "condition") -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate():
            if loop.time() > deadline:
                pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
            await asyncio.sleep(0.01)

    return wait


@pytest.fixture
async def sim_worker(serve):
    """`await sim_worker(worker_id, model=..., **sim) -> WorkerSpec`: a real sim worker in this process.

    Its KV events, replay and load reports are on real ZMQ sockets; timing is sped up.
    """
    from indexer.tokenizer import ByteTokenizer
    from router.worker_spec import WorkerSpec
    from worker.api import ServedModel
    from worker.server import create_app
    from worker.sim import SimConfig, SimEngine

    async def start(worker_id: str, *, model: str = "sim", block_size: int = 4, **sim) -> WorkerSpec:
        sim.setdefault("speedup", 50.0)
        config = SimConfig(block_size=block_size, num_blocks=sim.pop("num_blocks", 512), **sim)
        engine = SimEngine(
            config, ServedModel(model, ByteTokenizer(), config.context_len), worker_id=worker_id,
            events_endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
            load_endpoint="tcp://127.0.0.1:*",
        )
        url = await serve(create_app(engine))
        return WorkerSpec(
            worker_id=worker_id, url=url, model=model, block_size=block_size,
            events_endpoint=engine.kv_publisher.bound_endpoint,
            replay_endpoint=engine.kv_publisher.bound_replay_endpoint,
            load_endpoint=engine.load_publisher.bound_endpoint,
        )

    return start


@pytest.fixture
async def gateway(serve, wait_until):
    """`await gateway(*specs, **config) -> (url, Gateway)`: a router app in this process.

    Health checks are fast; it returns once every given worker is in rotation.
    """
    from router.app import build_app
    from router.gateway import GATEWAY, GatewayConfig
    from router.health import HealthConfig
    from router.runner import GatewayRunner

    async def start(*specs, wait_healthy: bool = True, **config):
        config.setdefault("health", HealthConfig(interval_s=0.05, timeout_s=0.5, fail_threshold=1, pass_threshold=1))
        app = build_app(GatewayConfig(workers=tuple(specs), **config))
        url = await serve(app, GatewayRunner)  # as `kvgate router` serves it
        state = app[GATEWAY]
        if wait_healthy:
            await wait_until(lambda: len(state.registry.eligible()) == len(specs), what="workers in rotation")
        return url, state

    return start


@pytest.fixture
async def warm_up(wait_until):
    """`await warm_up(state, spec)`: requests straight to a worker until the router follows its events.

    A ZMQ subscriber misses what is published before its connection completes (the
    slow joiner) and catches up on the next batch it does see; these direct requests
    (never routed, so they touch no router metric) make sure one arrived.
    """
    import aiohttp

    async def warm(state, spec, timeout_s: float = 5.0) -> None:
        worker = state.registry.get(spec.worker_id)
        async with aiohttp.ClientSession() as http:
            for attempt in range(int(timeout_s / 0.02)):
                subscriber = worker.event_subscriber
                if subscriber is not None and subscriber.stats.num_batches > 0:
                    return
                body = {"model": spec.model, "prompt": f"warm-up {attempt:>6} of {spec.worker_id}", "max_tokens": 1}
                async with http.post(f"{spec.url}/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                await asyncio.sleep(0.02)
        pytest.fail(f"the router never saw KV events from {spec.worker_id}")

    return warm
