"""Real KV block transfers over NIXL (UCX, CPU memory) between processes (`kvstore.nixl_transfer`).

Same shape as `test_kv_transfer.py`, whose cache helpers it shares: decode ranks are
`NixlReceiver`s opened through `kvstore.transports` in one receiver-host subprocess,
prefill ranks are `NixlSender`s in the test process, and the decode caches are checked
byte for byte. Skipped only when the optional `transfer` extra (nixl) is not installed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("nixl_cu12", reason="NIXL is the optional `transfer` extra (pip install 'kvgate[transfer]')")

import torch  # noqa: E402

from kvstore.kv_layout import expected_senders  # noqa: E402
from kvstore.nixl_transfer import NixlSender  # noqa: E402
from kvstore.transfer import (  # noqa: E402
    PeerUnreachableError, ReceiverEndpoint, TransferRejectedError, TransferTimeoutError,
)
from tests.integration.test_kv_transfer import (  # noqa: E402
    HOST_SCRIPT, NUM_DST_BLOCKS, NUM_SRC_BLOCKS, ROOT, ReceiverHost, assert_bytes_equal, expected_decode, layout,
    prefill_caches,
)

# The TCP host script, with its receivers opened through the factory over NIXL.
NIXL_HOST_SCRIPT = HOST_SCRIPT.replace(
    "from kvstore.tcp_transfer import TcpReceiver", "from kvstore.transports import open_receiver",
).replace("TcpReceiver(caches)", 'open_receiver("nixl", caches)')
assert NIXL_HOST_SCRIPT.count("open_receiver") == 2


class NixlReceiverHost(ReceiverHost):
    """`ReceiverHost` running `NIXL_HOST_SCRIPT`."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", NIXL_HOST_SCRIPT], cwd=ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        self.num_open = 0

    def close(self) -> None:
        self.proc.stdin.close()
        # NOTE: tearing down a NIXL agent (UCX context, progress thread) takes ~0.1-0.5 s
        # and this host holds one per receiver opened by the module.
        assert self.proc.wait(timeout=90) == 0
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def host():
    host = NixlReceiverHost()
    yield host
    host.close()


@pytest.mark.parametrize(
    ("p_tp", "p_pp", "d_tp", "d_pp", "dtype"),
    [(1, 1, 1, 1, "float32"), (1, 1, 2, 1, "bfloat16"), (2, 1, 1, 1, "float32"),
     (2, 1, 4, 1, "float16"), (1, 2, 1, 1, "float32"), (1, 1, 1, 2, "bfloat16"), (2, 2, 4, 1, "float32")],
    ids=["tp1-tp1", "tp1-tp2", "tp2-tp1", "tp2-tp4", "pp2-pp1", "pp1-pp2", "tp2pp2-tp4"],
)
def test_kv_reaches_decode_ranks_byte_exact(host, tmp_path, p_tp, p_pp, d_tp, d_pp, dtype) -> None:
    src_ids, dst_ids = [4, 0, 3], [7, 2, 5]  # remapped, out of order
    decode = [layout(dtype, NUM_DST_BLOCKS, r, d_tp, s, d_pp) for s in range(d_pp) for r in range(d_tp)]
    opened = [host.open(lay) for lay in decode]
    peers = [endpoint for _, endpoint in opened]
    assert {peer.transport for peer in peers} == {"nixl"}
    senders = [NixlSender(prefill_caches(layout(dtype, NUM_SRC_BLOCKS, r, p_tp, s, p_pp)))
               for s in range(p_pp) for r in range(p_tp)]
    request_id = f"req-{p_tp}{p_pp}{d_tp}{d_pp}"
    with ThreadPoolExecutor(len(senders)) as pool:
        written = list(pool.map(lambda s: s.send(peers, request_id, src_ids, dst_ids, timeout=10.0), senders))
    for sender in senders:
        sender.close()
    assert sum(written) == sum(len(expected_senders(lay, p_tp, p_pp)) for lay in decode)
    for (index, _), lay in zip(opened, decode, strict=True):
        path = tmp_path / f"rank{index}.pt"
        assert host.wait(index, request_id, path) == {"ok": True}
        got, want = torch.load(path), expected_decode(lay, src_ids, dst_ids)
        assert_bytes_equal(got["keys"], want["keys"])
        assert_bytes_equal(got["values"], want["values"])


def test_request_completes_only_when_every_overlapping_sender_notified(host, tmp_path) -> None:
    index, peer = host.open(layout("float32", NUM_DST_BLOCKS))
    senders = [NixlSender(prefill_caches(layout("float32", NUM_SRC_BLOCKS, r, 2))) for r in range(2)]
    assert senders[0].send([peer], "half", [1], [1], timeout=10.0) == 1
    reply = host.wait(index, "half", tmp_path / "x.pt", timeout=0.2)
    assert reply == {"error": "TransferTimeoutError: request 'half': KV not complete after 0.2 s"}
    assert senders[1].send([peer], "half", [1], [1], timeout=10.0) == 1
    assert host.wait(index, "half", tmp_path / "y.pt") == {"ok": True}
    for sender in senders:
        sender.close()


