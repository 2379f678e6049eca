"""The prefix index: every worker's prefix cache, block for block, mirrored from KV events.

Owns the answer to "which workers hold the longest prefix of these block hashes". The
router's lookup step calls `find_matches` once per request; the event subscriber calls
`apply` for each decoded batch and `clear` when it loses events it cannot replay; the
worker registry calls `set_model` and `remove_worker`. Pure and synchronous: one owner
mutates it, with no I/O and no locks.

Layout (flat, no tree):
- `_masks`: own block hash -> int bitmask of the worker slots holding that block. Each
  `WorkerKey` gets a slot (freed slots are reused, lowest first).
- per worker, `blocks`: engine key -> own hash. An engine's hashes (u64, i64 or bytes,
  any function and seed) are only keys; own hashes are recomputed from each event's
  `token_ids` with `hashing.hash_blocks`, so they equal `hash_prompt` of the same tokens.

Duplicates are reference counted, and cost nothing until they happen: a worker that
stores one engine hash twice (vLLM caches two physical blocks with equal content and
evicts each with its own BlockRemoved) or two engine hashes with the same content keeps
the block until the last of them is removed.

NOTE: invariants, for every worker w with slot bit b:
- `_masks[h] & b` is set exactly when h is a value of w's `blocks`; no mask is 0;
- `extra_stores[k]` counts stores of engine key k beyond the first (absent when 0);
- `extra_keys[h]` counts w's engine keys mapping to h beyond the first (absent when 0).
Nothing empty lingers, and a dict that shrank below a quarter of its high-water mark is
rebuilt (CPython dicts never shrink on deletion), so memory follows what is indexed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from heapq import heappop, heappush
from typing import NewType

import msgspec
import xxhash

from indexer.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, ExternalBlockHash
from indexer.hashing import BlockHash, hash_blocks, namespace_root

WorkerKey = tuple[str, int]
"""A worker as the index knows it: `(worker_id, dp_rank)`."""

EngineKey = NewType("EngineKey", int)
"""An engine's block hash as the index keys it: ints as sent, bytes hashed to 64 bits."""

GPU_MEDIUM = "GPU"
_INT_BYTES = 36  # a 64-bit int object; most hashes need all 64 bits
_NUM_CACHED_MASK_SLOTS = 8  # masks below 256 are CPython's shared small ints
_xxh3 = xxhash.xxh3_64_intdigest


class IndexStats(msgspec.Struct, frozen=True, gc=False):
    """A snapshot of the index's size and event counters."""

    num_blocks: int  # distinct own hashes
    num_entries: int  # (block, worker) pairs
    num_workers: int
    num_bytes: int  # estimated from container sizes
    num_events: int
    num_stored_blocks: int
    num_removed_blocks: int
    num_unknown_parent: int  # stores dropped: parent not held by that worker
    num_unknown_removed: int  # removals of engine hashes the worker does not hold
    num_malformed: int  # stores dropped: wrong block_size, token count or token id
    num_ignored_medium: int  # events about other tiers than the GPU's


def engine_key(block_hash: ExternalBlockHash) -> EngineKey:
    """An engine's block hash as the key the index keeps it under."""
    if block_hash.__class__ is int:
        return block_hash  # type: ignore[return-value]
    return EngineKey(_xxh3(block_hash))  # type: ignore[arg-type]


def _engine_keys(block_hashes: list[ExternalBlockHash]) -> list[EngineKey]:
    # An engine sends one hash type throughout: the first hash decides for the list.
    if not block_hashes or block_hashes[0].__class__ is int:
        return block_hashes  # type: ignore[return-value]
    return [engine_key(h) for h in block_hashes]


