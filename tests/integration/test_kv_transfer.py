"""Real KV block transfers between processes, over every transport kvgate has (`kvstore.transports`).

Decode ranks live in one receiver-host subprocess (one receiver per rank, opened with
`open_receiver(transport, ...)` on its own ephemeral 127.0.0.1 port, driven by JSON
lines on stdin); prefill ranks are `open_sender(transport, ...)` senders in the test
process. Every layer of the whole model's cache is a seeded tensor, so each side slices
its own part and the test checks the decode caches byte for byte (untouched blocks stay
zero). The shared tests run over TCP and over NIXL; NIXL's are skipped only where it is
not usable (the optional `transfer` extra). TCP's wire format and its stalled or dead
receiver are checked here; NIXL's in `test_nixl_transfer.py`, which imports these helpers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import torch

from kvstore.kv_layout import KVLayout, expected_senders
from kvstore.tcp_transfer import WriteMeta
from kvstore.transfer import (
    KVCaches, KVSender, PeerUnreachableError, ReceiverEndpoint, TransferRejectedError, TransferTimeoutError,
)
from kvstore.transports import available_transports, open_sender

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(num_layers=4, num_kv_heads=8, head_dim=4, block_size=2)
NUM_SRC_BLOCKS, NUM_DST_BLOCKS = 6, 8
TRANSPORTS = ("tcp", "nixl")
# NOTE: a NIXL agent (UCX context, progress thread) can take over 10 s to shut down on a
# loaded machine, and a host holds one per receiver it opened.
CLOSE_TIMEOUT_S = {"tcp": 10.0, "nixl": 90.0}
SEND_TIMEOUT_S = 10.0

HOST_SCRIPT = r"""
import json, sys, torch
from kvstore.kv_layout import KVLayout
from kvstore.transfer import KVCaches, KVTransferError
from kvstore.transports import open_receiver
transport = sys.argv[1]
receivers = []
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "open":
        layout = KVLayout(**cmd["layout"]).validate()
        dtype = getattr(torch, layout.dtype)
        n = len(layout.layers)
        caches = KVCaches(layout, [torch.zeros(layout.block_shape(), dtype=dtype) for _ in range(n)],
                          [torch.zeros(layout.block_shape(), dtype=dtype) for _ in range(n)])
        receivers.append(open_receiver(transport, caches))
        reply = {"endpoint": receivers[-1].endpoint.to_bytes().hex()}
    else:
        receiver = receivers[cmd["index"]]
        try:
            receiver.wait(cmd["request_id"], cmd["timeout"])
        except KVTransferError as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            torch.save({"keys": list(receiver.caches.keys), "values": list(receiver.caches.values)}, cmd["path"])
            reply = {"ok": True}
    print(json.dumps(reply), flush=True)
for receiver in receivers:
    receiver.close()
"""


def require_transport(transport: str) -> None:
    """Skips the calling test where `transport` does not work in this process."""
    if transport not in available_transports():
        pytest.skip(f"KV transport {transport!r} is not usable here: NIXL is the optional `transfer` extra "
                    "(pip install 'kvgate[transfer]') and needs a NIXL agent with UCX that starts")


class ReceiverHost:
    """The decode-side subprocess over `transport`; `open` returns the new receiver's index and endpoint."""

    def __init__(self, transport: str, close_timeout_s: float | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOST_SCRIPT, transport], cwd=ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        self.close_timeout_s = CLOSE_TIMEOUT_S[transport] if close_timeout_s is None else close_timeout_s
        self.num_open = 0

    def _call(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"receiver host exited with {self.proc.wait(5)}"
        return json.loads(line)

    def open(self, layout: KVLayout) -> tuple[int, ReceiverEndpoint]:
        reply = self._call({"op": "open", "layout": msgspec.to_builtins(layout)})
        self.num_open += 1
        return self.num_open - 1, ReceiverEndpoint.from_bytes(bytes.fromhex(reply["endpoint"]))

    def wait(self, index: int, request_id: str, path: Path, timeout: float = 5.0) -> dict:
        return self._call({"op": "wait", "index": index, "request_id": request_id, "timeout": timeout, "path": str(path)})

    def close(self) -> None:
        """Ends the host as a decode worker ends: every receiver closed, exit status 0."""
        self.proc.stdin.close()
        assert self.proc.wait(timeout=self.close_timeout_s) == 0
        self.proc.stdout.close()

    def kill(self) -> None:
        """Ends the host as a crash does: SIGKILL, receivers never closed."""
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request) -> str:
    require_transport(request.param)
    return request.param


@pytest.fixture(scope="module")
def host(transport):
    host = ReceiverHost(transport)
    yield host
    host.close()


