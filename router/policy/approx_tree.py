"""Approximate per-worker prefix trees: what the router itself sent where, no events needed.

Owns the `cache_aware` policy's guess of each worker's cache. Every dispatched prompt's
chained block hashes are inserted into the chosen worker's tree; a lookup returns how
many leading blocks of a prompt were routed to that worker before.

A trie over block hashes, stored flat: a chained hash names its whole path from the
root, so a node needs no parent pointer or child map, and the tree is the set of its
nodes' hashes, kept in an `OrderedDict` in least-recently-routed order.

NOTE: invariant: the node set is prefix-closed (a node's parent is present whenever
the node is). Inserting a path touches it leaf first, so every node is at least as
recent as any of its descendants, and evicting the least recent node (when the tree is
over `max_blocks`) always removes a leaf. Prefix-closure makes `match` a binary search
over the prompt's hashes: O(log n) lookups per worker however long the prompt.

Pure and synchronous; owned by the policy (one router event loop). Memory is bounded by
`max_blocks` nodes per worker.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

WorkerKey = tuple[str, int]


class ApproxPrefixTree:
    """The block-hash paths routed to one worker, bounded, least recently routed evicted."""

    __slots__ = ("max_blocks", "_nodes", "num_evicted")

    def __init__(self, max_blocks: int) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self._nodes: OrderedDict[int, None] = OrderedDict()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._nodes

    def match(self, block_hashes: Sequence[int]) -> int:
        """How many leading hashes of `block_hashes` are in the tree."""
        nodes = self._nodes
        if not block_hashes or block_hashes[0] not in nodes:
            return 0
        low, high = 1, len(block_hashes)  # hashes[:low] present; the answer is <= high
        while low < high:
            middle = (low + high + 1) // 2
            if block_hashes[middle - 1] in nodes:
                low = middle
            else:
                high = middle - 1
        return low

    def insert(self, block_hashes: Sequence[int]) -> None:
        """Adds (or refreshes) the path `block_hashes`, evicting least recent leaves."""
        nodes = self._nodes
        move_to_end = nodes.move_to_end
        for block_hash in reversed(block_hashes):  # leaf first: see the NOTE above
            if block_hash in nodes:
                move_to_end(block_hash)
            else:
                nodes[block_hash] = None
        num_over = len(nodes) - self.max_blocks
        if num_over > 0:
            popitem = nodes.popitem
            for _ in range(num_over):
                popitem(last=False)
            self.num_evicted += num_over

    def resize(self, max_blocks: int) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        while len(self._nodes) > max_blocks:
            self._nodes.popitem(last=False)
            self.num_evicted += 1


class ApproxPrefixTrees:
    """One `ApproxPrefixTree` per worker key, created on first insert."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._trees: dict[WorkerKey, ApproxPrefixTree] = {}

    def get(self, worker: WorkerKey) -> ApproxPrefixTree | None:
        return self._trees.get(worker)

    def insert(self, worker: WorkerKey, block_hashes: Sequence[int]) -> None:
        tree = self._trees.get(worker)
        if tree is None:
            tree = self._trees[worker] = ApproxPrefixTree(self.max_blocks)
        tree.insert(block_hashes)

    def resize(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        for tree in self._trees.values():
            tree.resize(max_blocks)

    def remove_worker(self, worker_id: str) -> None:
        for key in [key for key in self._trees if key[0] == worker_id]:
            del self._trees[key]

    def num_blocks(self) -> dict[WorkerKey, int]:
        return {key: len(tree) for key, tree in self._trees.items()}
