"""Benchmark of the prefix index (`indexer/index.py`), with Dynamo's RadixTree beside it.

Workload (block_size 16, 8 workers, token ids uniform in a 128k vocabulary):
- 32 shared system prompts of 8, 16, 24 or 32 blocks; each worker caches chains of 64
  blocks = a system prompt + its own continuation. A worker's first chain on a prompt is
  published as one BlockStored of 64 blocks with no parent; later chains on that prompt
  publish only their continuation, chained to the prompt's last block (as an engine
  would: cached blocks are not stored twice).
- each worker also caches a 1024-block document (16 events of 64 blocks); workers
  2k and 2k+1 share its first 512 blocks.
- chains are added until each worker holds at least 12,500 blocks: about 100,000
  (block, worker) entries in all (100,216 with seed 0). Engine hashes are random u64,
  unrelated to ours, equal for equal content on every worker. Each event is its own
  EventBatch, pre-encoded to msgpack.

Queries (hashed with `hash_prompt`) of 64 and 1024 blocks come in equal numbers of full
hits, partial hits (a random number of leading blocks) and misses; `find_p50_us_64` is
over all three kinds, and each kind is also reported on its own.

Dynamo gets the same events as JSON (`tokens_hash` = our chained hash, so both answer
the same queries) and, unlike kvgate, never hashes token ids. The two take turns in one
process and figures are medians over repeats: this machine's speed drifts, so compare
ratios rather than absolute figures across runs. The last printed line is one JSON object.

Run: `.venv/bin/python bench/indexer.py [--quick]`.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Run as a script, this file's folder leads sys.path and its name would shadow the
# `indexer` package it measures: put the repository root there instead.
if Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from indexer.events import BatchDecoder, BlockRemoved, BlockStored, EventBatch, encode_batch
from indexer.hashing import hash_blocks, hash_prompt, namespace_root, token_array
from indexer.index import PrefixIndex, WorkerKey

BLOCK_SIZE = 16
VOCAB = 128_000
NUM_WORKERS = 8
CHAIN_BLOCKS = 64
ENTRIES_PER_WORKER = 12_500
NUM_PROMPTS = 32
PROMPT_BLOCKS = (8, 16, 24, 32)
DOC_BLOCKS = 1024
TARGETS = {"blocks_per_s": 1_000_000, "find_p50_us_64": 10.0, "bytes_per_block": 250.0}


@dataclass
class Workload:
    workers: list[WorkerKey]
    stored: list[tuple[int, bytes]] = field(default_factory=list)  # (worker index, msgpack)
    removed: list[tuple[int, bytes]] = field(default_factory=list)
    dynamo_stored: list[tuple[int, bytes]] = field(default_factory=list)  # JSON
    dynamo_removed: list[tuple[int, bytes]] = field(default_factory=list)
    chains: list[list[int]] = field(default_factory=list)  # token ids of full chains
    docs: list[list[int]] = field(default_factory=list)
    num_blocks: int = 0


class _Builder:
    """Turns chains of token ids into per-worker events in both encodings."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.root = namespace_root()
        self.engine_hashes: dict[int, int] = {}  # own hash -> engine hash
        self.events: list[list[tuple[BlockStored, list[int]]]] = [[] for _ in range(NUM_WORKERS)]

    def tokens(self, num_blocks: int) -> list[int]:
        return self.rng.choices(range(VOCAB), k=num_blocks * BLOCK_SIZE)

    def store(self, worker: int, tokens: list[int], num_cached: int) -> None:
        """One BlockStored for the blocks of `tokens` past its first `num_cached`."""
        own = hash_blocks(tokens, BLOCK_SIZE, self.root)
        for block_hash in own:
            self.engine_hashes.setdefault(block_hash, self.rng.getrandbits(64))
        engine = [self.engine_hashes[h] for h in own]
        parent = engine[num_cached - 1] if num_cached else None
        event = BlockStored(
            block_hashes=engine[num_cached:],
            parent_block_hash=parent,
            token_ids=tokens[num_cached * BLOCK_SIZE :],
            block_size=BLOCK_SIZE,
        )
        self.events[worker].append((event, own[num_cached:]))


