"""Unit tests of the prefix index: exact match lengths, event handling, duplicates, memory."""

from __future__ import annotations

import gc
import hashlib
import random
import tracemalloc

import msgspec
import pytest

from indexer.events import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    make_batch,
)
from indexer.hashing import hash_prompt
from indexer.index import IndexStats, PrefixIndex, engine_key

BS = 4
A = ("a", 0)
B = ("b", 0)
C = ("c", 0)


def toks(num_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + num_blocks * BS))


def engine_hashes(num_blocks: int, seed: int) -> list[int]:
    """Random u64s: an engine whose hashes have nothing to do with ours."""
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(num_blocks)]


def stored(keys: list, tokens: list[int], parent=None, **fields) -> BlockStored:
    return BlockStored(block_hashes=keys, parent_block_hash=parent, token_ids=tokens, block_size=BS, **fields)


def apply(index: PrefixIndex, worker, *events) -> None:
    index.apply(worker, make_batch(list(events)))


def ours(tokens: list[int], model: str = "", lora_name: str | None = None) -> list[int]:
    return hash_prompt(tokens, BS, model, lora_name)


@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex(BS)


def test_shared_prefixes_and_divergence(index):
    chain_x = toks(6)
    chain_y = chain_x[: 4 * BS] + toks(2, start=1000)
    apply(index, A, stored(engine_hashes(6, 1), chain_x))
    apply(index, B, stored(engine_hashes(6, 2), chain_y))
    apply(index, C, stored(engine_hashes(2, 3), chain_x[: 2 * BS]))

    assert index.find_matches(ours(chain_x)) == {A: 6, B: 4, C: 2}
    assert index.find_matches(ours(chain_y)) == {A: 4, B: 6, C: 2}
    assert index.find_matches(ours(chain_x)[:3]) == {A: 3, B: 3, C: 2}
    assert index.find_matches(ours(chain_x + toks(3, start=5000))) == {A: 6, B: 4, C: 2}
    assert index.find_matches(ours(toks(6, start=7000))) == {}
    assert index.find_matches([]) == {}
    stats = index.stats()
    assert (stats.num_blocks, stats.num_entries, stats.num_workers) == (8, 14, 3)


def test_a_hole_stops_the_match(index):
    tokens = toks(6)
    keys = engine_hashes(6, 1)
    apply(index, A, stored(keys, tokens))
    apply(index, B, stored(engine_hashes(6, 2), tokens))
    apply(index, A, BlockRemoved(block_hashes=[keys[2]]))

    assert index.find_matches(ours(tokens)) == {A: 2, B: 6}
    assert index.num_blocks(A) == 5
    assert index.worker_block_hashes(A) == set(ours(tokens)) - {ours(tokens)[2]}


def test_a_worker_missing_block_0_is_absent(index):
    tokens = toks(3)
    keys = engine_hashes(3, 1)
    apply(index, A, stored(keys, tokens))
    apply(index, A, BlockRemoved(block_hashes=[keys[0]]))
    assert index.find_matches(ours(tokens)) == {}


def test_events_chain_across_batches(index):
    tokens = toks(6)
    keys = engine_hashes(6, 1)
    apply(index, A, stored(keys[:3], tokens[: 3 * BS]))
    apply(index, A, stored(keys[3:], tokens[3 * BS :], parent=keys[2]))
    assert index.find_matches(ours(tokens)) == {A: 6}
    assert index.worker_block_hashes(A) == set(ours(tokens))


def test_both_encodings_decode_to_the_same_index():
    tokens = toks(3)
    keys = engine_hashes(3, 1)
    array_form = msgspec.msgpack.encode(
        [
            1.5,
            [
                ["BlockStored", keys, None, tokens, BS, None, "GPU", None],
                ["BlockRemoved", [keys[2]], "GPU"],
            ],
            0,
        ]
    )
    map_form = encode_batch(
        EventBatch(1.5, [stored(keys, tokens, medium="GPU"), BlockRemoved([keys[2]], "GPU")], 0)
    )
    decoder = BatchDecoder()
    by_array, by_map = PrefixIndex(BS), PrefixIndex(BS)
    by_array.apply(A, decoder.decode(array_form))
    by_map.apply(A, decoder.decode(map_form))

    assert by_array.find_matches(ours(tokens)) == by_map.find_matches(ours(tokens)) == {A: 2}
    by_array.apply(A, decoder.decode(msgspec.msgpack.encode([2.0, [["AllBlocksCleared"]], 0])))
    assert by_array.find_matches(ours(tokens)) == {}
    assert by_array.stats().num_events == 3


