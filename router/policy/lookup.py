"""The lookup step: hash the prompt once per block size and fill every candidate's match.

Runs once per request, before `Policy.rank`, so no scorer ever touches the index (the
llm-d split: the prefix scorer only reads `Candidate.matched_blocks`).

Consumes: `RouteRequest.token_ids` and `model`, each candidate's `block_size` and key,
the `PrefixIndex`. Produces: `RouteRequest.hashes_by_block_size` (one chained-hash list
per distinct candidate block size, rooted at the request's model namespace, as the
workers hash) and `Candidate.matched_blocks` (leading full blocks the index says that
worker holds; 0 for a worker whose block size is not the index's: the index cannot
know its blocks).

Cost: one `hash_prompt` per distinct block size (hashes already present in the request
are reused) and one `find_matches` for the index's block size.
"""

from __future__ import annotations

from indexer.hashing import hash_prompt
from indexer.index import PrefixIndex
from router.policy.base import Candidate, RouteRequest


def request_hashes(request: RouteRequest, block_size: int) -> list[int]:
    """The request's chained block hashes at `block_size`, computed once and kept."""
    hashes = request.hashes_by_block_size.get(block_size)
    if hashes is None:
        hashes = hash_prompt(request.token_ids, block_size, request.model)
        request.hashes_by_block_size[block_size] = hashes
    return hashes


def fill_matches(index: PrefixIndex, request: RouteRequest, candidates: list[Candidate]) -> None:
    """Sets `matched_blocks` on every candidate (see the module docstring)."""
    block_sizes = {candidate.block_size for candidate in candidates}
    for block_size in block_sizes:
        request_hashes(request, block_size)
    matches: dict[tuple[str, int], int] = {}
    if index.block_size in block_sizes:
        matches = index.find_matches(request.hashes_by_block_size[index.block_size])
    index_block_size = index.block_size
    for candidate in candidates:
        if candidate.block_size == index_block_size:
            candidate.matched_blocks = matches.get((candidate.worker_id, candidate.dp_rank), 0)
        else:
            candidate.matched_blocks = 0
