"""BlockPool: exact block ids, eviction order, prefix hits, events, and a random walk."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from indexer.events import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    KVEvent,
    encode_batch,
    make_batch,
)
from indexer.hashing import BlockHash, hash_blocks, namespace_root
from worker.block_pool import BlockPool, NoFreeBlocks, UnknownRequest

BS = 4
ROOT = namespace_root()


def toks(start: int, num_tokens: int) -> list[int]:
    return list(range(start, start + num_tokens))


def hashes(token_ids: list[int], parent: int = ROOT) -> list[BlockHash]:
    return hash_blocks(token_ids, BS, parent)


def stored(token_ids: list[int], parent: int | None, lora_name: str | None = None) -> BlockStored:
    """The event for the full blocks `token_ids`, chained to `parent` (None: a first block)."""
    return BlockStored(
        block_hashes=list(hashes(token_ids, ROOT if parent is None else parent)),
        parent_block_hash=parent,
        token_ids=token_ids,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=lora_name,
    )


def removed(block_hash: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[block_hash], medium="GPU")


def cached_pool(num_blocks: int, token_ids: list[int], request_id: str = "a") -> BlockPool:
    """A pool where `request_id` holds `token_ids`, all committed; events already taken."""
    pool = BlockPool(num_blocks, BS)
    pool.allocate(request_id, token_ids)
    pool.commit(request_id, len(token_ids))
    pool.take_events()
    return pool


# -- allocation and block ids ----------------------------------------------------------


def test_fresh_allocation_hands_out_ids_in_order() -> None:
    pool = BlockPool(8, BS)
    assert pool.allocate("a", toks(0, 10)) == 0
    assert pool.block_ids("a") == [0, 1, 2]
    assert pool.allocate("b", toks(100, 4)) == 0
    assert pool.block_ids("b") == [3]
    assert pool.free_block_ids() == [4, 5, 6, 7]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.usage) == (4, 4, 0.5)
    assert pool.num_tokens("a") == 10 and pool.num_computed_tokens("a") == 0
    assert pool.take_events() == []
    assert [block.ref_cnt for block in pool.blocks] == [1, 1, 1, 1, 0, 0, 0, 0]


def test_can_allocate_and_can_append_count_blocks() -> None:
    pool = BlockPool(4, BS)
    assert pool.can_allocate(16) and not pool.can_allocate(17)
    pool.allocate("a", toks(0, 3))
    assert pool.can_allocate(12) and not pool.can_allocate(13)
    assert pool.can_append("a", 1) and pool.can_append("a", 13)
    assert not pool.can_append("a", 14)
    assert pool.num_blocks_for(0) == 0 and pool.num_blocks_for(5) == 2


def test_constructor_and_request_errors() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, BS)
    with pytest.raises(ValueError):
        BlockPool(4, 0)
    pool = BlockPool(4, BS)
    with pytest.raises(ValueError):
        pool.allocate("a", [])
    pool.allocate("a", toks(0, 6))
    with pytest.raises(ValueError):
        pool.allocate("a", toks(0, 6))
    for call in (pool.free, pool.block_ids, pool.num_tokens, pool.num_computed_tokens):
        with pytest.raises(UnknownRequest):
            call("nope")
    with pytest.raises(KeyError):
        pool.commit("nope", 1)
    with pytest.raises(UnknownRequest):
        pool.append("nope", [1])
    pool.commit("a", 3)
    with pytest.raises(ValueError):
        pool.commit("a", 2)
    with pytest.raises(ValueError):
        pool.commit("a", 7)
    assert pool.num_computed_tokens("a") == 3


# -- commit and BlockStored -------------------------------------------------------------


def test_chunked_commit_caches_blocks_as_they_fill() -> None:
    pool = BlockPool(8, BS)
    tokens = toks(0, 12)
    h = hashes(tokens)
    pool.allocate("a", tokens)
    pool.commit("a", 3)
    assert pool.take_events() == [] and pool.cached_block_hashes() == set()
    pool.commit("a", 6)
    assert pool.take_events() == [stored(tokens[:4], None)]
    pool.commit("a", 6)
    assert pool.take_events() == []
    pool.commit("a", 12)
    assert pool.take_events() == [stored(tokens[4:12], h[0])]
    assert pool.cached_block_hashes() == set(h)
    assert [pool.blocks[i].block_hash for i in range(3)] == h
    assert pool.num_cached_blocks == 3 and pool.num_computed_tokens("a") == 12


def test_decode_appends_blocks_and_caches_generated_tokens() -> None:
    pool = BlockPool(8, BS)
    prompt = toks(0, 6)
    pool.allocate("a", prompt)
    pool.commit("a", 6)
    assert pool.take_events() == [stored(prompt[:4], None)]
    pool.append("a", [100])
    pool.commit("a", 7)
    pool.append("a", [101])
    assert pool.block_ids("a") == [0, 1]
    pool.append("a", [102])
    assert pool.block_ids("a") == [0, 1, 2]
    pool.commit("a", 8)
    h0 = hashes(prompt)[0]
    assert pool.take_events() == [stored([4, 5, 100, 101], h0)]
    assert pool.cached_block_hashes() == set(hashes(prompt + [100, 101]))
    pool.commit("a", 9)
    assert pool.take_events() == []


def test_namespace_root_and_lora_name_reach_the_events() -> None:
    pool = BlockPool(4, BS, model="m", lora_name="adapter")
    tokens = toks(0, 8)
    pool.allocate("a", tokens)
    pool.commit("a", 8)
    (event,) = pool.take_events()
    assert event.block_hashes == hash_blocks(tokens, BS, namespace_root("m", "adapter"))
    assert event.block_hashes != hashes(tokens)
    assert (event.parent_block_hash, event.lora_name, event.token_ids) == (None, "adapter", tokens)


def test_events_survive_the_wire_codec() -> None:
    pool = BlockPool(2, BS)
    pool.allocate("a", toks(0, 8))
    pool.commit("a", 8)
    pool.free("a")
    pool.allocate("b", toks(50, 4))
    pool.free("b")
    assert pool.reset_prefix_cache()
    events = pool.take_events()
    assert [type(event) for event in events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    decoded = BatchDecoder().decode(encode_batch(make_batch(events, 0)))
    assert decoded.events == events and decoded.data_parallel_rank == 0


# -- prefix hits ------------------------------------------------------------------------


def test_prefix_hit_shares_cached_blocks() -> None:
    prompt = toks(0, 12)
    pool = cached_pool(8, prompt)
    other = prompt[:8] + toks(50, 5)
    assert pool.allocate("b", other) == 8
    assert pool.block_ids("b") == [0, 1, 3, 4]
    assert [pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 1, 1, 1]
    assert pool.num_free_blocks == 3
    pool.commit("b", 13)
    assert pool.take_events() == [stored(toks(50, 4), hashes(prompt)[1])]


def test_fully_cached_prompt_recomputes_its_last_block() -> None:
    prompt = toks(0, 8)
    pool = cached_pool(8, prompt)
    pool.free("a")
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert pool.allocate("b", prompt) == 4
    assert pool.block_ids("b") == [0, 2]
    assert pool.num_computed_tokens("b") == 4
    pool.commit("b", 8)
    # Block 2 fills with the hash block 1 caches: b takes block 1, block 2 is free again.
    assert pool.take_events() == []
    assert pool.block_ids("b") == [0, 1]
    assert pool.blocks[2].block_hash is None
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7]
    assert pool.cached_block_hashes() == set(hashes(prompt))
    pool.free("b")
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]


def test_concurrent_computations_of_one_prefix_end_up_sharing_blocks() -> None:
    pool = BlockPool(16, BS)
    prompt = toks(0, 12)
    variant = prompt[:8] + toks(90, 4)
    h = hashes(prompt)
    assert pool.allocate("a", prompt) == 0
    assert pool.allocate("b", variant) == 0
    assert pool.allocate("c", prompt) == 0
    assert [pool.block_ids(r) for r in "abc"] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    pool.commit("a", 12)
    pool.commit("b", 12)
    pool.commit("c", 12)
    assert pool.take_events() == [stored(prompt, None), stored(toks(90, 4), h[1])]
    assert [pool.block_ids(r) for r in "abc"] == [[0, 1, 2], [0, 1, 5], [0, 1, 2]]
    assert [pool.blocks[i].ref_cnt for i in range(9)] == [3, 3, 2, 0, 0, 1, 0, 0, 0]
    assert pool.cached_block_hashes() == set(h) | {hashes(variant)[2]}
    # The swapped-out blocks are free and reused first, most recently released first.
    assert pool.free_block_ids()[:5] == [8, 7, 6, 4, 3]


def test_new_blocks_after_a_shared_one_chain_to_it() -> None:
    pool = BlockPool(8, BS)
    prompt = toks(0, 12)
    h = hashes(prompt)
    pool.allocate("a", prompt)
    pool.allocate("b", prompt + toks(200, 4))
    pool.commit("a", 8)
    pool.commit("b", 16)
    # b shares a's h0, h1; its h2 and h3 are new and chain to the shared h1.
    assert pool.take_events() == [stored(prompt[:8], None), stored(prompt[8:] + toks(200, 4), h[1])]
    assert pool.block_ids("b") == [0, 1, 5, 6]
    pool.commit("a", 12)
    assert pool.take_events() == []
    assert pool.block_ids("a") == [0, 1, 5]
    pool.free("b")
    pool.free("a")
    assert pool.free_block_ids() == [2, 4, 3, 7, 6, 5, 1, 0]
    pool.allocate("d", toks(500, 24))
    # Eviction takes b's tail first: h3, then h2.
    assert pool.take_events() == [removed(hashes(prompt + toks(200, 4))[3]), removed(h[2])]


def test_preempted_request_comes_back_with_its_committed_prefix() -> None:
    pool = BlockPool(8, BS)
    pool.allocate("a", toks(0, 6))
    pool.commit("a", 6)
    pool.append("a", [100, 101])
    pool.commit("a", 8)
    pool.free("a")
    assert pool.allocate("a", toks(0, 6) + [100, 101, 102]) == 8
    assert pool.block_ids("a") == [0, 1, 2]
    assert pool.num_computed_tokens("a") == 8 and pool.num_tokens("a") == 9


# -- free and eviction order ------------------------------------------------------------


def test_free_is_tail_first_and_eviction_is_lru() -> None:
    prompt = toks(0, 12)
    h = hashes(prompt)
    pool = cached_pool(8, prompt)
    pool.allocate("b", toks(100, 8))
    assert pool.free_block_ids() == [5, 6, 7]
    pool.free("a")
    assert pool.free_block_ids() == [5, 6, 7, 2, 1, 0]
    pool.free("b")
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    pool.allocate("c", toks(500, 24))
    assert pool.block_ids("c") == [3, 4, 5, 6, 7, 2]
    assert pool.take_events() == [removed(h[2])]
    pool.allocate("d", toks(900, 8))
    assert pool.block_ids("d") == [1, 0]
    assert pool.take_events() == [removed(h[1]), removed(h[0])]
    assert pool.cached_block_hashes() == set() and pool.num_free_blocks == 0


def test_a_prefix_hit_refreshes_recency() -> None:
    pool = BlockPool(8, BS)
    first, second = toks(0, 4), toks(100, 4)
    for request_id, tokens in (("a", first), ("b", second)):
        pool.allocate(request_id, tokens)
        pool.commit(request_id, 4)
    pool.take_events()
    pool.free("a")
    pool.free("b")
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 0, 1]
    assert pool.allocate("c", first + [7]) == 4
    assert pool.block_ids("c") == [0, 2]
    pool.free("c")
    assert pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    pool.allocate("d", toks(500, 28))
    assert pool.take_events() == [removed(hashes(second)[0])]
    assert pool.cached_block_hashes() == set(hashes(first))


# -- all-or-nothing ---------------------------------------------------------------------


def test_failed_allocation_leaves_the_pool_unchanged() -> None:
    prompt = toks(0, 8)
    pool = cached_pool(4, prompt)
    pool.free("a")
    assert pool.free_block_ids() == [2, 3, 1, 0]
    # Two hits on free cached blocks plus three fresh blocks: five, and four are free.
    with pytest.raises(NoFreeBlocks) as info:
        pool.allocate("b", prompt + toks(100, 12))
    assert (info.value.num_needed, info.value.num_free) == (5, 4)
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.cached_block_hashes() == set(hashes(prompt))
    assert pool.take_events() == [] and not pool.has_request("b")
    assert pool.allocate("b", prompt + toks(100, 8)) == 8
    assert pool.block_ids("b") == [0, 1, 2, 3]
    assert pool.take_events() == []


def test_failed_append_leaves_the_request_unchanged() -> None:
    pool = BlockPool(2, BS)
    pool.allocate("a", toks(0, 8))
    assert not pool.can_append("a", 1)
    with pytest.raises(NoFreeBlocks):
        pool.append("a", [100])
    assert pool.block_ids("a") == [0, 1] and pool.num_tokens("a") == 8
    with pytest.raises(ValueError):
        pool.commit("a", 9)


# -- reset and disabled caching ---------------------------------------------------------


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    prompt = toks(0, 8)
    pool = cached_pool(4, prompt)
    assert not pool.reset_prefix_cache()
    assert pool.take_events() == [] and pool.num_cached_blocks == 2
    pool.free("a")
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_block_hashes() == set()
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.allocate("b", prompt) == 0
    assert pool.take_events() == []


def test_disabled_caching_hashes_nothing_and_emits_nothing() -> None:
    pool = BlockPool(8, BS, enable_caching=False)
    prompt = toks(0, 12)
    pool.allocate("a", prompt)
    pool.commit("a", 12)
    pool.free("a")
    assert pool.free_block_ids() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert pool.allocate("b", prompt) == 0
    assert pool.num_computed_tokens("b") == 0
    pool.free("b")
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [] and pool.cached_block_hashes() == set()


# -- random walk ------------------------------------------------------------------------


def replay(events: list[KVEvent], index: set[int]) -> None:
    """Applies events the way the router's index does, checking each is well formed."""
    for event in events:
        if isinstance(event, BlockStored):
            parent = ROOT if event.parent_block_hash is None else event.parent_block_hash
            assert event.block_hashes == hash_blocks(event.token_ids, BS, parent)
            assert len(event.token_ids) == BS * len(event.block_hashes)
            assert index.isdisjoint(event.block_hashes)
            assert event.parent_block_hash is None or event.parent_block_hash in index
            index.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert index.issuperset(event.block_hashes)
            index.difference_update(event.block_hashes)
        else:
            index.clear()


