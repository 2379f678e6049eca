"""KV cache layout of one rank and the slice plan between a prefill and a decode rank.

Owns `KVLayout` (what part of the model's KV cache one rank holds: its layers under
pipeline parallelism, its KV heads under tensor parallelism, block size, dtype) and the
pure arithmetic of layout conversion (seed 003, Dynamo xPyD):

- TP: KV heads are split in contiguous equal ranges, rank `r` of `tp_size` holds heads
  `[r * n / tp_size, (r + 1) * n / tp_size)`. A decode rank receives exactly the
  intersection of its head range with each prefill rank's, so one prefill rank may feed
  several decode ranks (P TP < D TP) and one decode rank may be fed by several prefill
  ranks (P TP > D TP).
- PP: layers are split in contiguous ranges, stage `s` of `pp_size` holds layers
  `[s * L // pp_size, (s + 1) * L // pp_size)`; layers are matched by global index.

Invariants: `num_kv_heads % tp_size == 0` (no head replication); every stage holds at
least one layer. Nothing here does I/O or imports torch. Called by `kvstore.transfer`
(senders plan their writes, receivers know whom to wait for) and by workers that
describe their own cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

# NOTE: fields that must be equal on both sides for a transfer to make sense.
_MODEL_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")


class LayoutError(ValueError):
    """A layout is invalid, or two layouts describe different models."""


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The KV cache one rank holds. Wire type: new fields only at the end.

    `num_layers` and `num_kv_heads` are the whole model's; `num_blocks` is this rank's
    cache capacity. `dtype` is torch's name without the prefix (`"bfloat16"`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    num_blocks: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def validate(self) -> KVLayout:
        """Return self, or raise `LayoutError` naming the bad field."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "tp_size", "pp_size"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise LayoutError(f"pp_rank {self.pp_rank} is outside pp_size {self.pp_size}")
        if self.num_kv_heads % self.tp_size:
            raise LayoutError(f"num_kv_heads {self.num_kv_heads} is not divisible by tp_size {self.tp_size}")
        if self.pp_size > self.num_layers:
            raise LayoutError(f"pp_size {self.pp_size} exceeds num_layers {self.num_layers}")
        return self

    @property
    def layers(self) -> range:
        """Global indices of the layers this rank holds."""
        return layer_range(self.num_layers, self.pp_rank, self.pp_size)

    @property
    def heads(self) -> range:
        """Global indices of the KV heads this rank holds."""
        return head_range(self.num_kv_heads, self.tp_rank, self.tp_size)

    @property
    def num_local_heads(self) -> int:
        return self.num_kv_heads // self.tp_size

    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) tensor: `[num_blocks, block_size, heads, head_dim]`."""
        return (self.num_blocks, self.block_size, self.num_local_heads, self.head_dim)


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> range:
    return range(pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size)


def head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> range:
    per_rank = num_kv_heads // tp_size
    return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)


@dataclass(frozen=True, slots=True)
class SlicePlan:
    """What one sender rank writes to one receiver rank, in each side's local indices.

    Layer `src_layers[i]` of the sender goes to layer `dst_layers[i]` of the receiver;
    within it, sender heads `src_heads` land on receiver heads `dst_heads` (same length).
    """

    src_layers: range
    dst_layers: range
    src_heads: range
    dst_heads: range

    @property
    def num_heads(self) -> int:
        return len(self.src_heads)


def check_same_model(src: KVLayout, dst: KVLayout) -> None:
    """Raise `LayoutError` when the two layouts cannot describe the same model's cache."""
    for name in _MODEL_FIELDS:
        if getattr(src, name) != getattr(dst, name):
            raise LayoutError(f"{name} differs: sender {getattr(src, name)!r}, receiver {getattr(dst, name)!r}")


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def plan_slice(src: KVLayout, dst: KVLayout) -> SlicePlan | None:
    """The slice `src` must write into `dst`, or None when they share no layer or head."""
    check_same_model(src, dst)
    layers = _overlap(src.layers, dst.layers)
    heads = _overlap(src.heads, dst.heads)
    if not layers or not heads:
        return None
    return SlicePlan(
        src_layers=range(layers.start - src.layers.start, layers.stop - src.layers.start),
        dst_layers=range(layers.start - dst.layers.start, layers.stop - dst.layers.start),
        src_heads=range(heads.start - src.heads.start, heads.stop - src.heads.start),
        dst_heads=range(heads.start - dst.heads.start, heads.stop - dst.heads.start),
    )


def expected_senders(dst: KVLayout, src_tp_size: int, src_pp_size: int) -> frozenset[tuple[int, int]]:
    """The `(pp_rank, tp_rank)` prefill ranks whose slices together fill `dst` entirely."""
    if dst.num_kv_heads % src_tp_size or src_pp_size > dst.num_layers:
        raise LayoutError(f"sender tp_size {src_tp_size} / pp_size {src_pp_size} cannot split this model")
    ranks = set()
    for pp_rank in range(src_pp_size):
        if not _overlap(layer_range(dst.num_layers, pp_rank, src_pp_size), dst.layers):
            continue
        for tp_rank in range(src_tp_size):
            if _overlap(head_range(dst.num_kv_heads, tp_rank, src_tp_size), dst.heads):
                ranks.add((pp_rank, tp_rank))
    return frozenset(ranks)
