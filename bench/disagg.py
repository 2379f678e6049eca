"""Disaggregation benchmark: conditional decode-first disaggregation vs aggregated serving.

Owns: the comparison the issue asks for. Each mode is a real `kvgate up --engine sim`
process tree (`bench/disagg_fleet.py`) of `--workers` simulated workers: "aggregated"
(every worker role both) and, per `--prefill-workers` entry P, "disagg PP+DD" (P
prefill + N-P decode workers, an in-process prefill queue, the router's default
thresholds: a prompt with more than 512 uncached tokens goes remote). All fleets run
side by side; in each of `--rounds` rounds every mode in turn (rotated order, so
background load hits all alike) gets the same open-loop schedule
(`bench/disagg_load.py`): Poisson arrivals, a `--long-fraction` of `--long-tokens`
prompts among 128-512-token ones, every prompt a fresh random string (no prefix cache
hits; round r has seed + r), `--output-tokens` streamed per request, each token
stamped on arrival at the client.

Figures per mode (`bench/disagg_report.py`): TTFT p50/p99, ITL p50/p99 over every gap
between consecutive tokens, as the median over rounds (the ratios use these: one
round hit by a stall of a busy machine does not decide) and pooled over all rounds;
remote prefills (router's `kvgate_disagg_decisions_total`), fallbacks (decode
workers' `kvgate_worker_disagg_fallback_*_total`), and the client's own lag. Latencies
are model milliseconds: wall time x `--speedup`.

Scenario defaults (why): 4 workers at 8 requests/s, a quarter of them 8k-token prompts
(2 long prompts/s). The sim's timing model is its 7B-class GPU default (13 ms per
decode step, 0.05 ms per prefill token: 20k tokens/s), with chunked prefill at 2048
tokens per step (`--max-num-batched-tokens`), the budget a latency-minded deployment
sets (the sim's own default, 8192, makes each long prompt one ~420 ms step instead of
four ~115 ms ones). 2 long prompts/s need 16.4k prefill tokens/s: one prefill worker
would be ~80 % busy and queue them, so a user picks 2 prefill + 2 decode; 1+3 is
measured too. Why not fewer long prompts: a stalled gap happens on the share of
decode steps that carry a prefill chunk, about long prompts/s x 4 chunks x 13 ms / 4
workers: 1.3 % at 1 long prompt/s, where p99 sits on the edge (at 4 requests/s the
aggregated ITL p99 swung between ~115 and ~30 ms from round to round).

Targets: itl_p99_ratio = aggregated / disagg >= 2, ttft_p50_ratio = disagg /
aggregated <= 1.2 (the first `--prefill-workers` entry's mode; others get a `_<P>p`
suffix). `--quick` is one 15 s round of 2+2: a smoke run, whose figures a stall of a
busy machine can spoil (the client line then says the client lags).
Run: `.venv/bin/python bench/disagg.py [--quick]` (logs: bench/out/disagg/). The last
printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path

import uvloop

# Run as a script, this folder would lead sys.path and `bench/indexer.py` would shadow
# the `indexer` package: put the repository root there instead.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.disagg_fleet import Fleet, FleetConfig  # noqa: E402
from bench.disagg_load import ClientRun, WorkloadConfig, make_schedule, run_schedule, warm_up  # noqa: E402
from bench.disagg_report import json_line, mode_figures, print_table, ratio, targets  # noqa: E402
from bench.routing_measure import Progress  # noqa: E402
from worker.sim import SimConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 15 s, 2+2 only (about a minute)")
    parser.add_argument("--workers", type=int, default=4, help="workers in every mode")
    parser.add_argument("--prefill-workers", help="comma-separated prefill worker counts (default 2,1; --quick 2)")
    parser.add_argument("--rounds", type=int, help="rounds over all modes (default 5, --quick 1)")
    parser.add_argument("--duration", type=float, help="model seconds of arrivals per round (default 12, --quick 15)")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per model second (Poisson)")
    parser.add_argument("--long-fraction", type=float, default=0.25, help="share of long prompts")
    parser.add_argument("--long-tokens", type=int, default=8192, help="tokens of a long prompt")
    parser.add_argument("--output-tokens", type=int, default=128, help="tokens streamed per request")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the workers' per-step token budget")
    parser.add_argument("--speedup", type=float, default=1.0, help="sim speedup: model seconds per wall second")
    parser.add_argument("--seed", type=int, default=0, help="seed of round 0's schedule and prompts (round r: +r)")
    args = parser.parse_args(argv)
    try:
        args.prefill_workers = [int(p) for p in (args.prefill_workers or ("2" if args.quick else "2,1")).split(",")]
    except ValueError:
        parser.error("--prefill-workers must be comma-separated integers, e.g. 1,2")
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.duration = args.duration or (15.0 if args.quick else 12.0)
    if not all(1 <= p < args.workers for p in args.prefill_workers):
        parser.error("--prefill-workers entries must be >= 1 and < --workers")
    if args.rate <= 0 or args.duration <= 0 or args.speedup <= 0 or not 0 <= args.long_fraction <= 1:
        parser.error("--rate, --duration and --speedup must be > 0, --long-fraction in [0, 1]")
    if args.rounds < 1 or args.long_tokens < 1 or args.output_tokens < 2 or args.max_num_batched_tokens < 1:
        parser.error("--rounds, --long-tokens and --max-num-batched-tokens must be >= 1, --output-tokens >= 2")
    return args


def start_fleets(stack: contextlib.ExitStack, modes: dict[str, int], args: argparse.Namespace) -> dict[str, Fleet]:
    """Every mode's fleet, started and warmed up; the stack stops them."""
    worker_args = (f"--max-num-batched-tokens={args.max_num_batched_tokens}",)
    fleets = {}
    for label, num_prefill in modes.items():
        fleet = Fleet(label.replace(" ", "_").replace("+", "_"), FleetConfig(args.workers, num_prefill, args.speedup,
                                                                             worker_args))
        stack.callback(fleet.stop)
        fleet.start()
        uvloop.run(warm_up(fleet.url))
        fleets[label] = fleet
    return fleets


