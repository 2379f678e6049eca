"""Benchmark of KV block transfer (`kvstore.tcp_transfer`) between two processes.

A receiver subprocess (this script with `--receive`) registers a float16 KV cache of
2 layers x 8 KV heads x head_dim 64 x block_size 16, i.e. 64 KiB per block (K + V,
all layers); the parent sends `n` blocks (64 KiB .. 256 MiB) with a `TcpSender` over
127.0.0.1 and times `send()` end to end: gather on the sender, checksums, the wire,
the scatter into the receiver's blocks, its ACK and the notification. The baseline is a
plain `torch` copy of the same number of bytes in the same process and run. Figures are
medians over repeats; the last printed line is one JSON object with `tcp_gbps`,
`memcpy_gbps` and `nixl_gbps` (per size, GB/s = 1e9 bytes/s); `nixl_gbps` is null
because kvstore has no NIXL transport yet (`nixl_installed` says whether the package is).

Run: `.venv/bin/python bench/transfer.py [--quick]`.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from kvstore.tcp_transfer import TcpReceiver, TcpSender  # noqa: E402
from kvstore.transfer import KVCaches, ReceiverEndpoint  # noqa: E402

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
    """Child: serve a cache until stdin closes."""
    with TcpReceiver(make_caches(num_blocks, fill=False)) as receiver:
        print(receiver.endpoint.to_bytes().hex(), flush=True)
        sys.stdin.read()


def time_tcp(sender: TcpSender, peer: ReceiverEndpoint, num_blocks: int, repeats: int) -> float:
    block_ids = list(range(num_blocks))
    samples = []
    for i in range(repeats + 1):  # the first send opens the connection: not timed
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
        peer = ReceiverEndpoint.from_bytes(bytes.fromhex(child.stdout.readline().strip()))
        results = {"tcp_gbps": {}, "memcpy_gbps": {}, "nixl_gbps": None}
        with TcpSender(make_caches(max_blocks, fill=True)) as sender:
            for size in sizes:
                repeats = 5 if size >= 64 * MIB else 20
                tcp_s = time_tcp(sender, peer, size // BLOCK_BYTES, repeats)
                memcpy_s = time_memcpy(size, repeats)
                label = f"{size // KIB}KiB"
                results["tcp_gbps"][label] = round(size / tcp_s / 1e9, 3)
                results["memcpy_gbps"][label] = round(size / memcpy_s / 1e9, 3)
                print(f"{label:>10}: tcp {size / tcp_s / 1e9:7.3f} GB/s  memcpy {size / memcpy_s / 1e9:7.3f} GB/s"
                      f"  ratio {memcpy_s / tcp_s:.3f}", flush=True)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()
    largest = f"{max(sizes) // KIB}KiB"
    results["tcp_over_memcpy_largest"] = round(results["tcp_gbps"][largest] / results["memcpy_gbps"][largest], 3)
    results["nixl_installed"] = importlib.util.find_spec("nixl") is not None
    print(json.dumps(results))


if __name__ == "__main__":
    main()