@pytest.mark.parametrize(
    "keys",
    [
        [2**64 - 1, 2**64 - 2, 2**63],
        [-1, -(2**63), -42],
        [hashlib.sha256(bytes([i])).digest() for i in range(3)],
    ],
    ids=["u64", "negative-i64", "bytes"],
)
def test_engine_hash_kinds(index, keys):
    tokens = toks(3)
    apply(index, A, stored(keys[:2], tokens[: 2 * BS]))
    apply(index, A, stored(keys[2:], tokens[2 * BS :], parent=keys[1]))
    assert index.find_matches(ours(tokens)) == {A: 3}

    apply(index, A, BlockRemoved(block_hashes=[keys[1]]))
    assert index.find_matches(ours(tokens)) == {A: 1}
    assert index.stats().num_unknown_removed == 0


def test_bytes_engine_hashes_are_kept_as_ints(index):
    key = b"\x07" * 32
    apply(index, A, stored([key], toks(1)))
    assert engine_key(key) == engine_key(bytes(key))
    assert isinstance(engine_key(key), int)
    assert list(index._workers[A].blocks) == [engine_key(key)]


def test_any_engine_hash_function_matches_our_prompt_hashes(index):
    tokens = toks(5)
    sha_chain, parent = [], b""
    for start in range(0, len(tokens), BS):
        parent = hashlib.sha256(parent + bytes(tokens[start : start + BS])).digest()
        sha_chain.append(parent)
    apply(index, A, stored(sha_chain, tokens))
    apply(index, B, stored(engine_hashes(5, 99), tokens))

    assert index.find_matches(ours(tokens)) == {A: 5, B: 5}
    assert index.worker_block_hashes(A) == index.worker_block_hashes(B) == set(ours(tokens))
    assert index.stats().num_blocks == 5


def test_unknown_parent_is_counted_and_dropped(index):
    tokens = toks(4)
    keys = engine_hashes(4, 1)
    apply(index, A, stored(keys[2:], tokens[2 * BS :], parent=keys[1]))
    apply(index, A, stored(keys[3:], tokens[3 * BS :], parent=keys[2]))

    stats = index.stats()
    assert (stats.num_unknown_parent, stats.num_stored_blocks, stats.num_blocks) == (2, 0, 0)
    assert index.find_matches(ours(tokens)) == {}


def test_models_and_loras_never_share_entries(index):
    tokens = toks(3)
    index.set_model("a", "llama")
    index.set_model("b", "qwen")
    apply(index, A, stored(engine_hashes(3, 1), tokens))
    apply(index, B, stored(engine_hashes(3, 1), tokens))
    apply(index, C, stored(engine_hashes(3, 1), tokens, lora_name="sql"))
    apply(index, ("d", 0), stored(engine_hashes(3, 1), tokens, lora_id=7))

    assert index.find_matches(ours(tokens, "llama")) == {A: 3}
    assert index.find_matches(ours(tokens, "qwen")) == {B: 3}
    assert index.find_matches(ours(tokens, "", "sql")) == {C: 3}
    assert index.find_matches(ours(tokens)) == {}
    assert index.stats().num_blocks == 12


def test_set_model_covers_every_dp_rank_and_later_workers():
    index = PrefixIndex(BS, default_model="base")
    tokens = toks(2)
    apply(index, ("w", 0), stored(engine_hashes(2, 1), tokens))
    index.set_model("w", "tuned")
    apply(index, ("w", 1), stored(engine_hashes(2, 1), tokens))
    apply(index, ("w", 0), stored(engine_hashes(2, 2), tokens))

    assert index.find_matches(ours(tokens, "base")) == {("w", 0): 2}
    assert index.find_matches(ours(tokens, "tuned")) == {("w", 0): 2, ("w", 1): 2}


def test_all_blocks_cleared_clears_one_worker(index):
    tokens = toks(3)
    apply(index, A, stored(engine_hashes(3, 1), tokens))
    apply(index, B, stored(engine_hashes(3, 2), tokens))
    apply(index, A, AllBlocksCleared())

    assert index.find_matches(ours(tokens)) == {B: 3}
    assert index.workers() == [A, B]
    assert index.num_blocks(A) == 0


