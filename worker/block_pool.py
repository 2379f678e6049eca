"""The paged KV block pool with prefix caching: which request holds which KV block.

Owns the engine's `num_blocks` KV blocks (ids `0..num_blocks-1`), their reference
counts, the prefix cache (chained block hash -> block) and the queue of KV events that
describe that cache. Pure mechanism: no I/O, no threads, no locks. The engine's
scheduler (or the simulated engine) is its one owner and calls it from its step loop;
the event publisher thread only ever receives the lists `take_events()` hands over.

A request is a growing token sequence. The engine drives it like this:

1. `allocate(request_id, prompt)` reserves blocks for the whole prompt and returns the
   number of prompt tokens whose KV is already cached (a multiple of `block_size`):
   the longest run of the prompt's leading full blocks found in the prefix cache.
   NOTE: at least one prompt token is always left to compute (the engine needs its
   logits), so a fully cached prompt hits one block less and recomputes its last block.
2. Prefill, in one or more chunks: after each forward pass, `commit(request_id, n)`
   says the first `n` tokens now have their KV. Blocks that became full and computed
   are cached (one `BlockStored` per run of consecutive newly cached blocks).
3. Decode: `append(request_id, new_token_ids)` grows the sequence by sampled tokens,
   reserving blocks as needed; the next forward pass computes them, then `commit`.
4. `free(request_id)` when the request finishes, aborts or is preempted. A preempted
   request comes back with `allocate(request_id, prompt + generated)`, which finds the
   blocks it committed before, if they were not evicted in the meantime.

Allocation is all-or-nothing: `NoFreeBlocks` leaves the pool exactly as it was.

Free list: one intrusive doubly linked list (O(1) push, pop and removal). Uncached
blocks go to its front (reused first), cached ones to its back in LRU order, so a
cached block is only evicted when no uncached block is free. A request's blocks are
freed tail first, so its prefix outlives its tail. Taking a free block whose hash is
cached evicts it and queues `BlockRemoved`.

Two requests computing the same prefix at once each fill a block with the same hash.
The first to commit caches its block; the second is handed that cached block in place
of its own (same tokens, so the same KV), and its own goes back to the free list. So a
request's block ids can change at `commit`: the engine reads `block_ids()` afresh for
every forward pass. This keeps every full computed block of a running request cached,
hence the parent of every `BlockStored` is cached when the event is emitted and a
subscriber replaying the events never meets an unknown parent.

NOTE: invariants (`tests/unit/worker/test_block_pool.py` checks them after random steps):
- `block.block_hash is not None` iff the prefix cache maps that hash to that block;
  every full, committed block a request holds is cached.
- a block is on the free list iff its `ref_cnt` is 0; free + in use == `num_blocks`.
- replaying the queued events in order onto an empty set (stored adds, removed
  deletes, cleared empties) gives exactly `cached_block_hashes()`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from indexer.hashing import BlockHash, hash_blocks, namespace_root

MEDIUM = "GPU"


class NoFreeBlocks(RuntimeError):
    """Not enough free blocks for an allocation; the pool was left unchanged."""

    def __init__(self, num_needed: int, num_free: int) -> None:
        super().__init__(f"need {num_needed} free KV blocks, only {num_free} free")
        self.num_needed = num_needed
        self.num_free = num_free


class UnknownRequest(KeyError):
    """A request id that holds no blocks in this pool."""


@dataclass(slots=True, eq=False)
class KVBlock:
    """One KV block: its id, how many requests hold it, its hash while cached."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """The free blocks in eviction order, linked through the blocks themselves.

    Two sentinel blocks (id -1) bound the list so no operation needs a branch for
    an empty list or an end.
    """

    __slots__ = ("_head", "_tail", "_num_blocks")

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._num_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._num_blocks

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "pop from an empty free list"
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        prev = self._tail.prev_free
        assert prev is not None
        self._insert_after(prev, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._num_blocks -= 1

    def _insert_after(self, prev: KVBlock, block: KVBlock) -> None:
        nxt = prev.next_free
        assert nxt is not None and block.prev_free is None, f"block {block.block_id} is free"
        block.prev_free = prev
        block.next_free = nxt
        prev.next_free = block
        nxt.prev_free = block
        self._num_blocks += 1


@dataclass(slots=True, eq=False)
class _Request:
    """A request's tokens, its blocks (one per `block_size` tokens, partial last) and
    how far its KV is computed and its blocks are hashed."""

    token_ids: list[int]
    blocks: list[KVBlock]
    block_hashes: list[BlockHash]  # chained hashes of leading full blocks, computed lazily
    num_computed_tokens: int
    # Leading full computed blocks already cached, or found duplicate and left uncached.
    num_hashed_blocks: int


class BlockPool:
    """Paged KV blocks with prefix caching and LRU eviction (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model: str = "",
        lora_name: str | None = None,
        enable_caching: bool = True,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.lora_name = lora_name
        self.enable_caching = enable_caching
        # Read-only for callers: exposed for inspection (tests, debug endpoints).
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._root = namespace_root(model, lora_name)
        self._free = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._requests: dict[str, _Request] = {}
        self._events: list[KVEvent] = []

    # -- queries ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached or not."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the blocks held by requests (free cached blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a prompt of `num_tokens` tokens fits, even with no prefix hit."""
        return self.num_blocks_for(num_tokens) <= len(self._free)

    def can_append(self, request_id: str, num_new_tokens: int) -> bool:
        request = self._get(request_id)
        return self._num_blocks_to_append(request, num_new_tokens) <= len(self._free)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._get(request_id).blocks]

    def num_tokens(self, request_id: str) -> int:
        return len(self._get(request_id).token_ids)

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed_tokens

    def cached_block_hashes(self) -> set[BlockHash]:
        """Every hash in the prefix cache, held by a request or free but not evicted."""
        return set(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free blocks in the order they will be reused (O(num_free_blocks))."""
        return [block.block_id for block in self._free]

    def take_events(self) -> list[KVEvent]:
        """Hands over the queued events, oldest first, and empties the queue."""
        events, self._events = self._events, []
        return events

    # -- request lifecycle -----------------------------------------------------------

    def allocate(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Reserves blocks for a new request's prompt; returns its cached token count."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if len(token_ids) == 0:
            raise ValueError("a request needs at least one token")
        tokens = list(token_ids)
        block_hashes: list[BlockHash] = []
        if self.enable_caching:
            block_hashes = hash_blocks(tokens, self.block_size, self._root)
        hit_blocks = self._find_cached_prefix(block_hashes, (len(tokens) - 1) // self.block_size)
        num_new_blocks = self.num_blocks_for(len(tokens)) - len(hit_blocks)
        # A hit on a free cached block takes it off the free list too.
        num_free_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        self._check_free(num_new_blocks + num_free_hits)
        for block in hit_blocks:
            self._take_cached(block)
        blocks = hit_blocks + self._take_fresh(num_new_blocks)
        num_hit_tokens = len(hit_blocks) * self.block_size
        self._requests[request_id] = _Request(
            tokens, blocks, block_hashes, num_hit_tokens, len(hit_blocks)
        )
        return num_hit_tokens

    def append(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Grows a request's sequence by `token_ids`, reserving blocks as needed."""
        request = self._get(request_id)
        num_new_blocks = self._num_blocks_to_append(request, len(token_ids))
        self._check_free(num_new_blocks)
        request.token_ids.extend(token_ids)
        request.blocks.extend(self._take_fresh(num_new_blocks))

    def commit(self, request_id: str, num_computed_tokens: int) -> None:
        """Records that the request's first `num_computed_tokens` tokens have their KV,
        caching the blocks that became full and computed."""
        request = self._get(request_id)
        if not request.num_computed_tokens <= num_computed_tokens <= len(request.token_ids):
            raise ValueError(
                f"request {request_id!r}: cannot commit {num_computed_tokens} tokens "
                f"({request.num_computed_tokens} committed, {len(request.token_ids)} held)"
            )
        if self.enable_caching:
            self._cache_full_blocks(request, num_computed_tokens // self.block_size)
        request.num_computed_tokens = num_computed_tokens

    def free(self, request_id: str) -> None:
        """Releases a request's blocks, tail first; cached ones stay cached until evicted."""
        request = self._requests.pop(request_id, None)
        if request is None:
            raise UnknownRequest(request_id)
        for block in reversed(request.blocks):
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            if block.block_hash is None:
                self._free.appendleft(block)
            else:
                self._free.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; refused (False) while any block is held."""
        if len(self._free) < self.num_blocks:
            return False
        if not self.enable_caching:
            return True
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    # -- internals -------------------------------------------------------------------

    def _get(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise UnknownRequest(request_id)
        return request

    def _num_blocks_to_append(self, request: _Request, num_new_tokens: int) -> int:
        return self.num_blocks_for(len(request.token_ids) + num_new_tokens) - len(request.blocks)

    def _check_free(self, num_needed: int) -> None:
        if num_needed > len(self._free):
            raise NoFreeBlocks(num_needed, len(self._free))

    def _find_cached_prefix(self, block_hashes: list[BlockHash], max_blocks: int) -> list[KVBlock]:
        hit_blocks: list[KVBlock] = []
        for block_hash in block_hashes[:max_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        return hit_blocks

    def _take_cached(self, block: KVBlock) -> None:
        if block.ref_cnt == 0:
            self._free.remove(block)
        block.ref_cnt += 1

    def _take_fresh(self, num_blocks: int) -> list[KVBlock]:
        blocks = []
        for _ in range(num_blocks):
            block = self._free.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None and self._cached[block_hash] is block
        del self._cached[block_hash]
        block.block_hash = None
        self._events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM))

    def _cache_full_blocks(self, request: _Request, num_full_blocks: int) -> None:
        first = request.num_hashed_blocks
        if num_full_blocks <= first:
            return
        self._extend_hashes(request, num_full_blocks)
        run_start: int | None = None
        for index in range(first, num_full_blocks):
            if self._cache_or_share(request, index):
                run_start = index if run_start is None else run_start
            elif run_start is not None:
                self._emit_stored(request, run_start, index)
                run_start = None
        if run_start is not None:
            self._emit_stored(request, run_start, num_full_blocks)
        request.num_hashed_blocks = num_full_blocks

    def _extend_hashes(self, request: _Request, num_full_blocks: int) -> None:
        num_hashed = len(request.block_hashes)
        if num_hashed >= num_full_blocks:
            return
        parent = request.block_hashes[-1] if num_hashed else self._root
        tokens = request.token_ids[num_hashed * self.block_size : num_full_blocks * self.block_size]
        request.block_hashes.extend(hash_blocks(tokens, self.block_size, parent))

    def _cache_or_share(self, request: _Request, index: int) -> bool:
        """Caches the request's block `index`; True if it was newly cached. If another
        block already caches its hash, the request takes that block instead."""
        block, block_hash = request.blocks[index], request.block_hashes[index]
        assert block.block_hash is None and block.ref_cnt == 1
        cached = self._cached.get(block_hash)
        if cached is None:
            block.block_hash = block_hash
            self._cached[block_hash] = block
            return True
        self._take_cached(cached)
        request.blocks[index] = cached
        block.ref_cnt = 0
        self._free.appendleft(block)
        return False

    def _emit_stored(self, request: _Request, start: int, end: int) -> None:
        size = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=list(request.block_hashes[start:end]),
                parent_block_hash=request.block_hashes[start - 1] if start > 0 else None,
                token_ids=request.token_ids[start * size : end * size],
                block_size=size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=self.lora_name,
            )
        )