class _WorkerState:
    __slots__ = ("key", "bit", "model", "blocks", "extra_stores", "extra_keys", "num_extra_keys", "peak")

    def __init__(self, key: WorkerKey, slot: int, model: str) -> None:
        self.key = key
        self.bit = 1 << slot
        self.model = model
        self.reset()

    def reset(self) -> None:
        self.blocks: dict[EngineKey, BlockHash] = {}
        self.extra_stores: dict[EngineKey, int] = {}
        self.extra_keys: dict[BlockHash, int] = {}
        self.num_extra_keys = 0
        self.peak = 0  # len(blocks) high-water mark since the last rebuild

    @property
    def slot(self) -> int:
        return self.bit.bit_length() - 1

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) - self.num_extra_keys


class PrefixIndex:
    """Which workers hold which prefixes, kept in step with their KV events."""

    def __init__(self, block_size: int, default_model: str = "") -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.default_model = default_model
        self._masks: dict[BlockHash, int] = {}
        self._masks_peak = 0
        self._workers: dict[WorkerKey, _WorkerState] = {}
        self._slot_workers: list[WorkerKey | None] = []
        self._free_slots: list[int] = []
        self._models: dict[str, str] = {}
        self._roots: dict[tuple[str, str | None], BlockHash] = {}
        self._num_events = 0
        self._num_stored_blocks = 0
        self._num_removed_blocks = 0
        self._num_unknown_parent = 0
        self._num_unknown_removed = 0
        self._num_malformed = 0
        self._num_ignored_medium = 0

    # ------------------------------------------------------------------ workers

    def set_model(self, worker_id: str, model: str) -> None:
        """Roots `worker_id`'s future chains (every dp rank) in `model`'s namespace.

        Blocks already indexed keep the namespace they were stored under.
        """
        self._models[worker_id] = model
        for state in self._workers.values():
            if state.key[0] == worker_id:
                state.model = model

    def workers(self) -> list[WorkerKey]:
        return list(self._workers)

    def remove_worker(self, worker: WorkerKey) -> bool:
        """Forgets a worker and its blocks; False if it was not known."""
        state = self._workers.pop(worker, None)
        if state is None:
            return False
        # NOTE: _drop_all clears the slot's bit everywhere, so a newcomer may reuse it.
        self._drop_all(state)
        self._slot_workers[state.slot] = None
        heappush(self._free_slots, state.slot)
        return True

    def clear(self, worker: WorkerKey) -> None:
        """Drops every block of a worker but keeps knowing it."""
        state = self._workers.get(worker)
        if state is not None:
            self._drop_all(state)

    def num_blocks(self, worker: WorkerKey) -> int:
        """Distinct blocks (own hashes) a worker holds; 0 for an unknown one."""
        state = self._workers.get(worker)
        return 0 if state is None else state.num_blocks

    def worker_block_hashes(self, worker: WorkerKey) -> set[BlockHash]:
        """The own hashes of the blocks a worker holds; empty for an unknown one."""
        state = self._workers.get(worker)
        return set() if state is None else set(state.blocks.values())

    def _state(self, worker: WorkerKey) -> _WorkerState:
        state = self._workers.get(worker)
        if state is not None:
            return state
        if self._free_slots:
            slot = heappop(self._free_slots)
            self._slot_workers[slot] = worker
        else:
            slot = len(self._slot_workers)
            self._slot_workers.append(worker)
        model = self._models.get(worker[0], self.default_model)
        state = self._workers[worker] = _WorkerState(worker, slot, model)
        return state

    # ------------------------------------------------------------------ events

    def apply(self, worker: WorkerKey, batch: EventBatch) -> None:
        """Applies a batch's events in order; bad events are counted and skipped.

        `worker` names the dp rank: the batch's `data_parallel_rank` is not consulted.
        """
        state = self._state(worker)
        events = batch.events
        self._num_events += len(events)
        for event in events:
            # isinstance, not type(): the array encoding decodes to private subclasses.
            if isinstance(event, BlockStored):
                self._store(state, event)
            elif isinstance(event, BlockRemoved):
                self._remove(state, event)
            elif isinstance(event, AllBlocksCleared):
                self._drop_all(state)

    def apply_stored(self, worker: WorkerKey, event: BlockStored) -> None:
        self._num_events += 1
        self._store(self._state(worker), event)

    def apply_removed(self, worker: WorkerKey, event: BlockRemoved) -> None:
        self._num_events += 1
        self._remove(self._state(worker), event)

    def _store(self, state: _WorkerState, event: BlockStored) -> None:
        if event.medium is not None and event.medium != GPU_MEDIUM:
            self._num_ignored_medium += 1
            return
        block_size = self.block_size
        keys = event.block_hashes
        if event.block_size != block_size or len(event.token_ids) != len(keys) * block_size:
            self._num_malformed += 1
            return
        parent = event.parent_block_hash
        if parent is None:
            parent_hash = self._root(state.model, event.lora_name, event.lora_id)
        else:
            found = state.blocks.get(engine_key(parent))
            if found is None:
                self._num_unknown_parent += 1
                return
            parent_hash = found
        try:
            own = hash_blocks(event.token_ids, block_size, parent_hash)
        except ValueError:  # a token id outside uint32
            self._num_malformed += 1
            return
        self._add(state, _engine_keys(keys), own)

    def _root(self, model: str, lora_name: str | None, lora_id: int | None) -> BlockHash:
        if lora_name is None and lora_id is not None:
            # Engines that name adapters by id only: kept apart from the base model.
            lora_name = f"#lora_id={lora_id}"
        root = self._roots.get((model, lora_name))
        if root is None:
            root = self._roots[(model, lora_name)] = namespace_root(model, lora_name)
        return root

    def _add(self, state: _WorkerState, keys: list[EngineKey], own: list[BlockHash]) -> None:
        blocks = state.blocks
        masks = self._masks
        get = masks.get
        bit = state.bit
        for key, block_hash in zip(keys, own):
            # `own` holds fresh int objects: identity tells a new key from a known one.
            if blocks.setdefault(key, block_hash) is not block_hash:
                self._store_known(state, key, block_hash)
                continue
            mask = get(block_hash, 0)
            if mask & bit:
                self._add_extra_key(state, block_hash)
            else:
                masks[block_hash] = mask | bit
        self._num_stored_blocks += len(own)
        if len(blocks) > state.peak:
            state.peak = len(blocks)
        if len(masks) > self._masks_peak:
            self._masks_peak = len(masks)

    def _store_known(self, state: _WorkerState, key: EngineKey, block_hash: BlockHash) -> None:
        if state.blocks[key] == block_hash:
            state.extra_stores[key] = state.extra_stores.get(key, 0) + 1
            return
        # The engine reused a hash for other content: its old block is gone.
        state.extra_stores.pop(key, None)
        self._release(state, state.blocks[key])
        state.blocks[key] = block_hash
        mask = self._masks.get(block_hash, 0)
        if mask & state.bit:
            self._add_extra_key(state, block_hash)
        else:
            self._masks[block_hash] = mask | state.bit

    @staticmethod
    def _add_extra_key(state: _WorkerState, block_hash: BlockHash) -> None:
        state.extra_keys[block_hash] = state.extra_keys.get(block_hash, 0) + 1
        state.num_extra_keys += 1

    def _remove(self, state: _WorkerState, event: BlockRemoved) -> None:
        if event.medium is not None and event.medium != GPU_MEDIUM:
            self._num_ignored_medium += 1
            return
        pop = state.blocks.pop
        extra_stores = state.extra_stores
        num_unknown = 0
        for key in _engine_keys(event.block_hashes):
            if extra_stores and key in extra_stores:
                if extra_stores[key] == 1:
                    del extra_stores[key]
                else:
                    extra_stores[key] -= 1
                continue
            block_hash = pop(key, None)
            if block_hash is None:
                num_unknown += 1
            else:
                self._release(state, block_hash)
        self._num_unknown_removed += num_unknown
        self._num_removed_blocks += len(event.block_hashes) - num_unknown
        self._may_compact_worker(state)
        self._may_compact_masks()

    def _release(self, state: _WorkerState, block_hash: BlockHash) -> None:
        """One engine key of `state` no longer maps to `block_hash`."""
        extra_keys = state.extra_keys
        if extra_keys and block_hash in extra_keys:
            state.num_extra_keys -= 1
            if extra_keys[block_hash] == 1:
                del extra_keys[block_hash]
            else:
                extra_keys[block_hash] -= 1
            return
        mask = self._masks[block_hash] & ~state.bit
        if mask:
            self._masks[block_hash] = mask
        else:
            del self._masks[block_hash]

    def _drop_all(self, state: _WorkerState) -> None:
        masks = self._masks
        keep = ~state.bit
        for block_hash in set(state.blocks.values()):
            mask = masks[block_hash] & keep
            if mask:
                masks[block_hash] = mask
            else:
                del masks[block_hash]
        state.reset()
        self._may_compact_masks()

    # NOTE: rebuilding below a quarter of the high-water mark keeps removal amortised O(1).

    @staticmethod
    def _may_compact_worker(state: _WorkerState) -> None:
        if len(state.blocks) * 4 < state.peak:
            state.blocks = dict(state.blocks) if state.blocks else {}
            state.extra_stores = dict(state.extra_stores) if state.extra_stores else {}
            state.extra_keys = dict(state.extra_keys) if state.extra_keys else {}
            state.peak = len(state.blocks)

    def _may_compact_masks(self) -> None:
        if len(self._masks) * 4 < self._masks_peak:
            self._masks = dict(self._masks) if self._masks else {}
            self._masks_peak = len(self._masks)

    # ------------------------------------------------------------------ lookup

    def find_matches(self, block_hashes: Sequence[int]) -> dict[WorkerKey, int]:
        """For each worker holding block 0, how many leading blocks it holds.

        A worker missing block i stops at i even if it holds later blocks; workers
        matching no block are absent.
        """
        if not block_hashes:
            return {}
        get = self._masks.get
        mask = get(block_hashes[0], 0)
        if not mask:
            return {}
        matches: dict[WorkerKey, int] = {}
        # Per-worker work happens only where the set of matching workers shrinks.
        index = 0
        for block_hash in block_hashes:
            narrowed = get(block_hash, 0) & mask
            if narrowed != mask:
                self._record(matches, mask ^ narrowed, index)
                mask = narrowed
                if not mask:
                    return matches
            index += 1
        self._record(matches, mask, index)
        return matches

    def _record(self, matches: dict[WorkerKey, int], bits: int, num_matched: int) -> None:
        slot_workers = self._slot_workers
        while bits:
            low = bits & -bits
            matches[slot_workers[low.bit_length() - 1]] = num_matched  # type: ignore[index]
            bits ^= low

    # ------------------------------------------------------------------ stats

    def stats(self) -> IndexStats:
        num_blocks = len(self._masks)
        return IndexStats(
            num_blocks=num_blocks,
            num_entries=sum(state.num_blocks for state in self._workers.values()),
            num_workers=len(self._workers),
            num_bytes=self._estimate_bytes(num_blocks),
            num_events=self._num_events,
            num_stored_blocks=self._num_stored_blocks,
            num_removed_blocks=self._num_removed_blocks,
            num_unknown_parent=self._num_unknown_parent,
            num_unknown_removed=self._num_unknown_removed,
            num_malformed=self._num_malformed,
            num_ignored_medium=self._num_ignored_medium,
        )

    def _estimate_bytes(self, num_blocks: int) -> int:
        """Container sizes plus the int objects they hold: O(workers), no walk."""
        num_keys = 0
        num_bytes = sys.getsizeof(self._masks)
        for state in self._workers.values():
            num_keys += len(state.blocks)
            num_bytes += sys.getsizeof(state.blocks)
            num_bytes += sys.getsizeof(state.extra_stores) + sys.getsizeof(state.extra_keys)
        # Per engine key: the key and its own-hash value; the first holder's value is
        # also the masks key, so that object is counted once.
        num_bytes += 2 * num_keys * _INT_BYTES
        if len(self._slot_workers) > _NUM_CACHED_MASK_SLOTS:
            num_bytes += num_blocks * _INT_BYTES
        return num_bytes