def full_layer(layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole model's K and V for one layer (all heads), seeded by the layer index."""
    gen = torch.Generator().manual_seed(1000 + layer)
    shape = (2, NUM_SRC_BLOCKS, MODEL["block_size"], MODEL["num_kv_heads"], MODEL["head_dim"])
    both = torch.randn(shape, generator=gen).to(dtype)
    return both[0], both[1]


def layout(dtype: str, num_blocks: int, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1) -> KVLayout:
    return KVLayout(**MODEL, dtype=dtype, num_blocks=num_blocks, tp_rank=tp_rank, tp_size=tp_size,
                    pp_rank=pp_rank, pp_size=pp_size).validate()


def prefill_caches(lay: KVLayout) -> KVCaches:
    dtype = getattr(torch, lay.dtype)
    layers = [full_layer(layer, dtype) for layer in lay.layers]
    heads = slice(lay.heads.start, lay.heads.stop)
    return KVCaches(lay, [k[:, :, heads].contiguous() for k, _ in layers], [v[:, :, heads].contiguous() for _, v in layers])


def expected_decode(lay: KVLayout, src_ids: list[int], dst_ids: list[int]) -> dict[str, list[torch.Tensor]]:
    dtype = getattr(torch, lay.dtype)
    heads = slice(lay.heads.start, lay.heads.stop)
    out: dict[str, list[torch.Tensor]] = {"keys": [], "values": []}
    for layer in lay.layers:
        for name, full in zip(("keys", "values"), full_layer(layer, dtype), strict=True):
            cache = torch.zeros(lay.block_shape(), dtype=dtype)
            cache[dst_ids] = full[src_ids][:, :, heads]
            out[name].append(cache)
    return out


def assert_bytes_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert torch.equal(a.view(torch.uint8), e.view(torch.uint8))


def assert_killed_receiver_fails_fast(sender: KVSender, peer: ReceiverEndpoint, cached_error: str) -> None:
    """After `peer`'s host was killed: a send on the sender's cached link fails with
    `cached_error`, the next one cannot connect, and both fail within a second."""
    started = time.monotonic()
    with pytest.raises(PeerUnreachableError, match=cached_error):
        sender.send([peer], "after", [0], [0], timeout=5.0)
    with pytest.raises(PeerUnreachableError, match=f"cannot connect to receiver {peer.address}"):
        sender.send([peer], "after", [0], [0], timeout=5.0)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("p_tp", "p_pp", "d_tp", "d_pp", "dtype"),
    [(1, 1, 1, 1, "float32"), (1, 1, 2, 1, "bfloat16"), (2, 1, 1, 1, "float32"),
     (2, 1, 4, 1, "float16"), (1, 2, 1, 1, "float32"), (1, 1, 1, 2, "bfloat16"), (2, 2, 4, 1, "float32")],
    ids=["tp1-tp1", "tp1-tp2", "tp2-tp1", "tp2-tp4", "pp2-pp1", "pp1-pp2", "tp2pp2-tp4"],
)
def test_kv_reaches_decode_ranks_byte_exact(transport, host, tmp_path, p_tp, p_pp, d_tp, d_pp, dtype) -> None:
    src_ids, dst_ids = [4, 0, 3], [7, 2, 5]  # remapped, out of order
    decode = [layout(dtype, NUM_DST_BLOCKS, r, d_tp, s, d_pp) for s in range(d_pp) for r in range(d_tp)]
    opened = [host.open(lay) for lay in decode]
    peers = [endpoint for _, endpoint in opened]
    assert {peer.transport for peer in peers} == {transport}
    senders = [open_sender(transport, prefill_caches(layout(dtype, NUM_SRC_BLOCKS, r, p_tp, s, p_pp)))
               for s in range(p_pp) for r in range(p_tp)]
    request_id = f"req-{p_tp}{p_pp}{d_tp}{d_pp}"
    with ThreadPoolExecutor(len(senders)) as pool:
        written = list(pool.map(lambda s: s.send(peers, request_id, src_ids, dst_ids, timeout=SEND_TIMEOUT_S), senders))
    for sender in senders:
        sender.close()
    assert sum(written) == sum(len(expected_senders(lay, p_tp, p_pp)) for lay in decode)
    for (index, _), lay in zip(opened, decode, strict=True):
        path = tmp_path / f"rank{index}.pt"
        assert host.wait(index, request_id, path) == {"ok": True}
        got, want = torch.load(path), expected_decode(lay, src_ids, dst_ids)
        assert_bytes_equal(got["keys"], want["keys"])
        assert_bytes_equal(got["values"], want["values"])


def test_request_completes_only_when_every_overlapping_sender_notified(transport, host, tmp_path) -> None:
    index, peer = host.open(layout("float32", NUM_DST_BLOCKS))
    senders = [open_sender(transport, prefill_caches(layout("float32", NUM_SRC_BLOCKS, r, 2))) for r in range(2)]
    assert senders[0].send([peer], "half", [1], [1], timeout=SEND_TIMEOUT_S) == 1
    reply = host.wait(index, "half", tmp_path / "x.pt", timeout=0.2)
    assert reply == {"error": "TransferTimeoutError: request 'half': KV not complete after 0.2 s"}
    assert senders[1].send([peer], "half", [1], [1], timeout=SEND_TIMEOUT_S) == 1
    assert host.wait(index, "half", tmp_path / "y.pt") == {"ok": True}
    for sender in senders:
        sender.close()


