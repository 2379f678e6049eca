"""KV cache event wire types, exactly as vLLM publishes them, and their codec.

A publisher sends ZMQ multipart messages `[topic, seq, payload]`: `seq` is an 8-byte
big-endian counter, `payload` the msgpack of an array-like `EventBatch`
`[ts, events, data_parallel_rank]`. Events come in two encodings found in the wild:

- maps tagged by a `"type"` key (current vLLM; what kvgate's own publisher sends);
- arrays whose first element is the tag (older vLLM, SGLang, llm-d's decoder).

Both decode to the same classes (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`):
the array-form classes are private subclasses. Fields keep vLLM's names and order;
new fields are only ever appended, and unknown fields (map keys or trailing array
elements) are ignored. Block hashes are whatever the engine uses: unsigned 64-bit
ints or bytes.
"""

from __future__ import annotations

import time
from typing import Union

import msgspec

ExternalBlockHash = Union[int, bytes]
"""An engine's own block hash: opaque to kvgate, an int (u64) or bytes."""

SEQ_BYTES = 8
END_OF_REPLAY_SEQ = -1


class KVCacheEvent(msgspec.Struct, tag_field="type", gc=False):
    """Base of the KV cache events (map form, tagged by `"type"`)."""


class BlockStored(KVCacheEvent, tag="BlockStored"):
    """Full blocks became cached: `token_ids` holds `len(block_hashes) * block_size` ids."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    """Cached blocks were evicted."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    """The engine dropped its whole prefix cache."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published message: events in the order the engine produced them."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# The array encoding: same classes, positional fields, tag first.
class _ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _ArrayEventBatch(EventBatch, array_like=True, gc=False):
    events: list[Union[_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared]]  # type: ignore[assignment]


class MalformedBatch(ValueError):
    """A payload that is not a KV event batch in either encoding."""


class BatchDecoder:
    """Decodes payloads in either event encoding.

    Publishers stick to one encoding, so the decoder tries the one that worked last
    first and only pays for a failed attempt when a publisher switches.
    """

    def __init__(self) -> None:
        self._decoders = [
            msgspec.msgpack.Decoder(EventBatch),
            msgspec.msgpack.Decoder(_ArrayEventBatch),
        ]

    def decode(self, payload: bytes) -> EventBatch:
        first, second = self._decoders
        try:
            return first.decode(payload)
        except msgspec.ValidationError:
            pass
        except msgspec.DecodeError as exc:
            raise MalformedBatch(str(exc)) from None
        try:
            batch = second.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise MalformedBatch(str(exc)) from None
        self._decoders.reverse()
        return batch


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of a batch in the current vLLM (map-tagged) encoding."""
    return _encoder.encode(batch)


def make_batch(events: list[KVEvent], data_parallel_rank: int | None = None) -> EventBatch:
    return EventBatch(ts=time.time(), events=events, data_parallel_rank=data_parallel_rank)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """The sequence number of a frame; raises `MalformedBatch` if it is not 8 bytes."""
    if len(frame) != SEQ_BYTES:
        raise MalformedBatch(f"sequence frame of {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big", signed=True)
