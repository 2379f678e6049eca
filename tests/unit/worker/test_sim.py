"""worker.sim: the timing model, the output script, and the engine's real text, events and reports."""

from __future__ import annotations

import asyncio
import time

import pytest

from indexer.hashing import hash_prompt
from indexer.index import PrefixIndex
from indexer.load import LoadAggregator, LoadSubscriber
from indexer.subscriber import EventSubscriber
from indexer.tokenizer import ByteTokenizer
from worker.api import EngineUnavailable, GenerateRequest, InvalidRequest, ServedModel
from worker.sim import LOREM, OutputScript, SimConfig, SimEngine

BS = 4
EOS = ByteTokenizer.EOS_ID


# -- config and timing model ----------------------------------------------------------


def test_step_seconds_follows_the_documented_model():
    config = SimConfig()
    assert config.step_seconds(0, 0) == pytest.approx(0.001)
    assert config.step_seconds(1000, 0) == pytest.approx((1.0 + 0.05 * 1000) / 1000)
    assert config.step_seconds(0, 10) == pytest.approx((1.0 + 12.0 + 0.1 * 10) / 1000)
    assert config.step_seconds(200, 4) == pytest.approx((1.0 + 10.0 + 12.0 + 0.4) / 1000)
    fast = SimConfig(speedup=50.0)
    assert fast.step_seconds(200, 4) == pytest.approx(config.step_seconds(200, 4) / 50)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_blocks": 0}, "num_blocks must be positive, got 0"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens must be positive"),
        ({"prefill_ms_per_token": -0.1}, "prefill_ms_per_token must be >= 0"),
        ({"speedup": 0.0}, "speedup must be positive"),
        (
            {"num_blocks": 2, "block_size": 4, "max_model_len": 9},
            "max_model_len must be in [0, num_blocks * block_size = 8]",
        ),
    ],
)
def test_config_names_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("*", r"\*")):
        SimConfig(**fields)


def test_timing_terms_may_be_zero():
    config = SimConfig(step_overhead_ms=0, prefill_ms_per_token=0, decode_ms_per_step=0, decode_ms_per_seq=0)
    assert config.step_seconds(100, 10) == 0.0


def test_context_len_defaults_to_the_pool():
    assert SimConfig(block_size=4, num_blocks=10).context_len == 40
    assert SimConfig(block_size=4, num_blocks=10, max_model_len=12).context_len == 12


# -- the output script ----------------------------------------------------------------


def test_output_is_a_passage_slice_then_eos_and_is_deterministic():
    passage = list(range(10, 30))
    first = OutputScript(passage, [1, 2, 3], None, EOS)
    tokens = [first.next_token() for _ in range(25)]
    start = tokens[0] - 10
    eos_at = len(passage) - start
    assert tokens[:eos_at] == passage[start:] and tokens[eos_at] == EOS
    assert tokens[eos_at + 1 :] == passage[: 25 - eos_at - 1]
    again = OutputScript(passage, [1, 2, 3], None, EOS)
    assert [again.next_token() for _ in range(25)] == tokens
    starts = {OutputScript(passage, [1, 2, 3], seed, EOS).next_token() for seed in range(20)}
    assert len(starts) > 5  # the seed moves the start


def test_without_eos_the_passage_wraps():
    script = OutputScript([7, 8], [5], None, None)
    tokens = [script.next_token() for _ in range(6)]
    assert tokens in ([7, 8, 7, 8, 7, 8], [8, 7, 8, 7, 8, 7])


# -- the engine in real time ----------------------------------------------------------

MODEL = "sim-unit"


def engine(tmp_config: dict | None = None, **endpoints) -> SimEngine:
    config = SimConfig(**{"block_size": BS, "num_blocks": 256, "speedup": 1000.0, **(tmp_config or {})})
    served = ServedModel(MODEL, ByteTokenizer(), config.context_len)
    return SimEngine(config, served, worker_id="w", **endpoints)


def generate(prompt: str, max_tokens: int, request_id: str, **fields) -> GenerateRequest:
    token_ids = ByteTokenizer().encode(prompt, add_special_tokens=True)
    return GenerateRequest(request_id, "completion", MODEL, token_ids, max_tokens, **fields)


async def collect(engine: SimEngine, request: GenerateRequest) -> tuple[list[int], str | None, int]:
    tokens, finish, cached = [], None, 0
    async for output in engine.submit(request):
        tokens += output.token_ids
        finish, cached = output.finish_reason, output.num_cached_tokens
    return tokens, finish, cached


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_engine_generates_exact_text_and_usage():
    sim = engine()
    await sim.start()
    try:
        tokens, finish, cached = await collect(sim, generate("hello there", 30, "r1", ignore_eos=True))
        assert (len(tokens), finish, cached) == (30, "length", 0)
        text = ByteTokenizer().decode(tokens)
        assert text in LOREM + LOREM  # a slice of the passage (ignore_eos: it wraps after EOS)
        again, _, cached = await collect(sim, generate("hello there", 30, "r2", ignore_eos=True))
        # 12 prompt tokens: 3 full blocks, but the last is recomputed for its logits.
        assert again == tokens and cached == 8
        stats = sim.stats()
        assert (stats.num_prompt_tokens, stats.num_cached_prompt_tokens, stats.num_generation_tokens) == (24, 8, 60)
        assert stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0
    finally:
        await sim.stop()


