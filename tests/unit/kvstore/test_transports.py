"""The transport factory (`kvstore.transports`): names, `auto`, and NIXL missing."""

from __future__ import annotations

import sys

import pytest
import torch

from kvstore import nixl_transfer
from kvstore.kv_layout import KVLayout
from kvstore.tcp_transfer import TcpReceiver, TcpSender
from kvstore.transfer import KVCaches, ReceiverEndpoint
from kvstore.transports import (
    NixlUnavailableError, UnknownTransportError, available_transports, open_receiver, open_sender,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=2, dtype="float32", num_blocks=3).validate()


def caches(fill: bool = False) -> KVCaches:
    numel = LAYOUT.num_blocks * LAYOUT.block_size * LAYOUT.num_kv_heads * LAYOUT.head_dim
    tensors = [(torch.arange(numel, dtype=torch.float32) + 100 * i if fill else torch.zeros(numel)).view(LAYOUT.block_shape())
               for i in range(4)]
    return KVCaches(LAYOUT, tensors[:2], tensors[2:])


@pytest.fixture
def without_nixl(monkeypatch):
    """NIXL made unimportable, with the per-process probes forgotten before and after."""
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        monkeypatch.setitem(sys.modules, name, None)
    nixl_transfer.load_nixl.cache_clear()
    nixl_transfer.can_use_nixl.cache_clear()
    yield
    nixl_transfer.load_nixl.cache_clear()
    nixl_transfer.can_use_nixl.cache_clear()


def test_tcp_is_always_available_and_first() -> None:
    kinds = available_transports()
    assert kinds[0] == "tcp"
    assert kinds == (["tcp", "nixl"] if nixl_transfer.can_use_nixl() else ["tcp"])


def test_tcp_receiver_and_sender_from_its_endpoint() -> None:
    with open_receiver("tcp", caches()) as receiver:
        assert isinstance(receiver, TcpReceiver)
        assert receiver.endpoint.transport == "tcp"
        assert receiver.endpoint.address.startswith("127.0.0.1:")
        src = caches(fill=True)
        with open_sender(receiver.endpoint, src) as sender:
            assert isinstance(sender, TcpSender)
            assert sender.send([receiver.endpoint], "r1", [0, 2], [1, 0], timeout=5.0) == 1
        receiver.wait("r1", timeout=5.0)
        assert torch.equal(receiver.caches.values[1][[1, 0]], src.values[1][[0, 2]])
        assert receiver.caches.keys[0][2].abs().sum().item() == 0.0
    with open_sender("tcp", caches()) as sender:
        assert isinstance(sender, TcpSender)


def test_unknown_names_are_rejected() -> None:
    with pytest.raises(UnknownTransportError, match="unknown KV transport 'rdma'; expected one of tcp, nixl, auto"):
        open_receiver("rdma", caches())
    with pytest.raises(UnknownTransportError, match="unknown KV transport 'rdma'"):
        open_sender("rdma", caches())
    endpoint = ReceiverEndpoint(transport="rdma", address="127.0.0.1:1", layout=LAYOUT)
    with pytest.raises(UnknownTransportError, match="receiver endpoint names unknown KV transport 'rdma'"):
        open_sender(endpoint, caches())
    with pytest.raises(UnknownTransportError):
        open_sender(ReceiverEndpoint(transport="auto", address="127.0.0.1:1", layout=LAYOUT), caches())


def test_without_nixl_auto_is_tcp_and_nixl_names_the_extra(without_nixl) -> None:
    assert available_transports() == ["tcp"]
    with open_receiver("auto", caches()) as receiver:
        assert isinstance(receiver, TcpReceiver)
    with open_sender("auto", caches()) as sender:
        assert isinstance(sender, TcpSender)
    with pytest.raises(NixlUnavailableError, match=r"install the `transfer` extra \(pip install 'kvgate\[transfer\]'"):
        open_receiver("nixl", caches())
    endpoint = ReceiverEndpoint(transport="nixl", address="127.0.0.1:1", layout=LAYOUT)
    with pytest.raises(NixlUnavailableError, match="NIXL is not installed"):
        open_sender(endpoint, caches())


def test_auto_prefers_nixl_when_it_works() -> None:
    if not nixl_transfer.can_use_nixl():
        pytest.skip("NIXL (the optional `transfer` extra) is not installed here")
    with open_receiver("auto", caches()) as receiver:
        assert type(receiver).__name__ == "NixlReceiver"
        assert receiver.endpoint.transport == "nixl"
        src = caches(fill=True)
        with open_sender(receiver.endpoint, src) as sender:
            assert type(sender).__name__ == "NixlSender"
            assert sender.send([receiver.endpoint], "r1", [2], [0], timeout=5.0) == 1
        receiver.wait("r1", timeout=5.0)
        assert torch.equal(receiver.caches.keys[1][0], src.keys[1][2])
        assert receiver.caches.keys[1][1:].abs().sum().item() == 0.0
