"""Packing per-row tensors into one byte tensor (`worker.moe.payload`)."""

from __future__ import annotations

import pytest
import torch

from worker.moe.payload import RowLayout, pack_rows, unpack_rows


def _fields(num_rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(num_rows)
    hidden = torch.randn(num_rows, 33, generator=gen).to(dtype)
    expert_ids = torch.randint(-1, 7, (num_rows, 3), generator=gen)
    weights = torch.rand(num_rows, 3, generator=gen)
    return hidden, expert_ids, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("num_rows", [0, 1, 5])
def test_round_trip_is_bit_exact_and_returns_views(dtype: torch.dtype, num_rows: int) -> None:
    fields = _fields(num_rows, dtype)
    layout = RowLayout.of(fields)
    packed = pack_rows(fields, layout)
    assert packed.dtype == torch.uint8 and packed.shape == (num_rows, layout.row_bytes)
    out = unpack_rows(packed, layout)
    for got, want in zip(out, fields, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    if num_rows:
        # Views into the received buffer, at each field's offset.
        offsets = [t.data_ptr() - packed.data_ptr() for t in out]
        assert offsets == [f.offset for f in layout.fields]


def test_layout_aligns_every_field_and_the_row() -> None:
    layout = RowLayout.of(_fields(2, torch.bfloat16))
    # 33 bf16 = 66 bytes; int64 ids start at 72; float32 weights at 96; row 112 (8 | 112).
    assert [(f.offset, f.num_bytes) for f in layout.fields] == [(0, 66), (72, 24), (96, 12)]
    assert layout.row_bytes == 112


def test_bad_input_is_refused() -> None:
    hidden, expert_ids, weights = _fields(4, torch.float32)
    layout = RowLayout.of((hidden, expert_ids, weights))
    with pytest.raises(ValueError, match="differ in rows"):
        pack_rows((hidden, expert_ids[:3], weights), layout)
    with pytest.raises(ValueError, match=f"uint8 \\[M, {layout.row_bytes}\\]"):
        unpack_rows(torch.zeros(4, layout.row_bytes, dtype=torch.int16), layout)
