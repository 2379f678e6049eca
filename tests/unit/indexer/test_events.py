import msgspec
import pytest

from indexer.events import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MalformedBatch,
    decode_seq,
    encode_batch,
    encode_seq,
    make_batch,
)

U64_MAX = 2**64 - 1


def test_encodes_current_vllm_map_form():
    batch = EventBatch(
        ts=1.5,
        events=[BlockStored([1, U64_MAX], None, [1, 2, 3, 4], 2, medium="GPU"), BlockRemoved([b"\x01"]), AllBlocksCleared()],
        data_parallel_rank=2,
    )
    assert msgspec.msgpack.decode(encode_batch(batch)) == [
        1.5,
        [
            {
                "type": "BlockStored", "block_hashes": [1, U64_MAX], "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [b"\x01"], "medium": None},
            {"type": "AllBlocksCleared"},
        ],
        2,
    ]


def test_round_trip():
    batch = make_batch([BlockStored([b"h" * 32], b"p" * 32, [9] * 16, 16, lora_name="l")], 0)
    assert BatchDecoder().decode(encode_batch(batch)) == batch


def test_decodes_array_form_with_missing_and_extra_trailing_fields():
    payload = msgspec.msgpack.encode(
        [
            7,  # an int timestamp is accepted as a float
            [
                ["BlockStored", [1, 2], 3, [1, 2, 3, 4], 2],  # old vLLM: no lora_id, medium
                ["BlockStored", [5], None, [1, 2], 2, 4, "CPU", "lora", "future", "fields"],
                ["BlockRemoved", [U64_MAX], "GPU", "future"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = BatchDecoder().decode(payload)
    stored, stored2, removed, cleared = batch.events
    assert batch.ts == 7.0 and batch.data_parallel_rank is None
    assert isinstance(stored, BlockStored) and stored.parent_block_hash == 3 and stored.medium is None
    assert (stored2.lora_id, stored2.medium, stored2.lora_name) == (4, "CPU", "lora")
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [U64_MAX]
    assert isinstance(cleared, AllBlocksCleared)


def test_decodes_map_form_with_unknown_keys():
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [b"ab"], "medium": None, "new_key": 1}], 3, "extra"]
    )
    batch = BatchDecoder().decode(payload)
    assert batch.events == [BlockRemoved([b"ab"])] and batch.data_parallel_rank == 3


def test_decoder_switches_encodings_both_ways():
    decoder = BatchDecoder()
    array_form = msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]]])
    map_form = encode_batch(make_batch([AllBlocksCleared()]))
    for payload in (array_form, array_form, map_form, array_form, map_form):
        (event,) = decoder.decode(payload).events
        assert isinstance(event, AllBlocksCleared)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never used in msgpack
        msgspec.msgpack.encode({"not": "a batch"}),
        msgspec.msgpack.encode([1.0, [["Unknown", 1]]]),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", ["not-a-hash"], None, [1], 1]]]),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None, [-1.5], 1]]]),
    ],
)
def test_malformed_payloads_raise_one_error_type(payload):
    with pytest.raises(MalformedBatch):
        BatchDecoder().decode(payload)


def test_seq_frames():
    assert encode_seq(1) == b"\x00" * 7 + b"\x01"
    assert decode_seq(encode_seq(-1)) == -1
    assert decode_seq(encode_seq(2**40)) == 2**40
    with pytest.raises(MalformedBatch):
        decode_seq(b"\x00" * 4)
