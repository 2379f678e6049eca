"""Packing several per-row tensors into one byte tensor, so they travel as one transfer.

Owns `RowLayout` (where each field sits inside a packed row) and `pack_rows` /
`unpack_rows`. A dispatch sends, per token row, its hidden state, its top-k expert ids
and its router weights; sent as three all-to-alls they pay three latencies and three
turns on the link, packed they pay one.

Each field is stored as its raw bytes at an offset that is a multiple of its element
size, and the row length is a multiple of the largest element size, so `unpack_rows`
returns views into the received buffer (no copy): strided on dim 0, contiguous
within a row.

Invariants: `unpack_rows(pack_rows(ts, layout), layout)` equals `ts` bit for bit;
fields have at least one dimension (dim 0 is the row) and a fixed trailing shape.
Callers: `worker.moe.dispatch`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One field of a packed row: dtype, trailing shape, byte offset inside the row."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Byte layout of one packed row."""

    fields: tuple[FieldSpec, ...]
    row_bytes: int

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> RowLayout:
        """The layout packing `tensors` (same dim 0) in the given order."""
        fields = []
        offset = 0
        for t in tensors:
            size = t.dtype.itemsize
            offset = -(-offset // size) * size
            fields.append(FieldSpec(t.dtype, tuple(t.shape[1:]), offset))
            offset += fields[-1].num_bytes
        # NOTE: a row length that every element size divides keeps every field of
        # every row aligned, which is what lets unpack_rows return views.
        align = max((t.dtype.itemsize for t in tensors), default=1)
        return cls(tuple(fields), -(-offset // align) * align)


def pack_rows(tensors: Sequence[torch.Tensor], layout: RowLayout) -> torch.Tensor:
    """uint8 [M, layout.row_bytes]: row m holds row m of every tensor, as raw bytes."""
    num_rows = tensors[0].shape[0] if tensors else 0
    if any(t.shape[0] != num_rows for t in tensors):
        raise ValueError(f"tensors to pack differ in rows: {[t.shape[0] for t in tensors]}")
    device = tensors[0].device if tensors else None
    parts = []
    end = 0
    for t, field in zip(tensors, layout.fields, strict=True):
        if field.offset > end:
            parts.append(torch.zeros((num_rows, field.offset - end), dtype=torch.uint8, device=device))
        parts.append(t.reshape(num_rows, math.prod(field.shape)).contiguous().view(torch.uint8))
        end = field.offset + field.num_bytes
    if layout.row_bytes > end:
        parts.append(torch.zeros((num_rows, layout.row_bytes - end), dtype=torch.uint8, device=device))
    return torch.cat(parts, dim=1)


def unpack_rows(packed: torch.Tensor, layout: RowLayout) -> tuple[torch.Tensor, ...]:
    """The fields of uint8 packed [M, layout.row_bytes], as views with their own dtypes."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != layout.row_bytes:
        raise ValueError(f"expected uint8 [M, {layout.row_bytes}], got {packed.dtype} {list(packed.shape)}")
    packed = packed.contiguous()
    num_rows = packed.shape[0]
    return tuple(
        packed[:, f.offset : f.offset + f.num_bytes].view(f.dtype).view(num_rows, *f.shape) for f in layout.fields
    )
