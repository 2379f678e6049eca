"""Benchmark of KV block transfer between two processes: NIXL and TCP against memcpy.

A receiver subprocess (this script with `--receive`) holds a float16 KV cache of
2 layers x 8 KV heads x head_dim 64 x block_size 16, i.e. 64 KiB per block (K + V,
all layers), behind a `TcpReceiver` and, when NIXL works here, a `NixlReceiver` over
the same tensors. The parent sends `n` blocks (64 KiB .. 256 MiB, destination ids
reversed so nothing is contiguous on both sides) through `kvstore.transports` senders
over 127.0.0.1 and times `send()` end to end: for TCP the gather, checksums, wire,
scatter, ACK and notification; for NIXL the descriptor build, the one-sided WRITE up to
its flush and the notification. The baseline is a plain `torch` copy of the same number
of bytes in the same process and run. Figures are medians over repeats; the last
printed line is one JSON object with `nixl_gbps`, `tcp_gbps` and `memcpy_gbps` (per
size, GB/s = 1e9 bytes/s; `nixl_gbps` is null when NIXL, the `transfer` extra, is not
available) and the ratios to memcpy at the largest size.

Run: `.venv/bin/python bench/transfer.py [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.kv_layout import KVLayout  # noqa: E402
from kvstore.transfer import KVCaches, KVSender, ReceiverEndpoint  # noqa: E402
from kvstore.transports import available_transports, open_receiver, open_sender  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
BLOCK_BYTES = 64 * KIB
SIZES = [64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
QUICK_SIZES = [64 * KIB, 1 * MIB, 16 * MIB]


def make_layout(num_blocks: int) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=8, head_dim=64, block_size=16, dtype="float16",
                    num_blocks=num_blocks).validate()


def make_caches(num_blocks: int, fill: bool) -> KVCaches:
    layout = make_layout(num_blocks)
    make = torch.randn if fill else torch.zeros
    tensors = [make(layout.block_shape(), dtype=torch.float16) for _ in range(4)]
    return KVCaches(layout, tensors[:2], tensors[2:])


def receive(num_blocks: int) -> None:
    """Child: serve one cache over every available transport until stdin closes."""
    caches = make_caches(num_blocks, fill=False)
    receivers = [open_receiver(kind, caches) for kind in available_transports()]
    for receiver in receivers:
        print(receiver.endpoint.to_bytes().hex(), flush=True)
    print("", flush=True)
    sys.stdin.read()
    for receiver in receivers:
        receiver.close()


def time_send(sender: KVSender, peer: ReceiverEndpoint, num_blocks: int, repeats: int) -> float:
    block_ids = list(range(num_blocks))
    samples = []
    for i in range(repeats + 1):  # the first send connects: not timed
        started = time.perf_counter()
        sender.send([peer], f"bench-{num_blocks}-{i}", block_ids, block_ids[::-1], timeout=120.0)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples[1:])


def time_memcpy(num_bytes: int, repeats: int) -> float:
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 16 MiB only")
    parser.add_argument("--receive", type=int, metavar="NUM_BLOCKS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        receive(args.receive)
        return
    sizes = QUICK_SIZES if args.quick else SIZES
    max_blocks = max(sizes) // BLOCK_BYTES
    child = subprocess.Popen([sys.executable, __file__, "--receive", str(max_blocks)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        peers = {}
        while line := child.stdout.readline().strip():
            peer = ReceiverEndpoint.from_bytes(bytes.fromhex(line))
            peers[peer.transport] = peer
        results = measure(peers, sizes)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
        child.stdout.close()
    largest = f"{max(sizes) // KIB}KiB"
    for kind in ("tcp", "nixl"):
        if results[f"{kind}_gbps"] is not None:
            ratio = results[f"{kind}_gbps"][largest] / results["memcpy_gbps"][largest]
            results[f"{kind}_over_memcpy_largest"] = round(ratio, 3)
    print(json.dumps(results))


def measure(peers: dict[str, ReceiverEndpoint], sizes: list[int]) -> dict:
    """Per-size GB/s of every transport in `peers` and of memcpy, printed as it goes."""
    caches = make_caches(max(sizes) // BLOCK_BYTES, fill=True)
    senders = {kind: open_sender(peer, caches) for kind, peer in peers.items()}
    results: dict = {"nixl_gbps": None, "tcp_gbps": None, "memcpy_gbps": {}}
    try:
        for size in sizes:
            repeats = 5 if size >= 64 * MIB else 20
            label = f"{size // KIB}KiB"
            line = f"{label:>10}:"
            memcpy_s = time_memcpy(size, repeats)
            results["memcpy_gbps"][label] = round(size / memcpy_s / 1e9, 3)
            for kind, sender in senders.items():
                seconds = time_send(sender, peers[kind], size // BLOCK_BYTES, repeats)
                results[f"{kind}_gbps"] = (results[f"{kind}_gbps"] or {}) | {label: round(size / seconds / 1e9, 3)}
                line += f"  {kind} {size / seconds / 1e9:7.3f} GB/s ({memcpy_s / seconds:.3f} x memcpy)"
            print(f"{line}  memcpy {size / memcpy_s / 1e9:7.3f} GB/s", flush=True)
    finally:
        for sender in senders.values():
            sender.close()
    return results

if __name__ == "__main__":
    main()
