"""The torch engine's KV ports: its paged cache behind a `kvstore` transport.

Owns `torch_kv_ports`, which wraps an `EngineCore`'s KV cache tensors (per layer, K
and V of shape `[num_blocks, block_size, num_kv_heads, head_dim]`) as
`kvstore.transfer.KVCaches` with this worker's `KVLayout` (one rank: TP 1, PP 1), and
returns the factories `worker.disagg_service.DisaggService` calls: a decode worker's
`KVIngress` (a receiver other workers write into) and a prefill worker's `KVEgress`
(a sender that writes into the receivers a job names, picking each peer's transport
from its endpoint).

Threads: the receiver applies writes and reports completions on its own threads;
the sender runs in a worker thread (`asyncio.to_thread`). Neither touches the block
pool: the blocks they read or write are held for them (remote-prefilling on the
decode side, held after finishing on the prefill side).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kvstore.kv_layout import KVLayout
from kvstore.prefill_job import PrefillJob
from kvstore.transfer import KVCaches, KVReceiver, KVSender, ReceiverEndpoint
from kvstore.transports import open_receiver, open_sender
from worker.engine_core import EngineCore


def engine_caches(core: EngineCore) -> KVCaches:
    """The engine's KV cache as one rank's `KVCaches`."""
    model = core.model_config
    layout = KVLayout(
        num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        block_size=core.config.block_size, dtype=core.config.dtype, num_blocks=core.config.num_blocks,
    ).validate()
    caches = core.runner.kv_caches
    return KVCaches(layout, [k for k, _ in caches], [v for _, v in caches])


class TorchIngress:
    """Decode side: a receiver over the engine's cache; reports and forgets completed requests."""

    def __init__(self, receiver: KVReceiver) -> None:
        self._receiver = receiver
        self._endpoints = [receiver.endpoint.to_bytes()]

    def endpoints(self) -> list[bytes]:
        return self._endpoints

    def set_on_ready(self, callback: Callable[[str], None]) -> None:
        def on_finished(request_id: str) -> None:
            self._receiver.forget(request_id)
            callback(request_id)

        self._receiver.on_finished = on_finished

    def close(self) -> None:
        self._receiver.close()


class TorchEgress:
    """Prefill side: one sender per transport, created on first use."""

    def __init__(self, caches: KVCaches) -> None:
        self._caches = caches
        self._senders: dict[str, KVSender] = {}

    async def send(self, job: PrefillJob, src_block_ids: list[int], timeout_s: float) -> None:
        peers = [ReceiverEndpoint.from_bytes(raw) for raw in job.receivers]
        for transport in {peer.transport for peer in peers}:
            sender = self._senders.get(transport)
            if sender is None:
                sender = self._senders[transport] = open_sender(transport, self._caches)
            group = [peer for peer in peers if peer.transport == transport]
            await asyncio.to_thread(sender.send, group, job.request_id, src_block_ids, job.block_ids, timeout_s)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()


def torch_kv_ports(
    core: EngineCore, *, host: str, transport: str
) -> tuple[Callable[[], Awaitable[TorchIngress]], Callable[[], TorchEgress]]:
    """The ingress and egress factories over `core`'s KV cache."""
    caches = engine_caches(core)

    async def ingress() -> TorchIngress:
        return TorchIngress(open_receiver(transport, caches, host=host))

    def egress() -> TorchEgress:
        return TorchEgress(caches)

    return ingress, egress
