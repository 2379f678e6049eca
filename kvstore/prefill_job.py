"""Prefill job wire types: what a decode worker asks a prefill worker to compute.

Owns `PrefillJob` (the msgspec struct stored in the global prefill queue), its
msgpack codec, and the two records the queue hands back: `ClaimedJob` (a job
delivered to one prefill worker, to be acked once its KV reached the decode worker)
and `DeadLetter` (a job given up on, with the reason).

Invariants:
- `PrefillJob` fields only ever grow at the end, with defaults, so an older reader
  decodes a newer job (unknown map keys are ignored by msgspec).
- `deadline` is wall-clock Unix seconds (`time.time()`): the decode worker and the
  prefill worker are different processes, often on different machines.

Called by the queue implementations (`kvstore.redis_queue`, `kvstore.memory_queue`),
by decode workers (build and enqueue) and by prefill workers (claim, compute, ack).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec


class PrefillJob(msgspec.Struct, frozen=True, tag="PrefillJob", gc=False):
    """One remote prefill: compute the KV of `token_ids`, write it into D's blocks.

    `block_ids` are decode worker D's block ids for the uncached part of the prompt,
    that is for the full blocks from `num_cached_tokens` on (a multiple of
    `block_size`); `receivers` are D's ranks' encoded `kvstore.transfer.ReceiverEndpoint`s
    (transport, address, KV layout), `transfer_endpoint` the first one's address for
    logs, and `agent_metadata` what a transport needs beyond that.
    """

    request_id: str
    model: str
    token_ids: list[int]
    block_ids: list[int]
    decode_worker_id: str
    transfer_endpoint: str
    deadline: float
    num_cached_tokens: int = 0
    agent_metadata: bytes = b""
    created_at: float = 0.0
    block_size: int = 0
    receivers: list[bytes] = msgspec.field(default_factory=list)

    def is_expired(self, now: float | None = None) -> bool:
        """True once the decode worker stopped waiting (it prefills locally then)."""
        return (time.time() if now is None else now) >= self.deadline


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PrefillJob)


def encode_job(job: PrefillJob) -> bytes:
    """The job as msgpack bytes (a tagged map)."""
    return _encoder.encode(job)


def decode_job(payload: bytes) -> PrefillJob:
    """Decode `payload`; raises `msgspec.DecodeError` / `ValidationError` when malformed."""
    return _decoder.decode(payload)


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """A job delivered to `consumer`: pass it back to `ack()` once D holds the KV.

    `entry_id` names the delivery inside the queue (a stream entry id);
    `num_deliveries` counts deliveries of this job so far, this one included.
    """

    job: PrefillJob
    entry_id: str
    consumer: str
    num_deliveries: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A job taken out of the queue without being computed, and why.

    `job` is None when the stored payload could not be decoded.
    """

    entry_id: str
    reason: str
    num_deliveries: int
    job: PrefillJob | None
