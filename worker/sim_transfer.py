"""The simulated engine's KV transport: modeled transfer time, real notifications.

Owns `SimIngress` and `SimEgress`, the `worker.disagg.KVIngress` / `KVEgress` of
`kvgate worker --engine sim`. The sim has no KV tensors, so no bytes move: a send
sleeps for what the blocks would take on the modeled link (`SimLink`: latency plus
bytes over bandwidth, divided by the engine's `speedup`), then delivers a real
notification over TCP to the decode worker, which acks it. So a simulated fleet runs
the real queue, the real deadlines and the real failure paths (an unreachable decode
worker, a notification after the deadline).

Wire format (loopback or LAN TCP): each notification is a 4-byte big-endian length
and a msgpack `SimNotify`; the receiver answers one byte, 1 (applied). Endpoints are
`kvstore.transfer.ReceiverEndpoint`s with transport "sim" and a one-layer layout
whose `block_size` and `num_blocks` are the decode worker's.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvstore.kv_layout import KVLayout
from kvstore.prefill_job import PrefillJob
from kvstore.transfer import PeerUnreachableError, ReceiverEndpoint, TransferTimeoutError

logger = logging.getLogger(__name__)

TRANSPORT = "sim"
_LENGTH = struct.Struct("!I")
_MAX_FRAME = 1 << 16


class SimNotify(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    num_blocks: int


@dataclass(frozen=True, slots=True)
class SimLink:
    """The modeled interconnect (defaults: a 7B-class model's KV over a 25 GB/s link)."""

    bytes_per_token: int = 131_072
    bytes_per_s: float = 25e9
    latency_s: float = 0.0002
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.bytes_per_token < 0 or self.bytes_per_s <= 0 or self.latency_s < 0 or self.speedup <= 0:
            raise ValueError("sim link: bytes_per_token and latency_s must be >= 0, bytes_per_s and speedup > 0")

    def seconds(self, num_tokens: int) -> float:
        return (self.latency_s + num_tokens * self.bytes_per_token / self.bytes_per_s) / self.speedup


class SimIngress:
    """Decode side: a TCP listener that reports each notified request."""

    def __init__(self, block_size: int, num_blocks: int, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host, self._port = host, port
        self._layout = KVLayout(
            num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size, dtype="float32", num_blocks=num_blocks
        ).validate()
        self._server: asyncio.Server | None = None
        self._on_ready: Callable[[str], None] | None = None
        self._endpoint: bytes = b""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)
        host, port = self._server.sockets[0].getsockname()[:2]
        self._endpoint = ReceiverEndpoint(transport=TRANSPORT, address=f"{host}:{port}", layout=self._layout).to_bytes()

    def endpoints(self) -> list[bytes]:
        assert self._endpoint, "SimIngress.start() was not awaited"
        return [self._endpoint]

    def set_on_ready(self, callback: Callable[[str], None]) -> None:
        self._on_ready = callback

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                if length > _MAX_FRAME:
                    raise ValueError(f"frame of {length} bytes")
                notify = msgspec.msgpack.decode(await reader.readexactly(length), type=SimNotify)
                if self._on_ready is not None:
                    self._on_ready(notify.request_id)
                writer.write(b"\x01")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the sender closed the connection
        except (ValueError, msgspec.DecodeError) as exc:
            logger.warning("sim KV ingress: dropping a connection after a bad frame: %s", exc)
        finally:
            writer.close()


class SimEgress:
    """Prefill side: waits out the modeled transfer, then notifies each receiver."""

    def __init__(self, link: SimLink) -> None:
        self.link = link
        self._conns: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def send(self, job: PrefillJob, src_block_ids: list[int], timeout_s: float) -> None:
        seconds = self.link.seconds(len(src_block_ids) * job.block_size)
        if seconds > timeout_s:
            raise TransferTimeoutError(f"the transfer needs {seconds:.3f} s, {timeout_s:.3f} s are left")
        await asyncio.sleep(seconds)
        frame = msgspec.msgpack.encode(SimNotify(job.request_id, len(src_block_ids)))
        for raw in job.receivers:
            endpoint = ReceiverEndpoint.from_bytes(raw)
            if endpoint.transport != TRANSPORT:
                raise PeerUnreachableError(f"the sim engine cannot write to a {endpoint.transport!r} receiver")
            try:
                await asyncio.wait_for(self._notify(endpoint.address, frame), max(timeout_s - seconds, 0.001))
            except TimeoutError:
                raise TransferTimeoutError(f"{endpoint.address} did not ack the notification in time") from None

    async def _notify(self, address: str, frame: bytes) -> None:
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            # A kept-alive connection may have died with an earlier receiver: one fresh retry.
            for attempt in (1, 2):
                try:
                    reader, writer = await self._connection(address)
                    writer.write(_LENGTH.pack(len(frame)) + frame)
                    await writer.drain()
                    if await reader.readexactly(1) == b"\x01":
                        return
                    raise PeerUnreachableError(f"{address} refused the notification")
                except (OSError, asyncio.IncompleteReadError) as exc:
                    self._drop(address)
                    if attempt == 2:
                        raise PeerUnreachableError(f"{address}: {exc}") from None

    async def _connection(self, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        conn = self._conns.get(address)
        if conn is None or conn[1].is_closing():
            host, _, port = address.rpartition(":")
            conn = self._conns[address] = await asyncio.open_connection(host, int(port))
        return conn

    def _drop(self, address: str) -> None:
        conn = self._conns.pop(address, None)
        if conn is not None:
            conn[1].close()

    def close(self) -> None:
        for address in list(self._conns):
            self._drop(address)
