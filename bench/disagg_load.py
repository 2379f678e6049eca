"""The disaggregation benchmark's workload and its open-loop streaming client.

Owns: the arrival schedule (`make_schedule`: Poisson arrivals of long and short
prompts, every prompt a fresh random letter string so no two share a KV block), and
`run_schedule`, which sends each request at its scheduled time whatever is still in
flight (open loop), streams it, and stamps every streamed token on arrival. Also the
client's own health: `LagProbe` (how late the event loop wakes up) and each request's
send lag (how late it left against the schedule), so a lagging load generator shows.

Invariants: the schedule depends on its seed and parameters only, so both serving
modes of one run get the same prompts at the same (model-time) instants; `Planned.at_s`
is in model seconds, divided by the fleet's speedup when sent.
Callers: `bench/disagg.py`.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

MODEL = "kvgate-sim"
_LETTERS = string.ascii_lowercase


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """What arrives: model-time seconds and rates; prompt lengths in tokens (bytes)."""

    duration_s: float = 60.0
    rate: float = 8.0  # requests per model second, Poisson
    long_fraction: float = 0.25
    long_tokens: int = 8192
    short_tokens: tuple[int, int] = (128, 512)  # uniform range
    output_tokens: int = 128
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Planned:
    at_s: float  # model seconds after the start
    is_long: bool
    prompt: str
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it; times are `time.perf_counter()` seconds."""

    is_long: bool
    due: float
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0  # generated, from the usage chunk: an EOS (ignored) streams no text event
    prefill: str = ""  # the router's x-kvgate-prefill header
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.sent

    def gaps_s(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]


def make_schedule(config: WorkloadConfig) -> list[Planned]:
    """Poisson arrivals over `duration_s`; each request long with `long_fraction` odds."""
    rng = random.Random(config.seed)
    planned, at = [], rng.expovariate(config.rate)
    while at < config.duration_s:
        is_long = rng.random() < config.long_fraction
        num_tokens = config.long_tokens if is_long else rng.randint(*config.short_tokens)
        prompt = "".join(rng.choices(_LETTERS, k=num_tokens))
        planned.append(Planned(at, is_long, prompt, config.output_tokens))
        at += rng.expovariate(config.rate)
    return planned


class LagProbe:
    """Wakes every `interval_s` and records how late each wake-up came (the loop's lag)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.lags_s: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            due = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.lags_s.append(max(0.0, time.perf_counter() - due))


@dataclass(slots=True)
class ClientRun:
    outcomes: list[Outcome]
    loop_lags_s: list[float]
    wall_s: float
    cpu_s: float  # the client process's CPU time over the run


async def _stream(session: aiohttp.ClientSession, url: str, plan: Planned, outcome: Outcome) -> None:
    body = {"model": MODEL, "prompt": plan.prompt, "max_tokens": plan.max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
    outcome.sent = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            outcome.prefill = response.headers.get("x-kvgate-prefill", "")
            if response.status != 200:
                outcome.error = f"status {response.status}: {(await response.text())[:200]}"
                return
            async for line in response.content:
                if line.startswith(b'data: {') and b'"choices":[]' in line:
                    outcome.num_tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                elif line.startswith(b"data: {"):
                    outcome.token_times.append(time.perf_counter())
                elif line.startswith(b"data: [DONE]"):
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    if not outcome.error and outcome.num_tokens != plan.max_tokens:
        outcome.error = f"{outcome.num_tokens} tokens generated, {plan.max_tokens} asked for"
    elif not outcome.error and not outcome.token_times:
        outcome.error = "no token streamed"


async def warm_up(url: str, num_requests: int = 8, settle_s: float = 1.0) -> None:
    """Short streamed requests, then a pause: first-request costs and startup work are not measured."""
    rng = random.Random(-1)
    plans = [Planned(0.0, False, "".join(rng.choices(_LETTERS, k=64)), 8) for _ in range(num_requests)]
    outcomes = [Outcome(False, 0.0) for _ in plans]
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(_stream(session, url, plan, outcome) for plan, outcome in zip(plans, outcomes)))
    if errors := [o.error for o in outcomes if o.error]:
        raise RuntimeError(f"a warm-up request failed: {errors[0]}")
    await asyncio.sleep(settle_s)


async def run_schedule(url: str, schedule: list[Planned], speedup: float,
                       on_done: Callable[[int], None] = lambda n: None) -> ClientRun:
    """Sends every planned request at `at_s / speedup` wall seconds after the start."""
    probe = LagProbe()
    probe.start()
    num_done = 0
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120.0)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start, cpu0 = time.perf_counter() + 0.05, time.process_time()
        outcomes = [Outcome(plan.is_long, start + plan.at_s / speedup) for plan in schedule]

        async def one(plan: Planned, outcome: Outcome) -> None:
            nonlocal num_done
            await asyncio.sleep(max(0.0, outcome.due - time.perf_counter()))
            await _stream(session, url, plan, outcome)
            num_done += 1
            on_done(num_done)

        await asyncio.gather(*(one(plan, outcome) for plan, outcome in zip(schedule, outcomes)))
        wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu0
    await probe.stop()
    return ClientRun(outcomes, probe.lags_s, wall_s, cpu_s)
