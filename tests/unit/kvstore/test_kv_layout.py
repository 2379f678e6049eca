"""Layout arithmetic of `kvstore.kv_layout`: head and layer ranges, slice plans, expected senders."""

from __future__ import annotations

import pytest

from kvstore.kv_layout import KVLayout, LayoutError, expected_senders, layer_range, plan_slice


def _layout(tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1, **overrides) -> KVLayout:
    fields = dict(num_layers=4, num_kv_heads=8, head_dim=4, block_size=2, dtype="float32", num_blocks=6)
    fields.update(overrides)
    return KVLayout(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, **fields).validate()


def test_ranges_split_heads_and_layers_contiguously() -> None:
    assert [_layout(r, 4).heads for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [_layout(pp_rank=s, pp_size=2).layers for s in range(2)] == [range(0, 2), range(2, 4)]
    assert [layer_range(5, s, 2) for s in range(2)] == [range(0, 2), range(2, 5)]
    assert _layout(1, 2).block_shape() == (6, 2, 4, 4)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("tp_size", dict(tp_size=3)),
        ("tp_rank", dict(tp_rank=2, tp_size=2)),
        ("pp_size", dict(pp_size=5)),
        ("block_size", dict(block_size=0)),
    ],
)
def test_validate_names_the_bad_field(field: str, kwargs: dict) -> None:
    with pytest.raises(LayoutError, match=field):
        _layout(**kwargs)


def test_prefill_tp1_to_decode_tp2_sends_each_rank_its_half() -> None:
    src = _layout()
    plans = [plan_slice(src, _layout(r, 2)) for r in range(2)]
    assert [(p.src_heads, p.dst_heads) for p in plans] == [(range(0, 4), range(0, 4)), (range(4, 8), range(0, 4))]
    assert all(p.src_layers == p.dst_layers == range(0, 4) for p in plans)


def test_prefill_tp4_to_decode_tp2_fills_from_two_ranks() -> None:
    dst = _layout(1, 2)
    plans = [plan_slice(_layout(r, 4), dst) for r in range(4)]
    assert plans[0] is None and plans[1] is None
    assert (plans[2].src_heads, plans[2].dst_heads) == (range(0, 2), range(0, 2))
    assert (plans[3].src_heads, plans[3].dst_heads) == (range(0, 2), range(2, 4))
    assert expected_senders(dst, src_tp_size=4, src_pp_size=1) == {(0, 2), (0, 3)}


def test_pp_two_stages_to_one_maps_layers_by_global_index() -> None:
    dst = _layout()
    plans = [plan_slice(_layout(pp_rank=s, pp_size=2), dst) for s in range(2)]
    assert [(p.src_layers, p.dst_layers) for p in plans] == [(range(0, 2), range(0, 2)), (range(0, 2), range(2, 4))]
    assert expected_senders(dst, src_tp_size=1, src_pp_size=2) == {(0, 0), (1, 0)}


def test_pp_and_tp_change_together() -> None:
    dst = _layout(1, 2, pp_rank=1, pp_size=2)
    plan = plan_slice(_layout(0, 1, pp_rank=0, pp_size=1), dst)
    assert (plan.src_layers, plan.dst_layers, plan.src_heads, plan.dst_heads) == (
        range(2, 4), range(0, 2), range(4, 8), range(0, 4))
    assert plan_slice(_layout(pp_rank=0, pp_size=2), dst) is None


def test_different_models_are_refused() -> None:
    with pytest.raises(LayoutError, match="head_dim"):
        plan_slice(_layout(), _layout(head_dim=8))
    with pytest.raises(LayoutError, match="dtype"):
        plan_slice(_layout(), _layout(dtype="bfloat16"))
    with pytest.raises(LayoutError, match="tp_size 3"):
        expected_senders(_layout(), src_tp_size=3, src_pp_size=1)
