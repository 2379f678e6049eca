"""What only NIXL does with KV transfers between processes (`kvstore.nixl_transfer`).

The transport-generic tests (byte-exact TP/PP reshaping, completion after every
overlapping sender, concurrent sends, rejected block ids) run over NIXL too, in
`test_kv_transfer.py`, whose receiver host and cache helpers these tests share. Here:
a side channel that accepts and never answers, and a receiver stopped (SIGSTOP, where
NIXL's one-sided writes may still land) then killed. Skipped only where NIXL is not
usable (the optional `transfer` extra).
"""

from __future__ import annotations

import signal
import socket
import time

import pytest
import torch

from kvstore.transfer import ReceiverEndpoint, TransferTimeoutError
from kvstore.transports import open_sender
from tests.integration.test_kv_transfer import (
    NUM_DST_BLOCKS, NUM_SRC_BLOCKS, SEND_TIMEOUT_S, ReceiverHost, assert_bytes_equal, assert_killed_receiver_fails_fast,
    expected_decode, layout, prefill_caches, require_transport,
)


@pytest.fixture(autouse=True)
def _nixl_usable() -> None:
    require_transport("nixl")


def test_silent_side_channel_times_out_at_the_deadline() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        address = "127.0.0.1:%d" % silent.getsockname()[1]
        peer = ReceiverEndpoint(transport="nixl", address=address, layout=layout("float32", NUM_DST_BLOCKS))
        with open_sender("nixl", prefill_caches(layout("float32", NUM_SRC_BLOCKS))) as sender:
            started = time.monotonic()
            with pytest.raises(TransferTimeoutError, match=f"fetching the NIXL agent info of {address} timed out"):
                sender.send([peer], "stalled", [0], [0], timeout=0.3)
            assert time.monotonic() - started < 1.0


def test_receiver_stopped_then_gone_gives_clear_errors_without_hanging(tmp_path) -> None:
    gone = ReceiverHost("nixl")
    index, peer = gone.open(layout("float32", NUM_DST_BLOCKS))
    sender = open_sender("nixl", prefill_caches(layout("float32", NUM_SRC_BLOCKS)))
    try:
        assert sender.send([peer], "before", [0], [0], timeout=SEND_TIMEOUT_S) == 1
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
        assert sender.send([peer], "resumed", [2], [6], timeout=SEND_TIMEOUT_S) == 1
        assert gone.wait(index, "resumed", tmp_path / "r.pt") == {"ok": True}
        want = expected_decode(layout("float32", NUM_DST_BLOCKS), [0, 2], [0, 6])
        assert_bytes_equal(torch.load(tmp_path / "r.pt")["keys"], want["keys"])
    finally:
        gone.kill()
    assert_killed_receiver_fails_fast(sender, peer, f"NIXL transfer to {peer.address} failed")
    sender.close()