def check_invariants(pool: BlockPool, index: set[int], tokens: dict[str, list[int]]) -> None:
    assert index == pool.cached_block_hashes()
    held = Counter(bid for rid in tokens for bid in pool.block_ids(rid))
    assert [block.ref_cnt for block in pool.blocks] == [held[i] for i in range(pool.num_blocks)]
    free = pool.free_block_ids()
    assert len(free) == pool.num_free_blocks and pool.num_free_blocks + len(held) == pool.num_blocks
    assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    is_cached = [pool.blocks[i].block_hash is not None for i in free]
    assert is_cached == sorted(is_cached), "an uncached free block sits behind a cached one"
    block_hashes = [b.block_hash for b in pool.blocks if b.block_hash is not None]
    assert sorted(block_hashes) == sorted(pool.cached_block_hashes())
    for rid, seq in tokens.items():
        assert pool.num_tokens(rid) == len(seq)
        assert len(pool.block_ids(rid)) == pool.num_blocks_for(len(seq))


def check_hit(pool: BlockPool, before: set[int], prompt: list[int], rid: str, hit: int) -> None:
    """The hit is the longest cached prefix of full blocks, short of the whole prompt."""
    num_hit_blocks, cap = hit // BS, (len(prompt) - 1) // BS
    assert hit % BS == 0 and num_hit_blocks <= cap
    prompt_hashes = hashes(prompt)
    hit_ids = pool.block_ids(rid)[:num_hit_blocks]
    assert [pool.blocks[i].block_hash for i in hit_ids] == prompt_hashes[:num_hit_blocks]
    if num_hit_blocks < cap:
        assert prompt_hashes[num_hit_blocks] not in before


