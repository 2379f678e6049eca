"""Choosing a KV transport: which ones work here, and opening a receiver or a sender.

Owns the transport names (`"tcp"`, `"nixl"`, and `"auto"` for opening a receiver) and
the factory over `kvstore.tcp_transfer` and `kvstore.nixl_transfer`:

- `available_transports()`: `"tcp"` always; `"nixl"` when the `transfer` extra is
  installed and a NIXL agent with UCX starts (probed once per process).
- `open_receiver(kind, caches, host, port)`: a decode rank's receiver; `"auto"` picks
  NIXL when available, else TCP. Its endpoint names the transport it speaks.
- `open_sender(kind_or_endpoint, caches)`: a prefill rank's sender, for a transport
  name or for the transport a receiver's endpoint names, so the prefill side always
  speaks what the decode side chose.

Invariants: an unknown name is a `UnknownTransportError` (a `ValueError`, config
errors); asking for NIXL where it is not installed is a `NixlUnavailableError` (a
`KVTransferError`, so a prefill worker falls back to local prefill). The transport
modules are imported only when chosen, so TCP users never load NIXL. Called by the
worker's prefill and decode roles and by `bench/transfer.py`.
"""

from __future__ import annotations

from kvstore.nixl_transfer import NixlUnavailableError, can_use_nixl
from kvstore.transfer import KVCaches, KVReceiver, KVSender, ReceiverEndpoint

__all__ = [
    "KINDS", "NixlUnavailableError", "UnknownTransportError", "available_transports", "open_receiver",
    "open_sender",
]

TRANSPORTS = ("tcp", "nixl")
KINDS = (*TRANSPORTS, "auto")


class UnknownTransportError(ValueError):
    """A transport name that kvgate does not know."""


def available_transports() -> list[str]:
    """The transports that work in this process, preferred last: `["tcp"]` or `["tcp", "nixl"]`."""
    return ["tcp", "nixl"] if can_use_nixl() else ["tcp"]


def _resolve(kind: str) -> str:
    if kind not in KINDS:
        raise UnknownTransportError(f"unknown KV transport {kind!r}; expected one of {', '.join(KINDS)}")
    if kind == "auto":
        return "nixl" if can_use_nixl() else "tcp"
    return kind


def open_receiver(kind: str, caches: KVCaches, host: str = "127.0.0.1", port: int = 0) -> KVReceiver:
    """A receiver for `caches` listening on `host:port` (0: ephemeral), over `kind`."""
    if _resolve(kind) == "nixl":
        from kvstore.nixl_transfer import NixlReceiver

        return NixlReceiver(caches, host, port)
    from kvstore.tcp_transfer import TcpReceiver

    return TcpReceiver(caches, host, port)


def open_sender(kind_or_endpoint: str | ReceiverEndpoint, caches: KVCaches) -> KVSender:
    """A sender for `caches` speaking `kind`, or the transport the given endpoint names."""
    if isinstance(kind_or_endpoint, ReceiverEndpoint):
        kind = kind_or_endpoint.transport
        if kind not in TRANSPORTS:
            raise UnknownTransportError(f"receiver endpoint names unknown KV transport {kind!r}")
    else:
        kind = _resolve(kind_or_endpoint)
    if kind == "nixl":
        from kvstore.nixl_transfer import NixlSender

        return NixlSender(caches)
    from kvstore.tcp_transfer import TcpSender

    return TcpSender(caches)
