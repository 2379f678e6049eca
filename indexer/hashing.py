"""Chained block hashes of token ids: the one hash the router and the workers share.

A prompt's token ids are cut into full blocks of `block_size` tokens (a partial last
block is never hashed). Block i gets `h_i = xxh3_64(le_u32(tokens_i), seed=h_{i-1})`,
so one 64-bit hash names a whole prefix. The chain starts at a namespace root derived
from the model name and LoRA name, so two models never share an entry even for equal
token ids.

NOTE: the encoding (little-endian uint32 token ids, xxh3-64 seeded by the parent) is
part of the wire contract between router and workers: changing it invalidates every
index. It does not depend on the Python version, the platform or PYTHONHASHSEED.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", int)
"""A chained 64-bit block hash as computed by this module (unsigned)."""

_MAX_TOKEN_ID = 0xFFFF_FFFF
_xxh3 = xxhash.xxh3_64_intdigest

# 'I' is 4 bytes on every platform CPython supports; fall back to 'L' just in case.
_U32 = "I" if array("I").itemsize == 4 else "L"
_NEEDS_SWAP = sys.byteorder != "little"


def namespace_root(model: str = "", lora_name: str | None = None) -> BlockHash:
    """The parent hash of a chain's first block for one model (and LoRA adapter)."""
    key = model.encode() + b"\x00" + (lora_name or "").encode()
    return BlockHash(_xxh3(key))


TokenIds = Sequence[int] | array
"""Token ids: a list (or any sequence) of ints, or an `array` of uint32 (no copy needed)."""


def token_array(token_ids: TokenIds) -> array:
    """Token ids as an `array` of uint32, the form the router keeps a prompt in."""
    if isinstance(token_ids, array) and token_ids.typecode == _U32:
        return token_ids
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        # array() would take these as raw machine values, not as one id per byte.
        token_ids = list(token_ids)
    try:
        return array(_U32, token_ids)
    except OverflowError:
        raise ValueError(f"token ids must be in [0, {_MAX_TOKEN_ID}]") from None


def token_bytes(token_ids: TokenIds) -> bytes:
    """Token ids as little-endian uint32 bytes, the input of every block hash."""
    packed = token_array(token_ids)
    if _NEEDS_SWAP:
        packed = array(_U32, packed)  # a copy: never swap the caller's array in place
        packed.byteswap()
    return packed.tobytes()


def hash_block(parent: int, token_ids: TokenIds) -> BlockHash:
    """The hash of one block given its parent's hash (or the namespace root)."""
    return BlockHash(_xxh3(token_bytes(token_ids), parent))


def hash_blocks(
    token_ids: TokenIds,
    block_size: int,
    parent: int,
    num_blocks: int | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids`, the first chained to `parent`.

    `num_blocks` caps how many blocks are hashed (default: every full block).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n = len(token_ids) // block_size
    if num_blocks is not None:
        n = min(n, num_blocks)
    if n == 0:
        return []
    view = memoryview(token_bytes(token_ids))
    step = block_size * 4
    hashes: list[BlockHash] = []
    append = hashes.append
    h = parent
    for off in range(0, n * step, step):
        h = _xxh3(view[off : off + step], h)
        append(h)
    return hashes


def hash_prompt(
    token_ids: TokenIds,
    block_size: int,
    model: str = "",
    lora_name: str | None = None,
) -> list[BlockHash]:
    """Chained hashes of a prompt's full blocks, rooted at its model's namespace."""
    return hash_blocks(token_ids, block_size, namespace_root(model, lora_name))
