"""`kvgate events`: follow workers' KV event streams into a prefix index and show it.

An operator's view of exactly what the router's index sees: one subscriber per
workers' events endpoint (with gap replay and resync), the index they feed, and a
periodic table of blocks, batches, gaps, replays, resyncs and malformed messages per
worker. With `--prompt`, it also shows how many leading blocks of that prompt each
worker holds. `--json` prints one JSON object per interval instead of tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from typing import Any

import uvloop
import zmq.asyncio

from indexer.hashing import hash_prompt
from indexer.index import PrefixIndex
from indexer.subscriber import EventSubscriber
from indexer.tokenizer import TokenizerError, load_tokenizer, prompt_ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--events", action="append", default=[], metavar="URL",
        help="a worker's KV events endpoint (tcp://host:port or ipc://path); repeat per worker",
    )
    parser.add_argument(
        "--replay", action="append", default=[], metavar="URL",
        help="the replay endpoint of the worker named by the --events at the same position",
    )
    parser.add_argument(
        "--worker-id", action="append", default=[], metavar="ID",
        help="names for the workers, by position (default: w0, w1, ...)",
    )
    parser.add_argument("--topic", default="", help="ZMQ topic prefix to subscribe to (default: all)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (must match the engines)")
    parser.add_argument("--model", default="", help="model name the workers serve (the hash namespace)")
    parser.add_argument("--prompt", help="also show each worker's matched blocks for this completions prompt")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path, as the router uses")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between reports")
    parser.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: run until Ctrl-C)")
    parser.add_argument("--replay-timeout", type=float, default=1.0, help="seconds to wait for a replay answer")
    parser.add_argument("--json", action="store_true", help="print one JSON object per report")


def _subscribers(args: argparse.Namespace, index: PrefixIndex, context: zmq.asyncio.Context) -> list[EventSubscriber]:
    if len(args.replay) > len(args.events) or len(args.worker_id) > len(args.events):
        raise SystemExit("kvgate events: more --replay or --worker-id values than --events")
    subscribers = []
    for position, endpoint in enumerate(args.events):
        worker_id = args.worker_id[position] if position < len(args.worker_id) else f"w{position}"
        replay = args.replay[position] if position < len(args.replay) else None
        index.set_model(worker_id, args.model)
        subscribers.append(
            EventSubscriber(
                index, worker_id, endpoint, replay,
                topic=args.topic, replay_timeout_s=args.replay_timeout, context=context,
            )
        )
    return subscribers


def snapshot(index: PrefixIndex, subscribers: list[EventSubscriber], prompt_hashes: list[int] | None) -> dict[str, Any]:
    """Index totals, per-subscriber counters and per-worker blocks (and prompt matches)."""
    stats = index.stats()
    matches = index.find_matches(prompt_hashes) if prompt_hashes else {}
    workers = {}
    for key in sorted(index.workers()):
        entry: dict[str, Any] = {"worker_id": key[0], "dp_rank": key[1], "num_blocks": index.num_blocks(key)}
        if prompt_hashes is not None:
            entry["matched_blocks"] = matches.get(key, 0)
        workers[f"{key[0]}/{key[1]}"] = entry
    return {
        "ts": time.time(),
        "index": {
            "num_blocks": stats.num_blocks, "num_entries": stats.num_entries, "num_bytes": stats.num_bytes,
            "num_unknown_parent": stats.num_unknown_parent, "num_malformed": stats.num_malformed,
        },
        "subscribers": {
            sub.worker_id: {
                "endpoint": sub.endpoint, "num_batches": sub.stats.num_batches, "num_events": sub.stats.num_events,
                "num_gaps": sub.stats.num_gaps, "num_replays": sub.stats.num_replays,
                "num_resyncs": sub.stats.num_resyncs, "num_restarts": sub.stats.num_restarts,
                "num_malformed": sub.stats.num_malformed, "last_seq": sub.stats.last_seq,
            }
            for sub in subscribers
        },
        "workers": workers,
    }


def format_table(snap: dict[str, Any]) -> str:
    columns = ("num_batches", "num_events", "num_gaps", "num_replays", "num_resyncs", "num_malformed", "last_seq")
    lines = [f"{'subscriber':<14}" + "".join(f"{c.removeprefix('num_'):>10}" for c in columns)]
    for name, sub in snap["subscribers"].items():
        lines.append(f"{name:<14}" + "".join(f"{'-' if sub[c] is None else sub[c]:>10}" for c in columns))
    lines.append(f"{'worker/dp':<14}{'blocks':>10}" + (f"{'matched':>10}" if any(
        "matched_blocks" in w for w in snap["workers"].values()) else ""))
    for name, worker in snap["workers"].items():
        matched = f"{worker['matched_blocks']:>10}" if "matched_blocks" in worker else ""
        lines.append(f"{name:<14}{worker['num_blocks']:>10}{matched}")
    idx = snap["index"]
    lines.append(
        f"index: {idx['num_blocks']} blocks, {idx['num_entries']} entries, ~{idx['num_bytes'] / 1e6:.1f} MB, "
        f"{idx['num_unknown_parent']} unknown parents, {idx['num_malformed']} malformed"
    )
    return "\n".join(lines)


async def _watch(args: argparse.Namespace) -> None:
    index = PrefixIndex(args.block_size, default_model=args.model)
    prompt_hashes = None
    if args.prompt is not None:
        try:
            tokens = prompt_ids(load_tokenizer(args.tokenizer), args.prompt)
        except TokenizerError as exc:
            raise SystemExit(f"kvgate events: {exc}") from None
        prompt_hashes = hash_prompt(tokens, args.block_size, args.model)
    context = zmq.asyncio.Context()
    subscribers = _subscribers(args, index, context)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    for sub in subscribers:
        sub.start()
    deadline = loop.time() + args.duration if args.duration > 0 else None
    try:
        while not stop.is_set():
            timeout = args.interval if deadline is None else min(args.interval, max(0.0, deadline - loop.time()))
            try:
                await asyncio.wait_for(stop.wait(), timeout)
            except TimeoutError:
                pass
            snap = snapshot(index, subscribers, prompt_hashes)
            print(json.dumps(snap) if args.json else format_table(snap) + "\n", flush=True)
            if deadline is not None and loop.time() >= deadline:
                break
    finally:
        for sub in subscribers:
            await sub.stop()
        context.term()


def run(args: argparse.Namespace) -> int:
    if not args.events:
        raise SystemExit("kvgate events: give at least one --events URL (or KVGATE_EVENTS)")
    if args.block_size <= 0 or args.interval <= 0:
        raise SystemExit("kvgate events: --block-size and --interval must be positive")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    uvloop.run(_watch(args))
    return 0
