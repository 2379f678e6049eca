"""worker.disagg with the torch engine: real KV moved between two engines' caches, over every transport.

A decode and a prefill `TorchEngine` (the same seeded tiny model) share one process,
an in-process queue and a real transport (`worker.kv_ports`: TCP, and NIXL when it
works here). Greedy answers must equal an aggregated engine's, including after
requests aborted while their KV was on its way; the flags reach the engine.
"""

from __future__ import annotations

import argparse
import asyncio
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from indexer.tokenizer import ByteTokenizer
from kvstore.memory_queue import MemoryPrefillQueue
from kvstore.prefill_queue import QueueConfig
from kvstore.transports import available_transports
from worker import torch_cmd, worker_cmd
from worker.api import GenerateRequest, ServedModel
from worker.disagg import DecodeLink, PrefillLoop
from worker.engine_core import EngineConfig, EngineCore
from worker.kv_ports import torch_kv_ports
from worker.models import ModelConfig
from worker.torch_engine import TorchEngine

MODEL = "kvgate-moe-tiny"
CONFIG = EngineConfig(block_size=16, num_blocks=256)


def torch_engine(worker_id: str, timeout_s: float = 10.0) -> TorchEngine:
    core = EngineCore(CONFIG, ModelConfig(), model_name=MODEL, eos_token_id=ByteTokenizer.EOS_ID)
    served = ServedModel(MODEL, ByteTokenizer(), core.max_model_len)
    return TorchEngine(core, served, worker_id=worker_id, remote_prefill_timeout_s=timeout_s)


def request(request_id: str, prompt: list[int], *, remote: bool) -> GenerateRequest:
    return GenerateRequest(request_id, "completion", MODEL, array("l", prompt), 8, temperature=0.0,
                           ignore_eos=True, remote_prefill=remote)


async def run(engine: TorchEngine, req: GenerateRequest) -> list[int]:
    tokens: list[int] = []
    async for output in engine.submit(req):
        tokens.extend(output.token_ids)
    return tokens


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 131 + i * 17) % 250 + 1 for i in range(length)]


@dataclass
class Pair:
    decode: TorchEngine
    prefill: TorchEngine
    loop: PrefillLoop


@pytest.fixture(params=["tcp", "nixl"])
async def pair(request) -> AsyncIterator[Pair]:
    if request.param not in available_transports():
        pytest.skip("NIXL (the `transfer` extra) does not work here")
    queue = MemoryPrefillQueue(QueueConfig(idle_timeout_s=5.0))
    await queue.start()
    decode, prefill = torch_engine("D"), torch_engine("P")
    await decode.start()
    await prefill.start()
    ingress, _ = torch_kv_ports(decode.core, host="127.0.0.1", transport=request.param)
    _, egress = torch_kv_ports(prefill.core, host="127.0.0.1", transport=request.param)
    link = DecodeLink(queue, await ingress(), decode, model=MODEL, worker_id="D", block_size=CONFIG.block_size)
    loop = PrefillLoop(queue, egress(), prefill, model=MODEL, consumer="P", block_size=CONFIG.block_size)
    yield Pair(decode, prefill, loop)  # the test starts the prefill loop
    await loop.close()
    await link.close()
    await decode.stop()
    await prefill.stop()
    await queue.close()


@pytest.fixture(scope="module")
def expected() -> dict[int, list[int]]:
    """Greedy tokens of each prompt from one aggregated engine."""
    core = EngineCore(CONFIG, ModelConfig(), model_name=MODEL, eos_token_id=ByteTokenizer.EOS_ID)
    from worker.sampling import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return {seed: core.generate([prompt(seed, 200 + 37 * seed)], params)[0] for seed in range(6)}


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_remote_kv_gives_the_aggregated_tokens_even_after_aborts(pair: Pair, expected):
    # Two requests are aborted while their jobs wait in the queue. The prefill worker
    # still writes their KV, into blocks the decode worker holds for them until the
    # deadline; the requests after them decode from exact KV all the same.
    doomed = [asyncio.ensure_future(run(pair.decode, request(f"x{i}", prompt(10 + i, 400), remote=True)))
              for i in range(2)]
    await wait_until(lambda: pair.decode.remote.num_pending == 2)
    for i in range(2):
        pair.decode.abort(f"x{i}")
    for task in doomed:
        task.cancel()
    await wait_until(lambda: pair.decode.remote_counters.num_aborted == 2)
    pair.loop.start()
    results = await asyncio.gather(*(run(pair.decode, request(f"r{s}", prompt(s, 200 + 37 * s), remote=True))
                                     for s in range(6)))
    assert results == [expected[s] for s in range(6)]
    counters = pair.decode.remote_counters
    assert (counters.num_requested, counters.num_completed, counters.num_aborted) == (8, 6, 2)
    assert counters.num_fallback_deadline == 0
    await wait_until(lambda: pair.loop.counters.num_jobs_served == 8)
    await wait_until(lambda: not pair.prefill.core.scheduler.held)  # the prefill side released every block


def test_worker_flags_reach_the_torch_engine():
    parser = argparse.ArgumentParser()
    worker_cmd.add_arguments(parser)
    args = parser.parse_args(["--engine", "torch", "--remote-prefill-timeout", "7.5", "--num-blocks", "64",
                              "--events-endpoint", "", "--replay-endpoint", "", "--load-endpoint", ""])
    engine = torch_cmd.build_torch_engine(args, MODEL, ByteTokenizer(), "w")
    assert engine.remote.timeout_s == 7.5
