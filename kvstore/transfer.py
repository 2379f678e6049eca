"""The KV block transport interface: what a prefill rank uses to fill a decode rank's blocks.

Owns the contract every transport (TCP in `kvstore.tcp_transfer`; NIXL plugs in behind
the same two classes) follows, the typed errors, the cache container and the receiver
endpoint wire type:

- A receiver (decode rank) registers its cache as `KVCaches`: per layer it holds, two
  tensors K and V of shape `[num_blocks, block_size, num_local_kv_heads, head_dim]`
  (the reference worker's layout; `worker.model_runner`). It publishes a
  `ReceiverEndpoint` (transport, address, `KVLayout`) that travels in the prefill job.
- A sender (prefill rank) calls `send(peers, request_id, src_block_ids, dst_block_ids)`:
  for every decode rank it overlaps (`kv_layout.plan_slice`), it WRITEs its blocks
  `src_block_ids[i]` into the receiver's `dst_block_ids[i]` (its layer and head slice
  only), then notifies `request_id`.
- A request is complete on a receiver once every prefill rank that overlaps it has
  notified (`kv_layout.expected_senders`); `wait` and `take_finished` report it.

Transports implement `_write_blocks` and `_notify` (sender) and call
`_record_notification` (receiver); they are thread-based and blocking, with a deadline
on every call. Callers inside an event loop use `asyncio.to_thread`. torch is never
imported here: tensors are only inspected through their attributes.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvstore.kv_layout import KVLayout, LayoutError, SlicePlan, expected_senders, plan_slice

if TYPE_CHECKING:
    import torch

__all__ = [
    "IntegrityError", "KVCaches", "KVReceiver", "KVSender", "KVTransferError", "LayoutError",
    "PeerUnreachableError", "ReceiverEndpoint", "TransferRejectedError", "TransferTimeoutError",
]


class KVTransferError(Exception):
    """Base of every transfer failure a caller should handle (fall back to local prefill)."""


class PeerUnreachableError(KVTransferError):
    """The receiver cannot be connected to, or its connection broke mid-transfer."""


class TransferTimeoutError(KVTransferError):
    """The deadline passed before the transfer (or the awaited notification) completed."""


class IntegrityError(KVTransferError):
    """A frame's length or checksum did not match its header."""


class TransferRejectedError(KVTransferError):
    """The receiver refused the write: bad block ids, layout or shape."""


class ReceiverEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    """Where and what a receiver is. Wire type (msgpack), new fields only at the end."""

    transport: str
    address: str
    layout: KVLayout

    def to_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> ReceiverEndpoint:
        return msgspec.msgpack.decode(data, type=cls)


@dataclass(frozen=True, slots=True)
class KVCaches:
    """One rank's KV cache: `keys[i]` / `values[i]` belong to global layer `layout.layers[i]`."""

    layout: KVLayout
    keys: Sequence[torch.Tensor]
    values: Sequence[torch.Tensor]

    def __post_init__(self) -> None:
        self.layout.validate()
        num_layers = len(self.layout.layers)
        if len(self.keys) != num_layers or len(self.values) != num_layers:
            raise LayoutError(f"expected {num_layers} K and V tensors, got {len(self.keys)} and {len(self.values)}")
        shape = self.layout.block_shape()
        for tensor in (*self.keys, *self.values):
            if tuple(tensor.shape) != shape:
                raise LayoutError(f"cache tensor shape {tuple(tensor.shape)} != layout shape {shape}")
            if str(tensor.dtype).removeprefix("torch.") != self.layout.dtype:
                raise LayoutError(f"cache dtype {tensor.dtype} != layout dtype {self.layout.dtype}")
            if not tensor.is_contiguous():
                raise LayoutError("cache tensors must be contiguous")


def _check_block_ids(src_block_ids: Sequence[int], dst_block_ids: Sequence[int], src: KVLayout) -> None:
    if len(src_block_ids) != len(dst_block_ids):
        raise TransferRejectedError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destination blocks")
    bad = [b for b in src_block_ids if not 0 <= b < src.num_blocks]
    if bad:
        raise TransferRejectedError(f"source block ids out of range [0, {src.num_blocks}): {bad[:8]}")


class KVSender(abc.ABC):
    """Prefill side. One instance per rank; thread-safe for concurrent `send` calls."""

    def __init__(self, caches: KVCaches) -> None:
        self.caches = caches

    def send(
        self, peers: Sequence[ReceiverEndpoint], request_id: str,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int], timeout: float,
    ) -> int:
        """Write the blocks into every overlapping peer, then notify it. Returns peers written.

        Raises `LayoutError` before any I/O when a peer is another model, and a
        `KVTransferError` subclass on failure; nothing is notified for a failed peer.
        """
        _check_block_ids(src_block_ids, dst_block_ids, self.caches.layout)
        plans = [(peer, plan_slice(self.caches.layout, peer.layout)) for peer in peers]
        deadline = time.monotonic() + timeout
        num_written = 0
        for peer, plan in plans:
            if plan is None:
                continue
            self._write_blocks(peer, plan, src_block_ids, dst_block_ids, deadline)
            self._notify(peer, request_id, deadline)
            num_written += 1
        return num_written

    @abc.abstractmethod
    def _write_blocks(
        self, peer: ReceiverEndpoint, plan: SlicePlan,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int], deadline: float,
    ) -> None:
        """Write the planned slice; return only once the receiver holds it all."""

    @abc.abstractmethod
    def _notify(self, peer: ReceiverEndpoint, request_id: str, deadline: float) -> None:
        """Deliver `request_id` (with this rank's TP/PP coordinates) after the writes."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVReceiver(abc.ABC):
    """Decode side. Owns the bookkeeping of which sender ranks have notified which request.

    A completed request id stays known (so late duplicate notifications are ignored)
    until the owner calls `forget`, once it has consumed the KV or given up on it.
    """

    def __init__(self, caches: KVCaches) -> None:
        self.caches = caches
        self._cond = threading.Condition()
        self._pending: dict[str, set[tuple[int, int]]] = {}
        self._finished: list[str] = []
        self._done: set[str] = set()
        # Called (on the transport's thread, outside any lock) once a request completes.
        self.on_finished: Callable[[str], None] | None = None

    @property
    @abc.abstractmethod
    def endpoint(self) -> ReceiverEndpoint: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def _record_notification(self, request_id: str, src: KVLayout) -> None:
        """Called by the transport once `src`'s writes for `request_id` are all applied."""
        expected = expected_senders(self.caches.layout, src.tp_size, src.pp_size)
        with self._cond:
            if request_id in self._done:
                return
            missing = self._pending.setdefault(request_id, set(expected))
            missing.discard((src.pp_rank, src.tp_rank))
            if missing:
                return
            del self._pending[request_id]
            self._done.add(request_id)
            self._finished.append(request_id)
            self._cond.notify_all()
        if self.on_finished is not None:
            self.on_finished(request_id)

    def take_finished(self) -> list[str]:
        """Request ids completed since the last call (the engine polls this each step)."""
        with self._cond:
            finished, self._finished = self._finished, []
            return finished

    def wait(self, request_id: str, timeout: float) -> None:
        """Block until `request_id` is complete; `TransferTimeoutError` after `timeout` s."""
        with self._cond:
            if not self._cond.wait_for(lambda: request_id in self._done, timeout):
                raise TransferTimeoutError(f"request {request_id!r}: KV not complete after {timeout:g} s")

    def forget(self, request_id: str) -> None:
        """Drop what is known of `request_id` (after it was consumed or abandoned)."""
        with self._cond:
            self._done.discard(request_id)
            self._pending.pop(request_id, None)

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