def test_clear_keeps_the_worker_and_remove_forgets_it(index):
    tokens = toks(3)
    apply(index, A, stored(engine_hashes(3, 1), tokens))
    apply(index, B, stored(engine_hashes(3, 2), tokens))
    index.clear(A)
    assert index.workers() == [A, B]
    assert index.find_matches(ours(tokens)) == {B: 3}

    assert index.remove_worker(B) is True
    assert index.remove_worker(B) is False
    assert index.workers() == [A]
    assert index.find_matches(ours(tokens)) == {}
    assert index.stats().num_blocks == 0
    index.clear(("never-seen", 0))
    assert index.num_blocks(("never-seen", 0)) == 0
    assert index.worker_block_hashes(("never-seen", 0)) == set()


def test_a_reused_slot_inherits_nothing(index):
    tokens = toks(3)
    apply(index, A, stored(engine_hashes(3, 1), tokens))
    apply(index, B, stored(engine_hashes(2, 2), tokens[: 2 * BS]))
    index.remove_worker(A)
    apply(index, C, stored(engine_hashes(1, 3), tokens[:BS]))

    assert index.find_matches(ours(tokens)) == {B: 2, C: 1}
    assert index._workers[C].slot == 0


def test_dp_ranks_are_separate_workers(index):
    tokens = toks(2)
    apply(index, ("w", 0), stored(engine_hashes(2, 1), tokens))
    apply(index, ("w", 1), stored(engine_hashes(1, 1), tokens[:BS]))
    assert index.find_matches(ours(tokens)) == {("w", 0): 2, ("w", 1): 1}


def test_two_engine_hashes_for_one_block_keep_it_until_both_go(index):
    tokens = toks(3)
    first, second = engine_hashes(3, 1), engine_hashes(3, 2)
    apply(index, A, stored(first, tokens))
    apply(index, A, stored(second, tokens))
    assert index.num_blocks(A) == 3
    assert index.stats().num_entries == 3

    apply(index, A, BlockRemoved(block_hashes=first))
    assert index.find_matches(ours(tokens)) == {A: 3}
    apply(index, A, BlockRemoved(block_hashes=second[1:]))
    assert index.find_matches(ours(tokens)) == {A: 1}
    apply(index, A, BlockRemoved(block_hashes=second[:1]))
    assert index.find_matches(ours(tokens)) == {}
    assert index.stats().num_blocks == 0


def test_one_engine_hash_stored_twice_is_held_until_removed_twice(index):
    tokens = toks(2)
    keys = engine_hashes(2, 1)
    apply(index, A, stored(keys, tokens), stored(keys, tokens))
    assert index.num_blocks(A) == 2

    apply(index, A, BlockRemoved(block_hashes=keys))
    assert index.find_matches(ours(tokens)) == {A: 2}
    apply(index, A, BlockRemoved(block_hashes=keys))
    assert index.find_matches(ours(tokens)) == {}
    apply(index, A, BlockRemoved(block_hashes=keys))
    assert index.stats().num_unknown_removed == 2


def test_an_engine_hash_reused_for_other_content_replaces_the_block(index):
    old, new = toks(1), toks(1, start=500)
    apply(index, A, stored([77], old))
    apply(index, A, stored([77], new))

    assert index.find_matches(ours(old)) == {}
    assert index.find_matches(ours(new)) == {A: 1}
    assert index.stats().num_blocks == 1
    apply(index, A, BlockRemoved(block_hashes=[77]))
    assert index.stats().num_blocks == 0


@pytest.mark.parametrize(
    "event",
    [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=toks(2), block_size=BS * 2),
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=toks(2)[:-1], block_size=BS),
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[0, 1, 2, 2**32], block_size=BS),
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[0, -1, 2, 3], block_size=BS),
    ],
    ids=["block-size", "token-count", "token-too-big", "token-negative"],
)
def test_malformed_stores_are_counted_and_dropped(index, event):
    apply(index, A, event)
    stats = index.stats()
    assert (stats.num_malformed, stats.num_stored_blocks, stats.num_blocks) == (1, 0, 0)


