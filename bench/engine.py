"""bench/engine.py: the torch engine's batching and prefix-cache gains, measured in one run.

Drives `worker.engine_core.EngineCore` (the tiny seeded MoE model by default) directly,
without HTTP, so the figures are the engine's own:

- `batching_speedup`: output tokens/s of 16 requests run together under continuous
  batching, over the same 16 requests run one at a time (medians of three alternating
  rounds; target >= 4);
- `prefix_hit_ttft_speedup`: time to first token of a request whose 2,048-token prefix
  is cached, over the same request cold (median of several prefixes; target >= 5);
- `decode_tok_s`: output tokens/s of the steps that only decode, 16 sequences a step;
- `prefill_tok_s`: prompt tokens/s of the cold 2,048-token prefills.

Greedy decoding, `ignore_eos`; prompts are seeded random bytes, so every run measures
the same work. Prints a table for people, then ONE JSON line (the last line).

    .venv/bin/python bench/engine.py --quick            # under two minutes on a laptop CPU
    .venv/bin/python bench/engine.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine_core import DTYPES, EngineConfig, EngineCore  # noqa: E402
from worker.models import ModelConfig  # noqa: E402
from worker.sampling import SamplingParams  # noqa: E402

NUM_CONCURRENT = 16
PREFIX_TOKENS = 2048


def random_prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(256) for _ in range(num_tokens)]


def make_core(args: argparse.Namespace) -> EngineCore:
    config = EngineConfig(num_blocks=1024, device=args.device, dtype=args.dtype)
    return EngineCore(config, ModelConfig(), model_name="bench")


def run_batch(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, float, int]:
    """Runs prompts together; returns (seconds, output tokens, decode-only seconds, decode-only tokens)."""
    for i, prompt in enumerate(prompts):
        core.add_request(f"batch-{time.monotonic_ns()}-{i}", prompt, params)
    num_tokens = num_decode_tokens = 0
    decode_s = 0.0
    started = time.perf_counter()
    while core.has_work():
        step_started = time.perf_counter()
        num_prefill_before = core.scheduler.num_prefill_tokens()
        results = core.step()
        if num_prefill_before == 0:
            decode_s += time.perf_counter() - step_started
            num_decode_tokens += len(results)
        num_tokens += len(results)
    return time.perf_counter() - started, num_tokens, decode_s, num_decode_tokens


def bench_batching(core: EngineCore, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(1)
    prompts = [random_prompt(rng, args.prompt_tokens) for _ in range(NUM_CONCURRENT)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    # Warm-up: both shapes of step (one sequence, sixteen) run before anything is timed.
    warm_up = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    run_batch(core, [random_prompt(rng, args.prompt_tokens) for _ in range(NUM_CONCURRENT)], warm_up)
    for _ in range(4):
        run_batch(core, [random_prompt(rng, args.prompt_tokens)], warm_up)
    # Rounds alternate the two runs, so load from other processes hits both alike.
    serial, batched, decode = [], [], []
    for _ in range(args.rounds):
        serial_s = serial_tokens = 0
        for prompt in prompts:
            seconds, num_tokens, _, _ = run_batch(core, [prompt], params)
            serial_s += seconds
            serial_tokens += num_tokens
        core.pool.reset_prefix_cache()  # the batch must not reuse the serial run's KV
        batch_s, batch_tokens, decode_s, decode_tokens = run_batch(core, prompts, params)
        core.pool.reset_prefix_cache()
        serial.append(serial_tokens / serial_s)
        batched.append(batch_tokens / batch_s)
        decode.append(decode_tokens / decode_s if decode_s else 0.0)
    serial_tok_s, batch_tok_s = statistics.median(serial), statistics.median(batched)
    return {
        "serial_tok_s": serial_tok_s,
        "batched_tok_s": batch_tok_s,
        "batching_speedup": batch_tok_s / serial_tok_s,
        "decode_tok_s": statistics.median(decode),
    }


def time_to_first_token(core: EngineCore, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    core.add_request(f"ttft-{time.monotonic_ns()}", prompt, params)
    while not core.step():
        pass
    return time.perf_counter() - started


def bench_prefix(core: EngineCore, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(2)
    cold, hit = [], []
    for _ in range(args.trials):
        prefix = random_prompt(rng, PREFIX_TOKENS)
        cold.append(time_to_first_token(core, prefix + random_prompt(rng, 16)))
        hit.append(time_to_first_token(core, prefix + random_prompt(rng, 16)))
    cold_s, hit_s = statistics.median(cold), statistics.median(hit)
    return {
        "cold_ttft_ms": cold_s * 1000,
        "hit_ttft_ms": hit_s * 1000,
        "prefix_hit_ttft_speedup": cold_s / hit_s,
        "prefill_tok_s": (PREFIX_TOKENS + 16) / cold_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and trials (under two minutes)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    args = parser.parse_args()
    args.prompt_tokens = 32
    args.output_tokens = 32 if args.quick else 128
    args.trials = 3 if args.quick else 7
    args.rounds = 3
    core = make_core(args)
    results = {**bench_batching(core, args), **bench_prefix(core, args)}
    rows = [
        ("output tok/s, 16 requests one at a time", results["serial_tok_s"]),
        ("output tok/s, 16 requests batched", results["batched_tok_s"]),
        ("batching speedup (target >= 4)", results["batching_speedup"]),
        ("decode tok/s (decode-only steps)", results["decode_tok_s"]),
        ("TTFT, 2,048-token prefix cold (ms)", results["cold_ttft_ms"]),
        ("TTFT, 2,048-token prefix cached (ms)", results["hit_ttft_ms"]),
        ("prefix-hit TTFT speedup (target >= 5)", results["prefix_hit_ttft_speedup"]),
        ("prefill tok/s (cold prefix)", results["prefill_tok_s"]),
    ]
    print(f"torch engine, tiny MoE model on {args.device} ({args.dtype}), {'quick' if args.quick else 'full'} run")
    for name, value in rows:
        print(f"  {name:<42} {value:>10.2f}")
    summary = {"bench": "engine", "device": args.device, "dtype": args.dtype, "quick": args.quick}
    print(json.dumps({**summary, **{k: round(v, 3) for k, v in results.items()}}))


if __name__ == "__main__":
    main()
