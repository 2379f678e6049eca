"""Routing benchmark: replay a Mooncake trace through a simulated fleet, for every policy.

Each trace line (`timestamp` ms, `input_length`, `output_length`, `hash_ids`: chained
ids of 512-token blocks) becomes a request whose prompt is synthesised per hash id
(block id `h` is the tokens `h*512 .. h*512+511`, cut to `input_length`), so equal ids
give equal tokens and equal prefixes give equal chained hashes. The requests arrive at
their trace times at a fleet of simulated engines (`bench/routing_sim.py`: real
`BlockPool`s publishing real KV events into a real `PrefixIndex`, the real
`LoadTracker`, the real policy objects; time is simulated, so a 17-minute trace replays
in seconds). Per policy: token prefix hit rate (cached prompt tokens at first
admission / prompt tokens), TTFT mean / p50 / p99, max/mean load (requests sent per
worker) and max/mean busy time.

Baselines, on the same prompts and block size, with the engines' rule that at least
one prompt token is computed: the ideal hit rate (an infinite cache) and one shared
LRU cache of the fleet's total size (what a single giant worker could reuse).

Timing model defaults (an 8B-class model on one H100-class GPU): 60 us per prefill
token (about 16.7k tokens/s), 50 us per decoding sequence per step, 5 ms per step,
8192 tokens per step, 256 sequences. With these, round robin keeps the fleet about
70 % busy on the synthetic trace, where queueing (hence routing) matters.

The router's own cost is measured too: `Policy.rank` for 8 and 64 candidates (median
us, lookup excluded) and the lookup step (`fill_matches`) for a trace-sized prompt.

When `dynamo._core` imports (pip `ai-dynamo-runtime`), Dynamo's KV router and round
robin run on Dynamo's own mocker on the same trace, and both systems' kv / round-robin
TTFT ratios are printed side by side (each system against itself: the timing models
differ).

Run: `.venv/bin/python bench/routing.py --trace ../shared/traces/synthetic_trace.jsonl
[--quick]`. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Run as a script, this folder would lead sys.path and `bench/indexer.py` would shadow
# the `indexer` package: put the repository root there instead.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.routing_measure import (  # noqa: E402
    Progress,
    bench_rank,
    cache_baselines,
    policy_figures,
    print_report,
    run_dynamo,
    targets,
)
from bench.routing_sim import FleetConfig, SimFleet, TimingModel, load_trace, make_requests  # noqa: E402
from router.policy import POLICY_NAMES, build_policy  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "synthetic_trace.jsonl"
SWEEP_LOAD_WEIGHTS = (0.0, 0.5, 2.0, 4.0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--blocks-per-worker", type=int, default=1250, help="KV blocks per worker")
    parser.add_argument("--block-size", type=int, default=512, help="tokens per KV block")
    parser.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash id")
    parser.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated policy names")
    parser.add_argument("--max-requests", type=int, default=0, help="replay only the first N requests (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every policy's random source")
    parser.add_argument("--prefill-us-per-token", type=float, default=60.0)
    parser.add_argument("--decode-us-per-seq", type=float, default=50.0)
    parser.add_argument("--step-overhead-ms", type=float, default=5.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-event-lag-ms", type=float, default=0.0, help="delay of KV events to the index")
    parser.add_argument("--no-dynamo", action="store_true", help="skip Dynamo's mocker replay")
    parser.add_argument("--quick", action="store_true", help="no kv weight sweep, fewer timing repeats")
    return parser.parse_args()


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    timing = TimingModel(
        prefill_s_per_token=args.prefill_us_per_token * 1e-6,
        decode_s_per_seq=args.decode_us_per_seq * 1e-6,
        step_overhead_s=args.step_overhead_ms * 1e-3,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    return FleetConfig(
        num_workers=args.workers,
        num_blocks=args.blocks_per_worker,
        block_size=args.block_size,
        timing=timing,
        kv_event_lag_s=args.kv_event_lag_ms * 1e-3,
    )


def replay(entries: list, config: FleetConfig, name: str, policy_config: dict, label: str, seed: int) -> dict:
    """One policy over the whole trace, in a fresh fleet; its figures."""
    requests = make_requests(entries)
    fleet = SimFleet(build_policy(name, {"seed": seed, **policy_config}), config)
    progress = Progress(label, len(requests))
    started = time.perf_counter()
    fleet.run(requests, progress.update)
    progress.close()
    figures = policy_figures(requests, fleet)
    figures["wall_s"] = time.perf_counter() - started
    return figures


def main() -> None:
    args = parse_args()
    config = fleet_config(args)
    names = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = sorted(set(names) - set(POLICY_NAMES))
    if unknown:
        sys.exit(f"unknown policies: {', '.join(unknown)} (known: {', '.join(POLICY_NAMES)})")
    entries = load_trace(args.trace, args.trace_block_size, args.max_requests)
    result: dict = {"policies": {}}
    for name in names:
        result["policies"][name] = replay(entries, config, name, {}, name, args.seed)
    result.update(cache_baselines(entries, config))
    if not args.quick:
        result["kv_load_weight_sweep"] = {
            str(weight): replay(entries, config, "kv", {"load_weight": weight}, f"kv w_load={weight}", args.seed)
            for weight in SWEEP_LOAD_WEIGHTS
        }
    result["rank_us"], result["lookup_us"] = bench_rank(entries, config, repeats=300 if args.quick else 2000)
    policies = result["policies"]
    if "kv" in policies and "round_robin" in policies:
        for stat in ("p99", "mean"):
            key = f"ttft_{stat}_s"
            result[f"kvgate_kv_rr_ttft_{stat}_ratio"] = policies["kv"][key] / policies["round_robin"][key]
    if args.no_dynamo:
        result["dynamo_error"] = "skipped (--no-dynamo)"
    else:
        result.update(
            run_dynamo(args.trace, args.workers, args.block_size, args.blocks_per_worker, args.trace_block_size)
        )
    result["targets"] = targets(result)
    result["config"] = {
        "trace": os.path.basename(args.trace),
        "num_requests": len(entries),
        "workers": args.workers,
        "blocks_per_worker": args.blocks_per_worker,
        "block_size": args.block_size,
        "timing": {
            "prefill_us_per_token": args.prefill_us_per_token,
            "decode_us_per_seq": args.decode_us_per_seq,
            "step_overhead_ms": args.step_overhead_ms,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "seed": args.seed,
    }
    print_report(result)


if __name__ == "__main__":
    main()
