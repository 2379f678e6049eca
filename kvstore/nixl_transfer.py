"""KV block transfer over NIXL (UCX): one-sided WRITEs straight into the decode rank's cache.

Owns `NixlReceiver` and `NixlSender` (the `kvstore.transfer` interface) and the small
side channel that lets a sender find a receiver's NIXL agent:

- The receiver creates a NIXL agent, registers every K and V tensor of its cache and
  serves one `AgentInfo` frame (u32 length, then msgpack: agent name, NIXL agent
  metadata, memory type, base address of every local layer's K and V tensor, layout)
  to whoever connects to its TCP side-channel address; that `host:port` is the
  endpoint's `address`. A sender fetches it once per address and loads the metadata
  with `add_remote_agent`; after that all traffic is UCX.
- A sender WRITEs its slice (`kv_layout.plan_slice`) with one descriptor per
  contiguous run and no staging copy. With equal TP sizes a block of one layer is one
  contiguous run on both sides; otherwise the head slice is contiguous only per token
  slot, so there is one descriptor per (layer, K/V, block, slot). Staging through a
  contiguous buffer would need a receiver-side scatter, i.e. a second copy and a
  receiver thread in the data path, which one-sided writes exist to avoid. NIXL merges
  adjacent descriptors itself.
- Once the transfer reports DONE (NIXL flushes the endpoint, so the data is in the
  receiver's memory) the sender sends a NIXL notification `Notice(request_id, its
  layout)`; the receiver's notification thread records it.

Invariants: a write never leaves the receiver's registered memory (destination block
ids and the layout are checked against what the receiver itself served, and NIXL checks
every remote descriptor against the registered regions); nothing is notified for a
failed or timed-out write. Completion is a UCX endpoint flush, which the receiver's
UCX progress thread answers, so a stalled receiver makes the sender time out at its
deadline. A sender drops its cached peer on any failure, so a receiver that comes back
(or restarts at the same address) is fetched anew.

nixl (the `transfer` extra) and numpy are imported lazily: this module imports without
them and constructing a receiver or sender raises `NixlUnavailableError`. torch is never
imported: tensors are only read through their attributes. Called through
`kvstore.transports` by the worker's prefill and decode roles.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvstore.kv_layout import KVLayout, LayoutError, SlicePlan, check_same_model
from kvstore.transfer import (
    KVCaches, KVReceiver, KVSender, KVTransferError, PeerUnreachableError, ReceiverEndpoint,
    TransferRejectedError, TransferTimeoutError,
)

TRANSPORT = "nixl"
_NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
_LENGTH = struct.Struct("!I")
_MAX_INFO = 1 << 24
_ACCEPT_POLL_S = 0.05
# NIXL has no blocking wait for notifications: poll, backing off while idle so that
# many receivers in one process cost little CPU, at most 5 ms of added latency.
_NOTIF_POLL_MIN_S, _NOTIF_POLL_MAX_S = 0.0005, 0.005
_XFER_POLL_S = 20e-6
# NIXL errors that mean "this request is wrong" rather than "the peer is in trouble".
_REJECTED_ERRORS = frozenset({"nixlInvalidParamError", "nixlMismatchError", "nixlNotFoundError", "nixlNotAllowedError"})

log = logging.getLogger(__name__)


class NixlUnavailableError(KVTransferError):
    """NIXL (the `transfer` extra) is not installed, or has no working UCX backend."""


class AgentInfo(msgspec.Struct, array_like=True):
    """What the side channel serves: enough for a sender to WRITE into this receiver."""

    agent_name: str
    agent_metadata: bytes
    mem_type: str
    device_id: int
    key_addrs: list[int]
    value_addrs: list[int]
    layout: KVLayout


class Notice(msgspec.Struct, array_like=True):
    """The NIXL notification a sender posts once its writes for `request_id` are done."""

    request_id: str
    layout: KVLayout


@functools.cache
def load_nixl() -> Any:
    """The NIXL Python module; `NixlUnavailableError` naming the extra when missing."""
    for name in _NIXL_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            if "NIXL_LOG_LEVEL" not in os.environ:
                # NOTE: NIXL logs INFO lines to stdout, which would corrupt the stdout
                # of processes that speak a protocol there (test hosts, bench children).
                logging.getLogger("nixl").setLevel(logging.WARNING)
            return module
    raise NixlUnavailableError(
        "NIXL is not installed: install the `transfer` extra (pip install 'kvgate[transfer]', "
        "after torch==2.13.0) or use the tcp transport"
    )


def _new_agent(role: str, thread_safe: bool) -> Any:
    nixl = load_nixl()
    sync = nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if thread_safe else None
    # NOTE: no progress thread: NIXL's busy-polls a core for as long as the agent lives,
    # idle or not. Progress is driven by the calls that wait: the sender's transfer-state
    # checks and the receiver's notification polling.
    config = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"], sync_mode=sync)
    agent = nixl.nixl_agent(f"kvgate-{role}-{uuid.uuid4().hex}", config)
    if "UCX" not in agent.backends:
        raise NixlUnavailableError("NIXL has no UCX backend plugin; reinstall the `transfer` extra")
    return agent


@functools.cache
def can_use_nixl() -> bool:
    """Whether NIXL imports and can start an agent with UCX here (probed once per process)."""
    try:
        _new_agent("probe", thread_safe=False)
    except Exception as exc:  # noqa: BLE001  a broken native install fails in many ways
        log.info("NIXL transport unavailable: %s", exc)
        return False
    return True


def _memory(caches: KVCaches) -> tuple[str, int]:
    """NIXL memory type and device id of the cache; all tensors must share one device."""
    devices = {str(t.device) for t in (*caches.keys, *caches.values)}
    if len(devices) != 1:
        raise LayoutError(f"cache tensors are on several devices: {sorted(devices)}")
    tensor = caches.keys[0]
    if tensor.device.type == "cpu":
        return "DRAM", 0
    return "VRAM", tensor.get_device()


def _register(agent: Any, caches: KVCaches) -> tuple[Any, str, int]:
    mem_type, device_id = _memory(caches)
    regions = [(t.data_ptr(), t.nbytes, device_id, "") for t in (*caches.keys, *caches.values)]
    try:
        return agent.register_memory(regions, mem_type), mem_type, device_id
    except Exception as exc:  # noqa: BLE001  the native layer raises its own types
        raise NixlUnavailableError(f"NIXL could not register the KV cache: {exc}") from exc


def _nixl_error(exc: Exception, address: str) -> KVTransferError:
    if type(exc).__name__ in _REJECTED_ERRORS:
        return TransferRejectedError(f"NIXL refused the transfer to {address}: {type(exc).__name__}: {exc}")
    return PeerUnreachableError(f"NIXL transfer to {address} failed: {type(exc).__name__}: {exc}")


class NixlReceiver(KVReceiver):
    """Registers `caches` with a NIXL agent and serves its `AgentInfo` on `host:port` (0: ephemeral)."""

    def __init__(self, caches: KVCaches, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(caches)
        self._agent = _new_agent("recv", thread_safe=False)
        self._reg, mem_type, device_id = _register(self._agent, caches)
        info = AgentInfo(
            agent_name=self._agent.name, agent_metadata=self._agent.get_agent_metadata(),
            mem_type=mem_type, device_id=device_id, key_addrs=[t.data_ptr() for t in caches.keys],
            value_addrs=[t.data_ptr() for t in caches.values], layout=caches.layout,
        )
        body = msgspec.msgpack.encode(info)
        self._info_frame = _LENGTH.pack(len(body)) + body
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(_ACCEPT_POLL_S)
        address, bound_port = self._listener.getsockname()[:2]
        self._endpoint = ReceiverEndpoint(transport=TRANSPORT, address=f"{address}:{bound_port}", layout=caches.layout)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._serve_info, name="kv-nixl-info", daemon=True),
            threading.Thread(target=self._poll_notifications, name="kv-nixl-notif", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def endpoint(self) -> ReceiverEndpoint:
        return self._endpoint

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self._listener.close()
        self._agent.deregister_memory(self._reg)

    def _serve_info(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed
            with conn:
                try:
                    conn.settimeout(1.0)
                    conn.sendall(self._info_frame)
                except OSError:
                    pass  # the sender gave up; it reports its own error

    def _poll_notifications(self) -> None:
        pause = _NOTIF_POLL_MIN_S
        while not self._stop.is_set():
            notifs = self._agent.get_new_notifs()
            for sender, messages in notifs.items():
                for message in messages:
                    self._apply(sender, message)
            pause = _NOTIF_POLL_MIN_S if notifs else min(2 * pause, _NOTIF_POLL_MAX_S)
            time.sleep(pause)

    def _apply(self, sender: str, message: bytes) -> None:
        try:
            notice = msgspec.msgpack.decode(message, type=Notice)
            check_same_model(notice.layout, self.caches.layout)
            self._record_notification(notice.request_id, notice.layout)
        except (msgspec.DecodeError, msgspec.ValidationError, LayoutError) as exc:
            log.warning("ignored a bad notification from NIXL agent %s: %s", sender, exc)
        except Exception:  # noqa: BLE001  an `on_finished` callback must not stop this thread
            log.exception("handling a notification from NIXL agent %s failed", sender)


@dataclass(frozen=True, slots=True)
class _Peer:
    address: str
    agent_name: str
    info: AgentInfo


class NixlSender(KVSender):
    """Writes this rank's blocks into `NixlReceiver`s; one loaded remote agent per address."""

    def __init__(self, caches: KVCaches) -> None:
        super().__init__(caches)
        self._agent = _new_agent("send", thread_safe=True)
        self._reg, self._mem_type, self._device_id = _register(self._agent, caches)
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()  # NOTE: one fetch and one agent load per address
        self._peers: dict[str, _Peer] = {}
        self._closed = False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            self._forget_agent(peer.agent_name)
        self._agent.deregister_memory(self._reg)

    def _write_blocks(
        self, peer: ReceiverEndpoint, plan: SlicePlan,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int], deadline: float,
    ) -> None:
        remote = self._peer(peer, deadline)
        _check_destination(remote, dst_block_ids)
        if not src_block_ids:
            return
        local_descs, remote_descs = _descriptors(
            self.caches, self._device_id, remote.info, plan, src_block_ids, dst_block_ids,
        )
        try:
            handle = self._agent.initialize_xfer(
                "WRITE", self._agent.get_xfer_descs(local_descs, self._mem_type),
                self._agent.get_xfer_descs(remote_descs, remote.info.mem_type), remote.agent_name,
            )
        except Exception as exc:  # noqa: BLE001  the native layer raises its own types
            self._drop(remote)
            raise _nixl_error(exc, peer.address) from exc
        self._wait(handle, remote, deadline)

    def _notify(self, peer: ReceiverEndpoint, request_id: str, deadline: float) -> None:
        remote = self._peer(peer, deadline)
        try:
            self._agent.send_notif(remote.agent_name, msgspec.msgpack.encode(Notice(request_id, self.caches.layout)))
        except Exception as exc:  # noqa: BLE001  the native layer raises its own types
            self._drop(remote)
            raise _nixl_error(exc, peer.address) from exc

    def _wait(self, handle: Any, remote: _Peer, deadline: float) -> None:
        """Post the transfer and poll it to DONE; release the handle whatever happens."""
        try:
            state = self._agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(_XFER_POLL_S)
                state = self._agent.check_xfer_state(handle)
        except Exception as exc:  # noqa: BLE001  the native layer raises its own types
            state, error = "ERR", _nixl_error(exc, remote.address)
        else:
            error = PeerUnreachableError(f"NIXL transfer to {remote.address} failed")
        try:
            self._agent.release_xfer_handle(handle)  # cancels a transfer still in flight
        except Exception as exc:  # noqa: BLE001  a transfer that cannot be cancelled
            log.warning("NIXL could not release a transfer to %s: %s", remote.address, exc)
        if state == "DONE":
            return
        self._drop(remote)
        if state == "PROC":
            raise TransferTimeoutError(f"transfer to {remote.address} timed out")
        raise error

    def _peer(self, peer: ReceiverEndpoint, deadline: float) -> _Peer:
        if peer.transport != TRANSPORT:
            raise TransferRejectedError(f"endpoint transport {peer.transport!r} is not {TRANSPORT!r}")
        with self._lock:
            cached = self._peers.get(peer.address)
        if cached is not None:
            return cached
        with self._connect_lock:
            with self._lock:
                cached = self._peers.get(peer.address)
            return cached if cached is not None else self._connect(peer, deadline)

    def _connect(self, peer: ReceiverEndpoint, deadline: float) -> _Peer:
        info = _fetch_info(peer.address, deadline)
        if info.layout != peer.layout:
            raise TransferRejectedError(f"receiver {peer.address} serves a layout that differs from its endpoint's")
        num_layers = len(info.layout.layers)
        if len(info.key_addrs) != num_layers or len(info.value_addrs) != num_layers:
            raise PeerUnreachableError(f"receiver {peer.address} sent addresses for the wrong number of layers")
        try:
            agent_name = self._agent.add_remote_agent(info.agent_metadata)
        except Exception as exc:  # noqa: BLE001  the native layer raises its own types
            raise PeerUnreachableError(f"cannot load NIXL agent of {peer.address}: {exc}") from exc
        if isinstance(agent_name, bytes):
            agent_name = agent_name.decode()
        remote = _Peer(peer.address, agent_name, info)
        with self._lock:
            self._peers[peer.address] = remote
        return remote

    def _drop(self, remote: _Peer) -> None:
        with self._lock:
            if self._peers.get(remote.address) is not remote:
                return
            del self._peers[remote.address]
        self._forget_agent(remote.agent_name)

    def _forget_agent(self, agent_name: str) -> None:
        try:
            self._agent.remove_remote_agent(agent_name)
        except Exception as exc:  # noqa: BLE001  already disconnected
            log.debug("NIXL remote agent %s already gone: %s", agent_name, exc)