def build_workload(seed: int) -> Workload:
    builder = _Builder(random.Random(seed))
    workload = Workload(workers=[(f"worker-{w}", 0) for w in range(NUM_WORKERS)])
    prompts = [builder.tokens(PROMPT_BLOCKS[p % len(PROMPT_BLOCKS)]) for p in range(NUM_PROMPTS)]
    doc_heads = [builder.tokens(DOC_BLOCKS // 2) for _ in range(NUM_WORKERS // 2)]
    for w in range(NUM_WORKERS):
        doc = doc_heads[w // 2] + builder.tokens(DOC_BLOCKS // 2)
        workload.docs.append(doc)
        for start in range(0, DOC_BLOCKS, CHAIN_BLOCKS):
            builder.store(w, doc[: (start + CHAIN_BLOCKS) * BLOCK_SIZE], start)
        _add_chains(builder, w, prompts, workload)
    _encode(builder, workload)
    return workload


def _add_chains(builder: _Builder, w: int, prompts: list[list[int]], workload: Workload) -> None:
    cached_prompts: set[int] = set()
    num_blocks = DOC_BLOCKS
    while num_blocks < ENTRIES_PER_WORKER:
        p = builder.rng.randrange(NUM_PROMPTS)
        prompt = prompts[p]
        chain = prompt + builder.tokens(CHAIN_BLOCKS - len(prompt) // BLOCK_SIZE)
        num_cached = len(prompt) // BLOCK_SIZE if p in cached_prompts else 0
        cached_prompts.add(p)
        builder.store(w, chain, num_cached)
        workload.chains.append(chain)
        num_blocks += CHAIN_BLOCKS - num_cached


def _encode(builder: _Builder, workload: Workload) -> None:
    """Interleaves the workers' events round robin and encodes both formats."""
    num_events = max(len(events) for events in builder.events)
    for i in range(num_events):
        for w, events in enumerate(builder.events):
            if i < len(events):
                event, own = events[i]
                workload.stored.append((w, encode_batch(EventBatch(0.0, [event], 0))))
                workload.dynamo_stored.append((w, _dynamo_stored(i, event, own)))
                workload.num_blocks += len(own)
    for w, events in enumerate(builder.events):
        # Evict leaves first: the reverse of the order the blocks were stored in.
        engine = [h for event, _ in events for h in event.block_hashes][::-1]
        for start in range(0, len(engine), CHAIN_BLOCKS):
            chunk = engine[start : start + CHAIN_BLOCKS]
            removed = BlockRemoved(block_hashes=chunk)
            workload.removed.append((w, encode_batch(EventBatch(0.0, [removed], 0))))
            body = {"event_id": start, "data": {"removed": {"block_hashes": chunk}}}
            workload.dynamo_removed.append((w, json.dumps(body).encode()))


def _dynamo_stored(event_id: int, event: BlockStored, own: list[int]) -> bytes:
    blocks = [{"block_hash": e, "tokens_hash": h} for e, h in zip(event.block_hashes, own)]
    stored = {"parent_hash": event.parent_block_hash, "blocks": blocks}
    return json.dumps({"event_id": event_id, "data": {"stored": stored}}).encode()


# ---------------------------------------------------------------------- queries


def build_queries(workload: Workload, seed: int, num_each: int) -> dict[str, list[list[int]]]:
    """Block-hash queries of 64 and 1024 blocks that hit, partly hit and miss."""
    rng = random.Random(seed + 1)

    def fresh(num_blocks: int) -> list[int]:
        return rng.choices(range(VOCAB), k=num_blocks * BLOCK_SIZE)

    def partial(tokens: list[int], num_blocks: int) -> list[int]:
        keep = rng.randrange(1, num_blocks) * BLOCK_SIZE
        return tokens[:keep] + fresh(num_blocks)[keep:]

    queries: dict[str, list[list[int]]] = {}
    for size, sources in ((CHAIN_BLOCKS, workload.chains), (DOC_BLOCKS, workload.docs)):
        picks = [rng.choice(sources) for _ in range(num_each)]
        queries[f"{size}_hit"] = [hash_prompt(t, BLOCK_SIZE) for t in picks]
        queries[f"{size}_partial"] = [hash_prompt(partial(t, size), BLOCK_SIZE) for t in picks]
        queries[f"{size}_miss"] = [hash_prompt(fresh(size), BLOCK_SIZE) for _ in range(num_each)]
    return queries


# ---------------------------------------------------------------------- timing


def interleaved_medians(runs: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    """Median of each run's own timing (ns): one warm-up each, then taking turns.

    Taking turns spreads the noise of a shared machine over every contender alike.
    """
    for run in runs.values():
        run()
    samples: dict[str, list[int]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(run())
    return {name: statistics.median(times) for name, times in samples.items()}


def interleaved_latencies(
    finds: dict[str, Callable[[list[int]], object]], queries: dict[str, list[list[int]]], passes: int
) -> dict[str, dict[str, list[float]]]:
    """Per contender and query kind, the latency (us) of every call after a warm-up pass."""
    clock = time.perf_counter_ns
    latencies: dict[str, dict[str, list[float]]] = {name: {kind: [] for kind in queries} for name in finds}
    for num_pass in range(passes + 1):
        for name, find in finds.items():
            # Lets the other contender's threads go idle before this one is timed.
            spin(0.2)
            for kind, qs in queries.items():
                samples = latencies[name][kind]
                for query in qs:
                    start = clock()
                    find(query)
                    elapsed = clock() - start
                    if num_pass:
                        samples.append(elapsed / 1000)
    return latencies


def spin(seconds: float) -> None:
    """Keeps a core busy so an idle CPU clocks up before anything is timed."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        sum(range(1000))


def cpu_probe_ms(repeats: int) -> float:
    """A fixed pure-Python loop: how fast this machine was during the run (it drifts)."""
    def run() -> int:
        start = time.perf_counter_ns()
        sum(range(1_000_000))
        return time.perf_counter_ns() - start

    return interleaved_medians({"probe": run}, repeats)["probe"] / 1e6


def percentile(samples: Sequence[float], q: float) -> float:
    return sorted(samples)[min(len(samples) - 1, int(q * len(samples)))]


# ---------------------------------------------------------------------- contenders


class Kvgate:
    """kvgate's PrefixIndex fed msgpack payloads (or batches decoded beforehand)."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        decode = BatchDecoder().decode
        self.decoded = [(w, decode(p)) for w, p in workload.stored]
        self.index = PrefixIndex(BLOCK_SIZE)
        self.apply(self.decoded, self.index)

    def apply(self, items: list[tuple[int, bytes]] | list[tuple[int, EventBatch]], index: PrefixIndex) -> int:
        """Applies payloads (decoding each) or decoded batches; returns the time taken."""
        decode = BatchDecoder().decode
        apply = index.apply
        workers = self.workload.workers
        start = time.perf_counter_ns()
        for w, item in items:
            apply(workers[w], decode(item) if isinstance(item, bytes) else item)
        return time.perf_counter_ns() - start

    def decode_only(self) -> int:
        decode = BatchDecoder().decode
        start = time.perf_counter_ns()
        for _, payload in self.workload.stored:
            decode(payload)
        return time.perf_counter_ns() - start

    def store(self) -> int:
        return self.apply(self.workload.stored, PrefixIndex(BLOCK_SIZE))

    def store_decoded(self) -> int:
        return self.apply(self.decoded, PrefixIndex(BLOCK_SIZE))

    def remove(self) -> int:
        index = PrefixIndex(BLOCK_SIZE)
        self.apply(self.decoded, index)
        elapsed = self.apply(self.workload.removed, index)
        assert index.stats().num_entries == 0
        return elapsed


class Dynamo:
    """Dynamo's RadixTree fed the same events as JSON, with precomputed hashes."""

    def __init__(self, radix_tree: type, workload: Workload) -> None:
        self.radix_tree = radix_tree
        self.workload = workload
        self.tree = radix_tree()
        self.apply(self.tree, workload.dynamo_stored)

    @staticmethod
    def apply(tree: object, events: list[tuple[int, bytes]]) -> int:
        apply = tree.apply_event  # type: ignore[attr-defined]
        start = time.perf_counter_ns()
        for w, body in events:
            apply(w, body)
        # The tree works on its own thread: a lookup waits for the events queued before it.
        tree.find_matches([0])  # type: ignore[attr-defined]
        return time.perf_counter_ns() - start

    def store(self) -> int:
        return self.apply(self.radix_tree(), self.workload.dynamo_stored)

    def remove(self) -> int:
        tree = self.radix_tree()
        self.apply(tree, self.workload.dynamo_stored)
        return self.apply(tree, self.workload.dynamo_removed)

    def find(self, query: list[int]) -> dict[tuple[int, int], int]:
        # `.scores` turns the result into a dict, as kvgate's find_matches returns one.
        return self.tree.find_matches(query).scores


def load_dynamo() -> tuple[type | None, str | None]:
    try:
        from dynamo._core import RadixTree
    except Exception as exc:  # ImportError, or a native wheel that fails to load
        return None, f"{type(exc).__name__}: {exc}"
    return RadixTree, None


def count_disagreements(ours: Kvgate, theirs: Dynamo, queries: dict[str, list[list[int]]]) -> int:
    """Queries where Dynamo's scores differ from kvgate's matches."""
    workers = ours.workload.workers
    num_differ = 0
    for qs in queries.values():
        for query in qs:
            scores = {workers[w]: n for (w, _rank), n in theirs.find(query).items()}
            num_differ += scores != ours.index.find_matches(query)
    return num_differ


def measure_memory(ours: Kvgate) -> tuple[float, int, int]:
    """(bytes per entry, tracemalloc residue after removing everything, stats estimate)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(BLOCK_SIZE)
        ours.apply(ours.workload.stored, index)
        gc.collect()
        stats = index.stats()
        held = tracemalloc.get_traced_memory()[0] - base
        ours.apply(ours.workload.removed, index)
        gc.collect()
        residue = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return held / stats.num_entries, residue, stats.num_bytes


def bench_hashing(repeats: int) -> dict[str, float]:
    tokens = random.Random(7).choices(range(VOCAB), k=128 * 1024)
    sources = {"list": tokens, "array": token_array(tokens)}
    runs = {}
    for name, source in sources.items():
        for block_size in (16, 64):
            def run(source=source, block_size=block_size) -> int:
                start = time.perf_counter_ns()
                hash_prompt(source, block_size)
                return time.perf_counter_ns() - start

            runs[f"hash_128k_ms_{name}_bs{block_size}"] = run
    return {key: ns / 1e6 for key, ns in interleaved_medians(runs, repeats).items()}


# ---------------------------------------------------------------------- run and report


def measure(workload: Workload, queries: dict, repeats: int, passes: int, radix_tree: type | None) -> tuple:
    """Timings (ns, medians) and latencies of kvgate and, when it loads, Dynamo."""
    ours = Kvgate(workload)
    runs = {
        "store": ours.store,
        "store_decoded": ours.store_decoded,
        "decode": ours.decode_only,
        "remove": ours.remove,
    }
    finds: dict[str, Callable[[list[int]], object]] = {"kvgate": ours.index.find_matches}
    theirs = None
    if radix_tree is not None:
        theirs = Dynamo(radix_tree, workload)
        runs.update(dynamo_store=theirs.store, dynamo_remove=theirs.remove)
        finds["dynamo"] = theirs.find
    times = interleaved_medians(runs, repeats)
    latencies = interleaved_latencies(finds, queries, passes)
    return ours, theirs, times, latencies


def summarise(workload: Workload, times: dict[str, float], latencies: dict) -> dict:
    num = workload.num_blocks
    result: dict = {
        "blocks_per_s": num / times["store"] * 1e9,
        "blocks_per_s_nodecode": num / times["store_decoded"] * 1e9,
        "decode_ns_per_block": times["decode"] / num,
        "remove_blocks_per_s": num / times["remove"] * 1e9,
    }
    result.update(_latency_figures("", latencies["kvgate"]))
    dynamo_keys = ["dynamo_blocks_per_s", "dynamo_remove_blocks_per_s", "blocks_per_s_vs_dynamo"]
    dynamo_keys += ["find_p50_64_vs_dynamo"] + [f"dynamo_{key}" for key in result if key.startswith("find_")]
    result.update(dict.fromkeys(dynamo_keys))
    if "dynamo" in latencies:
        result["dynamo_blocks_per_s"] = num / times["dynamo_store"] * 1e9
        result["dynamo_remove_blocks_per_s"] = num / times["dynamo_remove"] * 1e9
        result.update(_latency_figures("dynamo_", latencies["dynamo"]))
        # Both ratios are kvgate / dynamo: above 1 is better for blocks/s, below 1 for latency.
        result["blocks_per_s_vs_dynamo"] = result["blocks_per_s"] / result["dynamo_blocks_per_s"]
        result["find_p50_64_vs_dynamo"] = result["find_p50_us_64"] / result["dynamo_find_p50_us_64"]
    return result


def _latency_figures(prefix: str, latencies: dict[str, list[float]]) -> dict[str, float]:
    figures = {}
    for size in (CHAIN_BLOCKS, DOC_BLOCKS):
        mixed = [t for kind in ("hit", "partial", "miss") for t in latencies[f"{size}_{kind}"]]
        figures[f"{prefix}find_p50_us_{size}"] = percentile(mixed, 0.5)
        figures[f"{prefix}find_p99_us_{size}"] = percentile(mixed, 0.99)
        for kind in ("hit", "partial", "miss"):
            figures[f"{prefix}find_p50_us_{size}_{kind}"] = percentile(latencies[f"{size}_{kind}"], 0.5)
    return figures


def targets(result: dict) -> dict[str, dict]:
    checks = {}
    for key, limit in TARGETS.items():
        value = result[key]
        passed = value >= limit if key == "blocks_per_s" else value <= limit
        checks[key] = {"value": round(value, 2), "limit": limit, "pass": passed}
    return checks


def print_table(result: dict, workload: Workload, dynamo_note: str) -> None:
    def fmt(value: float | None) -> str:
        if value is None:
            return "-"
        return f"{value:,.0f}" if value >= 1000 else f"{value:.2f}"

    names = {
        "blocks_per_s": "apply blocks/s (msgpack decode included)",
        "blocks_per_s_nodecode": "apply blocks/s (pre-decoded)",
        "decode_ns_per_block": "decode only, ns/block",
        "remove_blocks_per_s": "remove blocks/s (decode included)",
    }
    for size in (CHAIN_BLOCKS, DOC_BLOCKS):
        names |= {f"find_p50_us_{size}_{kind}": f"find {size} blocks p50 us, {kind}" for kind in ("hit", "partial", "miss")}
        names |= {f"find_{q}_us_{size}": f"find {size} blocks {q} us, all" for q in ("p50", "p99")}
    names |= {
        "bytes_per_block": "bytes per (block, worker), tracemalloc",
        "bytes_per_block_estimate": "bytes per (block, worker), stats estimate",
        "bytes_after_remove_all": "bytes left after removing every block",
    }
    names |= {k: f"hash_prompt 128k tokens ms, {k[13:].replace('_', ' ')}" for k in result if k.startswith("hash_128k_ms_")}
    names["cpu_probe_ms"] = "machine speed: sum(range(1e6)) ms"
    rows = [(name, result[key], result.get(f"dynamo_{key}")) for key, name in names.items()]
    print(f"kvgate prefix index: {workload.num_blocks:,} (block, worker) entries, "
          f"{result['num_distinct_blocks']:,} distinct blocks, {NUM_WORKERS} workers, block_size {BLOCK_SIZE}")
    print(f"{'metric':<48}{'kvgate':>14}{'dynamo':>14}")
    for name, ours, theirs in rows:
        print(f"{name:<48}{fmt(ours):>14}{fmt(theirs):>14}")
    print(f"dynamo: {dynamo_note}")
    for key, check in result["targets"].items():
        verdict = "PASS" if check["pass"] else "FAIL"
        print(f"target {key}: {check['value']} (limit {check['limit']}) {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and queries; well under a minute")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    repeats, num_each, passes = (3, 100, 2) if args.quick else (9, 300, 5)
    workload = build_workload(args.seed)
    queries = build_queries(workload, args.seed, num_each)
    radix_tree, dynamo_error = load_dynamo()
    spin(1.0)
    ours, theirs, times, latencies = measure(workload, queries, repeats, passes, radix_tree)
    result = summarise(workload, times, latencies)
    bytes_per_block, residue, estimate = measure_memory(ours)
    result["bytes_per_block"] = bytes_per_block
    result["bytes_per_block_estimate"] = estimate / workload.num_blocks
    result["bytes_after_remove_all"] = residue
    result.update(bench_hashing(repeats))
    result["cpu_probe_ms"] = cpu_probe_ms(repeats)
    result["hash_128k_ms"] = result["hash_128k_ms_list_bs16"]
    stats = ours.index.stats()
    result["num_entries"] = stats.num_entries
    result["num_distinct_blocks"] = stats.num_blocks
    result["dynamo_error"] = dynamo_error
    result["dynamo_disagreements"] = None
    if theirs is not None:
        result["dynamo_disagreements"] = count_disagreements(ours, theirs, queries)
        note = (f"dynamo._core.RadixTree, JSON events with precomputed hashes; "
                f"{result['dynamo_disagreements']} of {sum(map(len, queries.values()))} queries disagree")
    else:
        note = f"not run ({dynamo_error}); install ai-dynamo-runtime to compare"
    result["targets"] = targets(result)
    print_table(result, workload, note)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
