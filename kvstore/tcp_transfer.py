"""KV block transfer over plain TCP: the transport used when NIXL is not installed.

Owns the frame format and the TCP sender/receiver. Every frame is a fixed header
`magic "KVT1", kind u8, meta length u32, payload length u64, xxh3-64 of meta + payload`,
then the msgpack meta, then the raw payload. Kinds:

- WRITE: meta `WriteMeta` (receiver-local layer, head range, block ids); payload the K
  then V slice `[num_blocks, block_size, num_heads, head_dim]`, contiguous.
- FLUSH: asks for an ACK covering every WRITE since the previous FLUSH.
- NOTIFY: meta `NotifyMeta` (request id and the sender's layout); answered by an ACK.
- ACK: meta `Ack` (ok, error text).

Invariants: a payload is copied into the cache only after its length and checksum
check out, so a corrupt frame never touches a block; a NOTIFY is recorded only if every
WRITE before it on that connection was applied. A frame whose sizes disagree with its
meta breaks framing, so the receiver answers with an error ACK and drops the connection.
The receiver runs an accept thread and one thread per connection; the sender keeps one
connection per receiver address. Called by the worker's prefill/decode roles through
the `kvstore.transfer` interface. torch is imported here (the `worker` extra).
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import torch
import xxhash

from kvstore.kv_layout import KVLayout, SlicePlan
from kvstore.transfer import (
    IntegrityError, KVCaches, KVReceiver, KVSender, PeerUnreachableError, ReceiverEndpoint,
    TransferRejectedError, TransferTimeoutError,
)

TRANSPORT = "tcp"
_HEADER = struct.Struct("!4sBxxxIQQ")
_MAGIC = b"KVT1"
_WRITE, _FLUSH, _NOTIFY, _ACK = 1, 2, 3, 4
_MAX_META = 1 << 24
_ACCEPT_POLL_S = 0.05


class WriteMeta(msgspec.Struct, array_like=True):
    layer: int
    head_start: int
    head_stop: int
    block_ids: list[int]


class NotifyMeta(msgspec.Struct, array_like=True):
    request_id: str
    layout: KVLayout


class Ack(msgspec.Struct, array_like=True):
    ok: bool
    error: str = ""


class _FramingError(Exception):
    """The stream cannot be parsed further (bad magic, sizes, or the peer closed)."""


def _checksum(meta: bytes, payload: memoryview | bytes) -> int:
    digest = xxhash.xxh3_64(meta)
    digest.update(payload)
    return digest.intdigest()


def _send_frame(sock: socket.socket, kind: int, meta: bytes, payloads: Sequence[memoryview] = ()) -> None:
    digest = xxhash.xxh3_64(meta)
    for part in payloads:
        digest.update(part)
    payload_len = sum(part.nbytes for part in payloads)
    sock.sendall(_HEADER.pack(_MAGIC, kind, len(meta), payload_len, digest.intdigest()) + meta)
    for part in payloads:
        sock.sendall(part)


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    while buf.nbytes:
        got = sock.recv_into(buf)
        if not got:
            raise _FramingError("connection closed mid-frame")
        buf = buf[got:]


def _recv_header(sock: socket.socket) -> tuple[int, bytes, int, int] | None:
    """(kind, meta, payload_len, checksum), or None on a clean close between frames."""
    header = bytearray(_HEADER.size)
    first = sock.recv_into(header)
    if not first:
        return None
    _recv_exact(sock, memoryview(header)[first:])
    magic, kind, meta_len, payload_len, checksum = _HEADER.unpack(header)
    if magic != _MAGIC or meta_len > _MAX_META:
        raise _FramingError(f"bad frame header (magic {magic!r}, meta {meta_len} bytes)")
    meta = bytearray(meta_len)
    _recv_exact(sock, memoryview(meta))
    return kind, bytes(meta), payload_len, checksum


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().cpu().view(torch.uint8).numpy()).cast("B")


class TcpReceiver(KVReceiver):
    """Listens on `host:port` (0: an ephemeral port) and writes incoming blocks into `caches`."""

    def __init__(self, caches: KVCaches, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(caches)
        self._listener = socket.create_server((host, port))
        self._listener.setblocking(False)
        address, bound_port = self._listener.getsockname()[:2]
        self._endpoint = ReceiverEndpoint(transport=TRANSPORT, address=f"{address}:{bound_port}", layout=caches.layout)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-recv-accept", daemon=True)
        self._accept_thread.start()

    @property
    def endpoint(self) -> ReceiverEndpoint:
        return self._endpoint

    def close(self) -> None:
        self._stop.set()
        self._accept_thread.join()
        self._listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already disconnected by the peer
        for _, thread in conns:
            thread.join()

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            while not self._stop.is_set():
                if not selector.select(_ACCEPT_POLL_S):
                    continue
                try:
                    conn, _ = self._listener.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(True)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                thread = threading.Thread(target=self._serve, args=(conn,), name="kv-recv-conn", daemon=True)
                with self._lock:
                    self._conns[conn] = thread
                thread.start()

    def _serve(self, conn: socket.socket) -> None:
        errors: list[str] = []
        try:
            while (frame := _recv_header(conn)) is not None:
                self._handle(conn, *frame, errors)
        except (_FramingError, msgspec.ValidationError, msgspec.DecodeError) as exc:
            _reply(conn, Ack(ok=False, error=f"protocol error: {exc}"))
        except OSError:
            pass  # the peer went away or close() shut the socket down
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _handle(
        self, conn: socket.socket, kind: int, meta: bytes, payload_len: int, checksum: int, errors: list[str],
    ) -> None:
        if kind == _WRITE:
            write = msgspec.msgpack.decode(meta, type=WriteMeta)
            self._receive_write(conn, write, meta, payload_len, checksum, errors)
        elif kind == _FLUSH:
            _reply(conn, Ack(ok=not errors, error="; ".join(errors)))
            errors.clear()
        elif kind == _NOTIFY:
            notify = msgspec.msgpack.decode(meta, type=NotifyMeta)
            if not errors:
                self._record_notification(notify.request_id, notify.layout)
            _reply(conn, Ack(ok=not errors, error="; ".join(errors)))
            errors.clear()
        else:
            raise _FramingError(f"unknown frame kind {kind}")

    def _receive_write(
        self, conn: socket.socket, write: WriteMeta, meta: bytes, payload_len: int, checksum: int, errors: list[str],
    ) -> None:
        layout = self.caches.layout
        num_heads = write.head_stop - write.head_start
        itemsize = self.caches.keys[0].element_size() if self.caches.keys else 0
        expected = 2 * len(write.block_ids) * layout.block_size * max(num_heads, 0) * layout.head_dim * itemsize
        if payload_len != expected:
            raise _FramingError(f"payload of {payload_len} bytes, meta implies {expected}")
        buf = bytearray(payload_len)
        _recv_exact(conn, memoryview(buf))
        problem = _check_write(write, layout)
        if problem is None and _checksum(meta, buf) != checksum:
            problem = "checksum mismatch on WRITE frame"
        if problem is not None:
            errors.append(problem)
            return
        shape = (2, len(write.block_ids), layout.block_size, num_heads, layout.head_dim)
        key_cache = self.caches.keys[write.layer]
        data = torch.frombuffer(buf, dtype=torch.uint8).view(key_cache.dtype).view(shape)
        block_ids = torch.tensor(write.block_ids, dtype=torch.long, device=key_cache.device)
        heads = slice(write.head_start, write.head_stop)
        # NOTE: an engine allocates its cache under inference mode; such tensors only
        # accept in-place writes inside it (and normal tensors accept them there too).
        with torch.inference_mode():
            key_cache[block_ids, :, heads] = data[0].to(key_cache.device)
            self.caches.values[write.layer][block_ids, :, heads] = data[1].to(key_cache.device)


def _check_write(write: WriteMeta, layout: KVLayout) -> str | None:
    if not write.block_ids:
        return "WRITE without block ids"
    if not 0 <= write.layer < len(layout.layers):
        return f"layer {write.layer} not held (receiver holds {len(layout.layers)})"
    if not 0 <= write.head_start < write.head_stop <= layout.num_local_heads:
        return f"head range [{write.head_start}, {write.head_stop}) outside [0, {layout.num_local_heads})"
    bad = [b for b in write.block_ids if not 0 <= b < layout.num_blocks]
    if bad:
        return f"block ids out of range [0, {layout.num_blocks}): {bad[:8]}"
    if len(set(write.block_ids)) != len(write.block_ids):
        return "duplicate destination block ids"
    return None


def _reply(conn: socket.socket, ack: Ack) -> None:
    try:
        _send_frame(conn, _ACK, msgspec.msgpack.encode(ack))
    except OSError:
        pass  # the sender is gone; it will see its own error


class TcpSender(KVSender):
    """Writes this rank's blocks to `TcpReceiver`s; one cached connection per address."""

    def __init__(self, caches: KVCaches) -> None:
        super().__init__(caches)
        self._lock = threading.Lock()
        self._conns: dict[str, tuple[socket.socket, threading.Lock]] = {}

    def close(self) -> None:
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for sock, _ in conns:
            sock.close()

    def _write_blocks(
        self, peer: ReceiverEndpoint, plan: SlicePlan,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int], deadline: float,
    ) -> None:
        if not src_block_ids:
            return
        src = torch.tensor(list(src_block_ids), dtype=torch.long, device=self.caches.keys[0].device)
        heads = slice(plan.src_heads.start, plan.src_heads.stop)

        def exchange(sock: socket.socket) -> Ack:
            for src_layer, dst_layer in zip(plan.src_layers, plan.dst_layers, strict=True):
                meta = WriteMeta(dst_layer, plan.dst_heads.start, plan.dst_heads.stop, list(dst_block_ids))
                keys = _tensor_bytes(self.caches.keys[src_layer][src, :, heads])
                values = _tensor_bytes(self.caches.values[src_layer][src, :, heads])
                _send_frame(sock, _WRITE, msgspec.msgpack.encode(meta), (keys, values))
            _send_frame(sock, _FLUSH, b"")
            return _recv_ack(sock)

        self._exchange(peer, deadline, exchange)

    def _notify(self, peer: ReceiverEndpoint, request_id: str, deadline: float) -> None:
        meta = msgspec.msgpack.encode(NotifyMeta(request_id, self.caches.layout))

        def exchange(sock: socket.socket) -> Ack:
            _send_frame(sock, _NOTIFY, meta)
            return _recv_ack(sock)

        self._exchange(peer, deadline, exchange)

    def _exchange(self, peer: ReceiverEndpoint, deadline: float, exchange: Callable[[socket.socket], Ack]) -> None:
        """Run `exchange` on the peer's connection under the deadline; map errors to ours."""
        sock, conn_lock = self._connection(peer, deadline)
        with conn_lock:
            try:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                ack = exchange(sock)
            except TimeoutError as exc:
                self._drop(peer.address)
                raise TransferTimeoutError(f"transfer to {peer.address} timed out") from exc
            except (OSError, _FramingError) as exc:
                self._drop(peer.address)
                raise PeerUnreachableError(f"receiver {peer.address} went away: {exc}") from exc
        if not ack.ok:
            if ack.error.startswith("protocol error"):
                self._drop(peer.address)
            error = IntegrityError if "checksum" in ack.error else TransferRejectedError
            raise error(f"receiver {peer.address} refused: {ack.error}")

    def _connection(self, peer: ReceiverEndpoint, deadline: float) -> tuple[socket.socket, threading.Lock]:
        if peer.transport != TRANSPORT:
            raise TransferRejectedError(f"endpoint transport {peer.transport!r} is not {TRANSPORT!r}")
        with self._lock:
            cached = self._conns.get(peer.address)
        if cached is not None:
            return cached
        host, _, port = peer.address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 1e-3))
        except TimeoutError as exc:
            raise TransferTimeoutError(f"connecting to {peer.address} timed out") from exc
        except OSError as exc:
            raise PeerUnreachableError(f"cannot connect to receiver {peer.address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if peer.address in self._conns:
                sock.close()  # another thread connected first
            else:
                self._conns[peer.address] = (sock, threading.Lock())
            return self._conns[peer.address]

    def _drop(self, address: str) -> None:
        with self._lock:
            cached = self._conns.pop(address, None)
        if cached is not None:
            cached[0].close()


def _recv_ack(sock: socket.socket) -> Ack:
    frame = _recv_header(sock)
    if frame is None:
        raise _FramingError("receiver closed the connection")
    kind, meta, payload_len, checksum = frame
    if kind != _ACK or payload_len or _checksum(meta, b"") != checksum:
        raise _FramingError(f"expected a valid ACK, got kind {kind}")
    return msgspec.msgpack.decode(meta, type=Ack)