def test_one_sender_sends_concurrently_to_one_receiver(transport, host, tmp_path) -> None:
    index, peer = host.open(layout("float16", NUM_DST_BLOCKS))
    moves = [([0], [7]), ([1], [6]), ([2, 3], [1, 0]), ([5], [4])]
    with open_sender(transport, prefill_caches(layout("float16", NUM_SRC_BLOCKS))) as sender, \
            ThreadPoolExecutor(4) as pool:
        written = list(pool.map(lambda i: sender.send([peer], f"c{i}", *moves[i], timeout=SEND_TIMEOUT_S), range(4)))
    assert written == [1, 1, 1, 1]
    for i in range(4):
        assert host.wait(index, f"c{i}", tmp_path / f"c{i}.pt") == {"ok": True}
    src_ids = [b for src, _ in moves for b in src]
    dst_ids = [b for _, dst in moves for b in dst]
    want = expected_decode(layout("float16", NUM_DST_BLOCKS), src_ids, dst_ids)
    got = torch.load(tmp_path / "c3.pt")
    assert_bytes_equal(got["keys"], want["keys"])
    assert_bytes_equal(got["values"], want["values"])


def test_bad_block_ids_are_rejected_and_not_notified(transport, host, tmp_path) -> None:
    index, peer = host.open(layout("float32", NUM_DST_BLOCKS))
    other = next(kind for kind in TRANSPORTS if kind != transport)
    with open_sender(transport, prefill_caches(layout("float32", NUM_SRC_BLOCKS))) as sender:
        with pytest.raises(TransferRejectedError, match=r"block ids out of range \[0, 8\): \[9\]"):
            sender.send([peer], "bad", [0, 1], [2, 9], timeout=SEND_TIMEOUT_S)
        with pytest.raises(TransferRejectedError, match="duplicate destination block ids"):
            sender.send([peer], "bad", [0, 1], [3, 3], timeout=SEND_TIMEOUT_S)
        with pytest.raises(TransferRejectedError, match="2 source blocks for 1 destination"):
            sender.send([peer], "bad", [0, 1], [3], timeout=SEND_TIMEOUT_S)
        other_peer = ReceiverEndpoint(transport=other, address=peer.address, layout=peer.layout)
        with pytest.raises(TransferRejectedError, match=f"endpoint transport '{other}' is not '{transport}'"):
            sender.send([other_peer], "bad", [0], [3], timeout=SEND_TIMEOUT_S)
        # the sender's link survives a rejected write; the request is still not complete
        assert sender.send([peer], "good", [0], [3], timeout=SEND_TIMEOUT_S) == 1
    assert host.wait(index, "bad", tmp_path / "bad.pt", timeout=0.1)["error"].startswith("TransferTimeoutError")
    assert host.wait(index, "good", tmp_path / "good.pt") == {"ok": True}
    assert torch.load(tmp_path / "good.pt")["keys"][0][2].abs().sum().item() == 0.0


@pytest.mark.parametrize("transport", ["tcp"], indirect=True)
def test_corrupt_tcp_payload_is_detected_by_checksum(host) -> None:
    _, peer = host.open(layout("float32", NUM_DST_BLOCKS))
    meta = msgspec.msgpack.encode(WriteMeta(0, 0, 8, [1]))
    payload = bytes(2 * MODEL["block_size"] * 8 * MODEL["head_dim"] * 4)
    header = struct.Struct("!4sBxxxIQQ")
    host_ip, _, port = peer.address.rpartition(":")
    with socket.create_connection((host_ip, int(port)), timeout=5.0) as sock:
        sock.sendall(header.pack(b"KVT1", 1, len(meta), len(payload), 12345) + meta + payload)
        sock.sendall(header.pack(b"KVT1", 2, 0, 0, 0))
        reply = sock.recv(4096)
    assert b"checksum mismatch on WRITE frame" in reply


def test_tcp_receiver_gone_gives_clear_error_without_hanging() -> None:
    gone = ReceiverHost("tcp")
    _, peer = gone.open(layout("float32", NUM_DST_BLOCKS))
    sender = open_sender("tcp", prefill_caches(layout("float32", NUM_SRC_BLOCKS)))
    assert sender.send([peer], "before", [0], [0], timeout=5.0) == 1
    gone.proc.send_signal(signal.SIGSTOP)  # alive but unresponsive: the deadline must hold
    started = time.monotonic()
    with pytest.raises(TransferTimeoutError, match=f"transfer to {peer.address} timed out"):
        sender.send([peer], "stalled", [0], [0], timeout=0.3)
    assert time.monotonic() - started < 1.0
    gone.proc.send_signal(signal.SIGCONT)
    assert sender.send([peer], "resumed", [1], [1], timeout=5.0) == 1
    gone.kill()
    assert_killed_receiver_fails_fast(sender, peer, f"receiver {peer.address}")
    sender.close()