def _fetch_info(address: str, deadline: float) -> AgentInfo:
    """Read the receiver's `AgentInfo` from its side channel at `address` (`host:port`)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 1e-3)) as sock:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
            if length > _MAX_INFO:
                raise PeerUnreachableError(f"receiver {address} announced a {length}-byte agent info")
            body = _recv_exact(sock, length)
    except TimeoutError as exc:
        raise TransferTimeoutError(f"fetching the NIXL agent info of {address} timed out") from exc
    except (OSError, ValueError) as exc:
        raise PeerUnreachableError(f"cannot connect to receiver {address}: {exc}") from exc
    try:
        return msgspec.msgpack.decode(body, type=AgentInfo)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerUnreachableError(f"receiver {address} sent a bad agent info: {exc}") from exc


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("receiver closed the side channel early")
        view = view[got:]
    return bytes(buf)


def _check_destination(remote: _Peer, dst_block_ids: Sequence[int]) -> None:
    num_blocks = remote.info.layout.num_blocks
    bad = [b for b in dst_block_ids if not 0 <= b < num_blocks]
    if bad:
        raise TransferRejectedError(f"receiver {remote.address}: block ids out of range [0, {num_blocks}): {bad[:8]}")
    if len(set(dst_block_ids)) != len(dst_block_ids):
        raise TransferRejectedError(f"receiver {remote.address}: duplicate destination block ids")


def _descriptors(
    caches: KVCaches, device_id: int, info: AgentInfo, plan: SlicePlan,
    src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
) -> tuple[Any, Any]:
    """Matching `(address, length, device)` rows, local and remote, for the whole slice."""
    import numpy as np

    src, dst = caches.layout, info.layout
    itemsize = caches.keys[0].element_size()
    head_bytes = src.head_dim * itemsize
    src_ids = np.asarray(src_block_ids, dtype=np.uint64)
    dst_ids = np.asarray(dst_block_ids, dtype=np.uint64)

    def rows(bases: Sequence[int], layers: range, ids: Any, lay: KVLayout, heads: range, device: int) -> Any:
        slot_bytes = lay.num_local_heads * head_bytes
        block_bytes = lay.block_size * slot_bytes
        if plan.num_heads == src.num_local_heads == dst.num_local_heads:
            starts = ids * block_bytes
            length = block_bytes
        else:  # only a slot's head range is contiguous
            slots = np.arange(lay.block_size, dtype=np.uint64) * slot_bytes
            starts = (ids[:, None] * block_bytes + slots[None, :] + heads.start * head_bytes).reshape(-1)
            length = plan.num_heads * head_bytes
        addrs = np.concatenate([np.uint64(bases[layer]) + starts for layer in layers])
        out = np.empty((addrs.size, 3), dtype=np.uint64)
        out[:, 0], out[:, 1], out[:, 2] = addrs, length, device
        return out

    local_bases = ([t.data_ptr() for t in caches.keys], [t.data_ptr() for t in caches.values])
    remote_bases = (info.key_addrs, info.value_addrs)
    local = np.concatenate([rows(b, plan.src_layers, src_ids, src, plan.src_heads, device_id) for b in local_bases])
    remote = np.concatenate([rows(b, plan.dst_layers, dst_ids, dst, plan.dst_heads, info.device_id) for b in remote_bases])
    return local, remote