def test_one_sender_sends_concurrently_to_one_receiver(host, tmp_path) -> None:
    index, peer = host.open(layout("float16", NUM_DST_BLOCKS))
    moves = [([0], [7]), ([1], [6]), ([2, 3], [1, 0]), ([5], [4])]
    with NixlSender(prefill_caches(layout("float16", NUM_SRC_BLOCKS))) as sender, ThreadPoolExecutor(4) as pool:
        written = list(pool.map(lambda i: sender.send([peer], f"c{i}", *moves[i], timeout=10.0), range(4)))
    assert written == [1, 1, 1, 1]
    for i in range(4):
        assert host.wait(index, f"c{i}", tmp_path / f"c{i}.pt") == {"ok": True}
    src_ids = [b for src, _ in moves for b in src]
    dst_ids = [b for _, dst in moves for b in dst]
    want = expected_decode(layout("float16", NUM_DST_BLOCKS), src_ids, dst_ids)
    got = torch.load(tmp_path / "c3.pt")
    assert_bytes_equal(got["keys"], want["keys"])
    assert_bytes_equal(got["values"], want["values"])


def test_bad_block_ids_are_rejected_and_not_notified(host, tmp_path) -> None:
    index, peer = host.open(layout("float32", NUM_DST_BLOCKS))
    with NixlSender(prefill_caches(layout("float32", NUM_SRC_BLOCKS))) as sender:
        with pytest.raises(TransferRejectedError, match=r"block ids out of range \[0, 8\): \[9\]"):
            sender.send([peer], "bad", [0, 1], [2, 9], timeout=10.0)
        with pytest.raises(TransferRejectedError, match="duplicate destination block ids"):
            sender.send([peer], "bad", [0, 1], [3, 3], timeout=10.0)
        with pytest.raises(TransferRejectedError, match="2 source blocks for 1 destination"):
            sender.send([peer], "bad", [0, 1], [3], timeout=10.0)
        tcp_peer = ReceiverEndpoint(transport="tcp", address=peer.address, layout=peer.layout)
        with pytest.raises(TransferRejectedError, match="endpoint transport 'tcp' is not 'nixl'"):
            sender.send([tcp_peer], "bad", [0], [3], timeout=10.0)
        assert sender.send([peer], "good", [0], [3], timeout=10.0) == 1
    assert host.wait(index, "bad", tmp_path / "bad.pt", timeout=0.1)["error"].startswith("TransferTimeoutError")
    assert host.wait(index, "good", tmp_path / "good.pt") == {"ok": True}
    assert torch.load(tmp_path / "good.pt")["keys"][0][2].abs().sum().item() == 0.0


def test_silent_side_channel_times_out_at_the_deadline() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        address = "127.0.0.1:%d" % silent.getsockname()[1]
        peer = ReceiverEndpoint(transport="nixl", address=address, layout=layout("float32", NUM_DST_BLOCKS))
        with NixlSender(prefill_caches(layout("float32", NUM_SRC_BLOCKS))) as sender:
            started = time.monotonic()
            with pytest.raises(TransferTimeoutError, match=f"fetching the NIXL agent info of {address} timed out"):
                sender.send([peer], "stalled", [0], [0], timeout=0.3)
            assert time.monotonic() - started < 1.0


def test_receiver_stopped_then_gone_gives_clear_errors_without_hanging(tmp_path) -> None:
    gone = NixlReceiverHost()
    index, peer = gone.open(layout("float32", NUM_DST_BLOCKS))
    sender = NixlSender(prefill_caches(layout("float32", NUM_SRC_BLOCKS)))
    try:
        assert sender.send([peer], "before", [0], [0], timeout=10.0) == 1
        gone.proc.send_signal(signal.SIGSTOP)  # alive but unresponsive: the deadline must hold
        started = time.monotonic()
        try:  # the write itself is one-sided; whether UCX's flush needs the peer varies
            stalled = sender.send([peer], "stalled", [0], [0], timeout=0.3) == 1
        except TransferTimeoutError as exc:
            assert str(exc) == f"transfer to {peer.address} timed out"
            stalled = False
        assert time.monotonic() - started < 1.0
        gone.proc.send_signal(signal.SIGCONT)
        reply = gone.wait(index, "stalled", tmp_path / "x.pt", timeout=0.5)
        assert reply == ({"ok": True} if stalled else
                         {"error": "TransferTimeoutError: request 'stalled': KV not complete after 0.5 s"})
        assert sender.send([peer], "resumed", [2], [6], timeout=10.0) == 1
        assert gone.wait(index, "resumed", tmp_path / "r.pt") == {"ok": True}
        want = expected_decode(layout("float32", NUM_DST_BLOCKS), [0, 2], [0, 6])
        assert_bytes_equal(torch.load(tmp_path / "r.pt")["keys"], want["keys"])
    finally:
        gone.proc.kill()
        gone.proc.wait(timeout=10)
        gone.proc.stdin.close()
        gone.proc.stdout.close()
    started = time.monotonic()
    with pytest.raises(PeerUnreachableError, match=f"NIXL transfer to {peer.address} failed"):
        sender.send([peer], "after", [0], [0], timeout=5.0)  # on the cached, now dead agent
    with pytest.raises(PeerUnreachableError, match=f"cannot connect to receiver {peer.address}"):
        sender.send([peer], "after", [0], [0], timeout=5.0)
    assert time.monotonic() - started < 1.0
    sender.close()