async def test_engine_stops_at_eos_by_default():
    sim = engine()
    await sim.start()
    try:
        tokens, finish, _ = await collect(sim, generate("x", 900, "r"))
        assert finish == "stop" and tokens[-1] == EOS and EOS not in tokens[:-1]
        assert ByteTokenizer().decode(tokens[:-1]) == LOREM[len(LOREM) - len(tokens) + 1 :]
    finally:
        await sim.stop()


async def test_closing_the_stream_aborts_and_frees_blocks():
    sim = engine()
    await sim.start()
    try:
        outputs = sim.submit(generate("a long-running request", 900, "r", ignore_eos=True))
        first = await anext(outputs)
        assert first.token_ids and first.finish_reason is None
        assert sim.pool.num_used_blocks > 0
        await outputs.aclose()
        await wait_until(lambda: sim.pool.num_used_blocks == 0 and not sim.scheduler.has_work())
        sim.abort("r")  # a second abort, and one of an unknown id, are no-ops
        sim.abort("nobody")
    finally:
        await sim.stop()


async def test_submit_refuses_what_cannot_run():
    sim = engine()
    with pytest.raises(EngineUnavailable, match="the engine is not started"):
        sim.submit(generate("x", 1, "early"))
    await sim.start()
    try:
        message = r"^prompt \+ max_tokens = 1025 exceeds the maximum context length 1024$"
        with pytest.raises(InvalidRequest, match=message):
            sim.submit(generate("x", 1023, "too-long"))
        outputs = sim.submit(generate("x", 3, "dup"))
        with pytest.raises(ValueError, match="already in use"):
            sim.submit(generate("y", 3, "dup"))
        await outputs.aclose()
    finally:
        await sim.stop()


async def test_stop_fails_unfinished_requests_with_503():
    sim = engine({"speedup": 1.0})
    await sim.start()
    outputs = sim.submit(generate("slow", 500, "r", ignore_eos=True))
    await sim.stop()
    with pytest.raises(EngineUnavailable, match="shutting down"):
        await anext(outputs)
    assert not sim.is_alive
    with pytest.raises(EngineUnavailable, match="the engine is stopped"):
        sim.submit(generate("x", 1, "late"))


async def test_cached_prefix_shortens_time_to_first_token():
    # 2000 uncached tokens at 0.5 ms each is 1 s of model time: 100 ms at speedup 10.
    sim = engine({"num_blocks": 1024, "prefill_ms_per_token": 0.5, "speedup": 10.0, "max_num_batched_tokens": 4096})
    await sim.start()
    try:
        ttfts = []
        for request_id in ("cold", "warm"):
            started = time.perf_counter()
            outputs = sim.submit(generate("p" * 2000, 1, request_id))
            await anext(outputs)
            ttfts.append(time.perf_counter() - started)
            await outputs.aclose()
        assert ttfts[0] >= 0.1  # sleeps never run short
        assert ttfts[1] < ttfts[0] / 4  # only the last block's 1 token + overhead is computed
    finally:
        await sim.stop()


async def test_engine_publishes_kv_events_and_load_reports():
    any_port = "tcp://127.0.0.1:*"
    sim = engine(events_endpoint=any_port, replay_endpoint=any_port, load_endpoint=any_port)
    await sim.start()
    index = PrefixIndex(BS, default_model=MODEL)
    subscriber = EventSubscriber(index, "w", sim.kv_publisher.bound_endpoint, sim.kv_publisher.bound_replay_endpoint)
    aggregator = LoadAggregator()
    load_subscriber = LoadSubscriber(aggregator, sim.load_publisher.bound_endpoint)
    subscriber.start()
    load_subscriber.start()
    try:
        prompt = "a prompt of several KV blocks"
        await collect(sim, generate(prompt, 5, "main"))
        # ZMQ's slow joiner: publish until the subscriber hears live; replay recovers the rest.
        for i in range(200):
            if subscriber.stats.num_messages:
                break
            await collect(sim, generate(f"nudge {i}", 1, f"nudge-{i}"))
        await wait_until(lambda: index.num_blocks(("w", 0)) == sim.pool.num_cached_blocks)
        assert index.worker_block_hashes(("w", 0)) == sim.pool.cached_block_hashes()
        token_ids = ByteTokenizer().encode(prompt, add_special_tokens=True)
        assert index.find_matches(hash_prompt(token_ids, BS, MODEL)) == {("w", 0): len(token_ids) // BS}
        await wait_until(lambda: aggregator.get(("w", 0)) is not None)
        report = aggregator.get(("w", 0))
        assert (report.worker_id, report.num_kv_blocks_total, report.num_running) == ("w", 256, 0)
    finally:
        await subscriber.stop()
        await load_subscriber.stop()
        await sim.stop()
