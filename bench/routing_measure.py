"""What `bench/routing.py` measures and prints: figures, baselines, the
router's own cost, Dynamo's replay, targets and the table.

Every figure here is computed from a finished `SimFleet` run or from the trace alone;
nothing here routes. See `bench/routing.py` for the definitions of each figure.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from array import array
from collections import OrderedDict

from bench.routing_sim import FleetConfig, SimFleet, SimRequest, TraceEntry
from indexer.events import BlockStored, EventBatch
from indexer.hashing import hash_prompt
from indexer.index import PrefixIndex
from router.policy import POLICY_NAMES, Candidate, RouteRequest, build_policy, fill_matches, request_hashes

HIT_RATE_TARGET = 0.95  # kv hit rate / shared-cache hit rate


class Progress:
    """A one-line progress bar on stderr, redrawn at most 5 times a second (TTY only)."""

    def __init__(self, label: str, total: int) -> None:
        self.label = label
        self.total = total
        self.enabled = sys.stderr.isatty()
        self._next_draw = 0.0
        self._started = time.perf_counter()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now < self._next_draw:
            return
        self._next_draw = now + 0.2
        width = 30
        filled = width * done // max(1, self.total)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r{self.label:<18} [{bar}] {done}/{self.total} {now - self._started:5.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 80 + "\r")
            sys.stderr.flush()


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    position = (len(sorted_values) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def max_over_mean(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return max(values) / mean if mean > 0 else math.nan


def policy_figures(requests: list[SimRequest], fleet: SimFleet) -> dict:
    served = [r for r in requests if not r.rejected]
    ttft = sorted(r.ttft_s for r in served)
    num_prompt = sum(len(r.token_ids) for r in served)
    return {
        "hit_rate": sum(r.num_cached_tokens for r in served) / num_prompt if num_prompt else math.nan,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else math.nan,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "max_mean_load": max_over_mean(fleet.requests_per_worker),
        "max_mean_busy": max_over_mean([engine.busy_s for engine in fleet.engines]),
        "requests_per_worker": list(fleet.requests_per_worker),
        "num_rejected": len(requests) - len(served),
        "num_preempted": sum(engine.num_preempted for engine in fleet.engines),
        "sim_duration_s": fleet.now,
    }


def cache_baselines(entries: list[TraceEntry], config: FleetConfig) -> dict:
    """Token hit rates of an infinite cache and of one shared LRU of the fleet's size.

    Both count, like the engines, full blocks only and at most `(n - 1) // block_size`
    blocks of an n-token prompt. The shared LRU refreshes a prompt's blocks leaf first,
    as a block pool frees a request's blocks tail first.
    """
    block_size = config.block_size
    capacity = config.num_workers * config.num_blocks
    seen: set[int] = set()
    lru: OrderedDict[int, None] = OrderedDict()
    num_tokens = num_ideal = num_shared = 0
    for entry in entries:
        hashes = hash_prompt(entry.token_ids, block_size, config.model)
        num_tokens += len(entry.token_ids)
        limit = (len(entry.token_ids) - 1) // block_size
        num_ideal += _leading(hashes, seen, limit) * block_size
        num_shared += _leading(hashes, lru, limit) * block_size
        seen.update(hashes)
        for block_hash in reversed(hashes):
            lru[block_hash] = None
            lru.move_to_end(block_hash)
        while len(lru) > capacity:
            lru.popitem(last=False)
    return {
        "ideal_hit_rate": num_ideal / num_tokens,
        "shared_cache_hit_rate": num_shared / num_tokens,
        "shared_cache_blocks": capacity,
    }


def _leading(hashes: list, present: set | OrderedDict, limit: int) -> int:
    count = 0
    for block_hash in hashes[:limit]:
        if block_hash not in present:
            break
        count += 1
    return count


def bench_rank(entries: list[TraceEntry], config: FleetConfig, repeats: int) -> tuple[dict, dict]:
    """Median `Policy.rank` time (us) per policy for 8 and 64 candidates, and the lookup
    step's time for the trace's median prompt on an index holding it on 8 workers."""
    by_size = sorted(entries, key=lambda entry: len(entry.token_ids))
    prompt = by_size[len(by_size) // 2].token_ids
    rank_us: dict[str, dict[str, float]] = {}
    for name in POLICY_NAMES:
        rank_us[name] = {}
        for num_candidates in (8, 64):
            policy = build_policy(name, {"seed": 0})
            candidates = _bench_candidates(num_candidates, config, len(prompt))
            request = RouteRequest("bench", config.model, prompt, len(prompt), 128)
            request_hashes(request, config.block_size)
            for candidate in candidates[::3]:  # something in the approximate trees
                policy.on_dispatch(request, candidate)
            rank_us[name][str(num_candidates)] = _median_us(lambda: policy.rank(request, candidates), repeats)
    return rank_us, _bench_lookup(prompt, config, repeats)


def _bench_candidates(num: int, config: FleetConfig, num_prompt: int) -> list[Candidate]:
    num_blocks = num_prompt // config.block_size
    candidates = []
    for i in range(num):
        candidate = Candidate(f"worker-{i}", 0, "", "both", config.model, config.block_size)
        candidate.matched_blocks = (i * 7) % (num_blocks + 1)
        candidate.num_running, candidate.num_waiting = i % 9, i % 3
        candidate.kv_usage, candidate.num_kv_blocks_total = (i % 10) / 10, config.num_blocks
        candidate.predicted_prefill_tokens = (i * 1237) % 20_000
        candidate.predicted_requests, candidate.predicted_blocks = i % 11, (i * 13) % config.num_blocks
        candidates.append(candidate)
    return candidates


def _bench_lookup(prompt: array, config: FleetConfig, repeats: int) -> dict:
    index = PrefixIndex(config.block_size, config.model)
    num_full = len(prompt) // config.block_size * config.block_size
    tokens = list(prompt[:num_full])
    hashes = hash_prompt(prompt, config.block_size, config.model)
    for i in range(8):
        # Worker i holds the first i/8 of the prompt.
        num_blocks = len(hashes) * i // 8
        if num_blocks:
            stored = BlockStored(
                hashes[:num_blocks], None, tokens[: num_blocks * config.block_size], config.block_size, None
            )
            index.apply((f"worker-{i}", 0), EventBatch(0.0, [stored], 0))
    candidates = _bench_candidates(8, config, len(prompt))

    def lookup() -> None:
        request = RouteRequest("bench", config.model, prompt, len(prompt), 128)
        fill_matches(index, request, candidates)

    return {"prompt_tokens": len(prompt), "p50_us": _median_us(lookup, repeats)}


def _median_us(call, repeats: int) -> float:  # noqa: ANN001
    for _ in range(min(50, repeats)):
        call()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        started = clock()
        call()
        samples.append(clock() - started)
    return statistics.median(samples) / 1000.0


def run_dynamo(trace: str, num_workers: int, block_size: int, num_blocks: int, trace_block_size: int) -> dict:
    """Dynamo's router on Dynamo's mocker, kv and round robin; errors are reported, not raised."""
    result: dict = {"dynamo": None, "dynamo_error": None}
    os.environ.setdefault("DYN_LOG", "error")  # its per-request INFO lines would flood the output
    try:
        import dynamo._core as core
    except Exception as exc:  # ImportError, or a broken native library
        result["dynamo_error"] = f"dynamo._core does not import: {exc!r}"
        return result
    runs = {}
    for label, mode in (("kv", "kv_router"), ("round_robin", "round_robin")):
        try:
            replay = core.run_mocker_trace_replay(
                [trace],
                num_workers=num_workers,
                router_mode=mode,
                replay_mode="offline",
                trace_block_size=trace_block_size,
                extra_engine_args={"engine": {"block_size": block_size, "num_gpu_blocks": num_blocks}},
            )
            summary = replay.summary
            runs[label] = {
                "hit_rate": summary["prefix_cache_reused_ratio"],
                "ttft_mean_s": summary["mean_ttft_ms"] / 1e3,
                "ttft_p50_s": summary["median_ttft_ms"] / 1e3,
                "ttft_p99_s": summary["p99_ttft_ms"] / 1e3,
            }
        except Exception as exc:  # a failed replay must not lose kvgate's figures
            result["dynamo_error"] = f"run_mocker_trace_replay({mode}) failed: {exc!r}"
            print(f"dynamo: {result['dynamo_error']}", file=sys.stderr)
            return result
    result["dynamo"] = runs
    for stat in ("p99", "mean"):
        key = f"ttft_{stat}_s"
        result[f"dynamo_kv_rr_ttft_{stat}_ratio"] = runs["kv"][key] / runs["round_robin"][key]
    return result


def targets(result: dict) -> dict:
    policies = result["policies"]
    if "kv" not in policies:
        return {}
    kv = policies["kv"]
    others = {name: figures["ttft_p99_s"] for name, figures in policies.items() if name != "kv"}
    checks = {
        "kv_hit_vs_shared_cache": {
            "value": kv["hit_rate"] / result["shared_cache_hit_rate"],
            "limit": HIT_RATE_TARGET,
            "pass": kv["hit_rate"] >= HIT_RATE_TARGET * result["shared_cache_hit_rate"],
        }
    }
    if others:
        best_other = min(others, key=others.__getitem__)
        checks["kv_lowest_ttft_p99"] = {
            "value": kv["ttft_p99_s"],
            "limit": others[best_other],
            "runner_up": best_other,
            "pass": kv["ttft_p99_s"] <= others[best_other],
        }
    return checks


def print_report(result: dict) -> None:
    """The table for people, then the whole result as one JSON line (the last line)."""
    print_table(result)
    print(json.dumps(_rounded(result)))


def _rounded(value: object) -> object:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def print_table(result: dict) -> None:
    config = result["config"]
    print(
        f"routing replay: {config['trace']}, {config['num_requests']} requests, {config['workers']} workers x "
        f"{config['blocks_per_worker']} blocks of {config['block_size']} tokens, timing {config['timing']}"
    )
    header = f"{'policy':<22}{'hit rate':>9}{'ttft mean':>11}{'p50':>9}{'p99':>9}{'max/mean':>10}{'busy':>7}{'preempt':>9}"
    print(header)
    rows = list(result["policies"].items())
    rows += [(f"kv w_load={w}", figures) for w, figures in result.get("kv_load_weight_sweep", {}).items()]
    for name, f in rows:
        print(
            f"{name:<22}{f['hit_rate']:>9.3f}{f['ttft_mean_s']:>10.3f}s{f['ttft_p50_s']:>8.3f}s"
            f"{f['ttft_p99_s']:>8.3f}s{f['max_mean_load']:>10.2f}{f['max_mean_busy']:>7.2f}{f['num_preempted']:>9}"
        )
    print(f"{'ideal (infinite cache)':<22}{result['ideal_hit_rate']:>9.3f}")
    print(f"{'shared LRU':<22}{result['shared_cache_hit_rate']:>9.3f}  ({result['shared_cache_blocks']} blocks)")
    print("rank us (8 / 64 candidates): " + ", ".join(
        f"{name} {v['8']:.1f} / {v['64']:.1f}" for name, v in result["rank_us"].items()
    ))
    lookup = result["lookup_us"]
    print(f"lookup (hash + find_matches) for a {lookup['prompt_tokens']}-token prompt: {lookup['p50_us']:.1f} us")
    _print_dynamo(result)
    for key, check in result["targets"].items():
        verdict = "PASS" if check["pass"] else "FAIL"
        print(f"target {key}: {check['value']:.3f} (limit {check['limit']:.3f}) {verdict}")


def _print_dynamo(result: dict) -> None:
    if result.get("dynamo") is None:
        print(f"dynamo: not run: {result.get('dynamo_error')}")
        return
    print(f"{'kv / round robin TTFT':<24}{'kvgate':>10}{'dynamo':>10}")
    for stat in ("mean", "p99"):
        ours = result.get(f"kvgate_kv_rr_ttft_{stat}_ratio", math.nan)
        theirs = result[f"dynamo_kv_rr_ttft_{stat}_ratio"]
        print(f"{stat:<24}{ours:>10.3f}{theirs:>10.3f}")
    for label, run in result["dynamo"].items():
        print(
            f"dynamo mocker {label:<12} hit {run['hit_rate']:.3f} ttft mean {run['ttft_mean_s']:.3f}s "
            f"p50 {run['ttft_p50_s']:.3f}s p99 {run['ttft_p99_s']:.3f}s"
        )