class Walk:
    """Random requests over a few shared prefixes, driven as an engine would drive them."""

    def __init__(self, seed: int, num_blocks: int = 24) -> None:
        self.rng = random.Random(seed)
        self.pool = BlockPool(num_blocks, BS)
        # A 3-token vocabulary makes shared prefixes and concurrent duplicates common.
        self.prefixes = [[self.rng.randrange(3) for _ in range(16)] for _ in range(3)]
        self.tokens: dict[str, list[int]] = {}
        self.parked: dict[str, list[int]] = {}  # preempted requests, to come back

    def step(self) -> None:
        rid = f"r{self.rng.randrange(6)}"
        if rid not in self.tokens:
            self.start(rid)
            return
        action = self.rng.random()
        if action < 0.45:
            done = self.pool.num_computed_tokens(rid)
            self.pool.commit(rid, self.rng.randint(done, len(self.tokens[rid])))
        elif action < 0.8:
            self.grow(rid)
        else:
            self.pool.free(rid)
            seq = self.tokens.pop(rid)
            if self.rng.random() < 0.5:
                self.parked[rid] = seq

    def start(self, rid: str) -> None:
        rng, pool = self.rng, self.pool
        prompt = self.parked.pop(rid, None) or rng.choice(self.prefixes)[: rng.randrange(1, 17)]
        prompt = prompt + [rng.randrange(3) for _ in range(rng.randrange(4))]
        before, free_before = pool.cached_block_hashes(), pool.free_block_ids()
        try:
            hit = pool.allocate(rid, prompt)
        except NoFreeBlocks:
            assert (pool.cached_block_hashes(), pool.free_block_ids()) == (before, free_before)
            assert not pool.has_request(rid)
            return
        self.tokens[rid] = prompt
        check_hit(pool, before, prompt, rid, hit)

    def grow(self, rid: str) -> None:
        new = [self.rng.randrange(3) for _ in range(self.rng.randint(1, 3))]
        try:
            self.pool.append(rid, new)
        except NoFreeBlocks:
            return
        self.tokens[rid] += new

    def free_all(self) -> None:
        for rid in self.tokens:
            self.pool.free(rid)
        self.tokens.clear()


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_keeps_events_and_blocks_consistent(seed: int) -> None:
    walk = Walk(seed)
    index: set[int] = set()
    counts: Counter[type] = Counter()
    for num_steps in range(1, 2501):
        if num_steps % 500 == 0:
            walk.free_all()
            assert walk.pool.reset_prefix_cache()
        walk.step()
        events = walk.pool.take_events()
        counts.update(type(event) for event in events)
        replay(events, index)
        check_invariants(walk.pool, index, walk.tokens)
    # The walk really exercised caching, eviction and resets.
    assert counts[BlockStored] > 100 and counts[BlockRemoved] > 100
    assert counts[AllBlocksCleared] == 5
