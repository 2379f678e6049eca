from indexer.events import EventBatch
from indexer.hashing import hash_prompt
from indexer.index import PrefixIndex
from router.policy import fill_matches, request_hashes
from worker.block_pool import BlockPool


def cached_on(pool: BlockPool, index: PrefixIndex, worker, tokens, request_id):
    """Runs a prompt through a real block pool and feeds its KV events to the index."""
    pool.allocate(request_id, tokens)
    pool.commit(request_id, len(tokens))
    pool.free(request_id)
    index.apply(worker, EventBatch(0.0, pool.take_events(), 0))


def test_fill_matches_sets_leading_blocks_from_real_block_pool_events(candidate, request_factory):
    index = PrefixIndex(block_size=4, default_model="m")
    cached_on(BlockPool(64, 4, model="m"), index, ("a", 0), list(range(16)), "x")
    cached_on(BlockPool(64, 4, model="m"), index, ("b", 0), [*range(8), *range(100, 108)], "y")
    request = request_factory(tokens=[*range(16), 1, 2])
    cands = [candidate("a"), candidate("b"), candidate("c"), candidate("a", dp_rank=1)]
    fill_matches(index, request, cands)
    assert [c.matched_blocks for c in cands] == [4, 2, 0, 0]
    assert request.hashes_by_block_size == {4: hash_prompt(request.token_ids, 4, "m")}


def test_other_block_sizes_get_hashes_but_no_index_matches(candidate, request_factory):
    index = PrefixIndex(block_size=4, default_model="m")
    cached_on(BlockPool(64, 4, model="m"), index, ("a", 0), list(range(16)), "x")
    request = request_factory(tokens=range(16))
    cands = [candidate("a", block_size=8, matched_blocks=9), candidate("a")]
    fill_matches(index, request, cands)
    assert [c.matched_blocks for c in cands] == [0, 4]
    assert set(request.hashes_by_block_size) == {4, 8}
    assert request.hashes_by_block_size[8] == hash_prompt(request.token_ids, 8, "m")


def test_hashes_are_rooted_in_the_request_model(candidate, request_factory):
    index = PrefixIndex(block_size=4, default_model="m")
    cached_on(BlockPool(64, 4, model="m"), index, ("a", 0), list(range(16)), "x")
    request = request_factory(tokens=range(16), model="other")
    cands = [candidate("a")]
    fill_matches(index, request, cands)
    assert cands[0].matched_blocks == 0


def test_hashes_already_in_the_request_are_reused(request_factory):
    request = request_factory(tokens=range(16))
    request.hashes_by_block_size[4] = [11, 22]
    assert request_hashes(request, 4) == [11, 22]
    assert request_hashes(request, 16) == hash_prompt(request.token_ids, 16, "m")