def test_other_mediums_are_ignored(index):
    tokens = toks(2)
    keys = engine_hashes(2, 1)
    apply(index, A, stored(keys, tokens, medium="CPU"))
    assert index.find_matches(ours(tokens)) == {}
    apply(index, A, stored(keys, tokens, medium="GPU"))
    apply(index, A, BlockRemoved(block_hashes=keys, medium="CPU"))
    assert index.find_matches(ours(tokens)) == {A: 2}
    assert index.stats().num_ignored_medium == 2


def test_stats_count_every_event(index):
    tokens = toks(3)
    keys = engine_hashes(3, 1)
    index.apply_stored(A, stored(keys, tokens))
    index.apply_removed(A, BlockRemoved(block_hashes=[keys[2], 12345]))
    apply(index, A, stored([9], toks(1), parent=555))

    assert index.stats() == IndexStats(
        num_blocks=2,
        num_entries=2,
        num_workers=1,
        num_bytes=index.stats().num_bytes,
        num_events=3,
        num_stored_blocks=3,
        num_removed_blocks=1,
        num_unknown_parent=1,
        num_unknown_removed=1,
        num_malformed=0,
        num_ignored_medium=0,
    )


def test_many_workers_use_wide_masks(index):
    num_workers = 70
    tokens = toks(num_workers)
    for w in range(num_workers):
        apply(index, (f"w{w}", 0), stored(engine_hashes(w + 1, w), tokens[: (w + 1) * BS]))
    assert index.find_matches(ours(tokens)) == {(f"w{w}", 0): w + 1 for w in range(num_workers)}
    index.remove_worker(("w0", 0))
    assert index.find_matches(ours(tokens)[:1]) == {(f"w{w}", 0): 1 for w in range(1, num_workers)}


def _fill(num_workers: int, num_chains: int) -> tuple[list, list]:
    """Encoded store and remove batches: chains of 8 blocks, workers sharing 2-block prefixes."""
    stores, removes = [], []
    for w in range(num_workers):
        for c in range(num_chains):
            tokens = toks(2, start=100 * c) + toks(6, start=100_000 * (w * num_chains + c + 1))
            keys = engine_hashes(8, w * 1000 + c)
            stores.append(((f"w{w}", 0), encode_batch(make_batch([stored(keys, tokens)]))))
            removes.append(((f"w{w}", 0), encode_batch(make_batch([BlockRemoved(block_hashes=keys[::-1])]))))
    return stores, removes


def _replay(index: PrefixIndex, batches: list) -> None:
    decoder = BatchDecoder()
    for worker, payload in batches:
        index.apply(worker, decoder.decode(payload))


def test_removing_everything_leaves_nothing():
    stores, removes = _fill(num_workers=3, num_chains=50)
    index, bare = PrefixIndex(BS), PrefixIndex(BS)
    _replay(bare, [(worker, encode_batch(make_batch([]))) for worker, _ in stores[::50]])
    _replay(index, stores)
    full = index.stats()
    _replay(index, removes)

    stats = index.stats()
    assert (full.num_entries, full.num_blocks) == (3 * 50 * 8, 50 * 2 + 3 * 50 * 6)
    assert (stats.num_blocks, stats.num_entries, stats.num_removed_blocks) == (0, 0, 1200)
    assert [index.num_blocks(worker) for worker in index.workers()] == [0, 0, 0]
    assert stats.num_bytes == bare.stats().num_bytes
    assert full.num_bytes > 100 * full.num_entries


def test_memory_is_returned_once_blocks_are_removed():
    stores, removes = _fill(num_workers=4, num_chains=200)
    num_entries = 4 * 200 * 8
    gc.collect()
    tracemalloc.start()
    try:
        index = PrefixIndex(BS)
        _replay(index, [(worker, encode_batch(make_batch([]))) for worker, _ in stores[::200]])
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        _replay(index, stores)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        _replay(index, removes)
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert index.stats().num_entries == 0
    assert 100 * num_entries < held < 250 * num_entries
    # What is left: counters past the small-int cache and dicts parked on CPython's
    # free list (tracemalloc counts those as live).
    assert left < 4096


def test_partial_removal_shrinks_storage(index):
    keys = engine_hashes(4000, 1)
    apply(index, A, stored(keys, toks(4000)))
    full = index.stats().num_bytes
    apply(index, A, BlockRemoved(block_hashes=keys[400:]))
    assert index.find_matches(ours(toks(4000))) == {A: 400}
    assert index.stats().num_bytes < full * 0.2