def measure(fleets: dict[str, Fleet], args: argparse.Namespace, workload: WorkloadConfig) -> dict[str, list[ClientRun]]:
    """runs[mode] = one ClientRun per round; round r replays schedule r on every mode, in rotated order."""
    runs: dict[str, list[ClientRun]] = {label: [] for label in fleets}
    labels = list(fleets)
    for r in range(args.rounds):
        schedule = make_schedule(dataclasses.replace(workload, seed=args.seed + r))
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
            progress = Progress(f"round {r + 1} {label}", len(schedule))
            runs[label].append(uvloop.run(run_schedule(fleets[label].url, schedule, args.speedup, progress.update)))
            progress.close()
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    return runs


def summarize(runs: dict[str, list[ClientRun]], counters: dict, modes: dict[str, int], args: argparse.Namespace,
              workload: WorkloadConfig) -> dict:
    result: dict = {"modes": {label: mode_figures(runs[label], counters[label], args.speedup) for label in modes}}
    aggregated = result["modes"]["aggregated"]
    for label, num_prefill in list(modes.items())[1:]:
        disagg, suffix = result["modes"][label], "" if num_prefill == args.prefill_workers[0] else f"_{num_prefill}p"
        for prefix, agg, dis in (("", aggregated, disagg), ("pooled_", aggregated["pooled"], disagg["pooled"])):
            result[f"{prefix}itl_p99_ratio{suffix}"] = ratio(agg["itl_p99_ms"], dis["itl_p99_ms"])
            result[f"{prefix}ttft_p50_ratio{suffix}"] = ratio(dis["ttft_p50_ms"], agg["ttft_p50_ms"])
    result["targets"] = targets(result)
    sim = SimConfig()
    result["config"] = {
        "num_workers": args.workers, "prefill_workers": args.prefill_workers, "speedup": args.speedup,
        "num_rounds": args.rounds, "round_s": args.duration,
        "num_requests": aggregated["num_requests"], "num_long": aggregated["num_long"], "rate": args.rate,
        "long_fraction": args.long_fraction, "long_tokens": args.long_tokens,
        "short_tokens": list(workload.short_tokens), "output_tokens": args.output_tokens, "seed": args.seed,
        "max_num_batched_tokens": args.max_num_batched_tokens, "prefill_ms_per_token": sim.prefill_ms_per_token,
        "decode_ms_per_step": sim.decode_ms_per_step, "decode_ms_per_seq": sim.decode_ms_per_seq,
        "step_overhead_ms": sim.step_overhead_ms, "cpus": os.cpu_count(),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = os.getloadavg()[0]
    workload = WorkloadConfig(duration_s=args.duration, rate=args.rate, long_fraction=args.long_fraction,
                              long_tokens=args.long_tokens, output_tokens=args.output_tokens)
    modes = {"aggregated": 0, **{f"disagg {p}P+{args.workers - p}D": p for p in args.prefill_workers}}
    with contextlib.ExitStack() as stack:
        try:
            fleets = start_fleets(stack, modes, args)
        except RuntimeError as exc:
            print(f"disagg bench: {exc}", file=sys.stderr)
            return 1
        runs = measure(fleets, args, workload)
        # Counted since each fleet started: the warm-up requests (short, local) are in them.
        counters = {label: fleet.counters() if modes[label] else {} for label, fleet in fleets.items()}
    result = summarize(runs, counters, modes, args, workload)
    result["config"]["load_avg_1m"] = [round(load_at_start, 2), round(os.getloadavg()[0], 2)]  # at start, at end
    print_table(result)
    print(json_line(result))  # the last line: one JSON object
    return 0


if __name__ == "__main__":
    sys.exit(main())
