"""ExpertPlacement: contiguous near-even expert blocks, exact ids per rank."""

from __future__ import annotations

import pytest
import torch

from worker.moe.placement import ExpertPlacement


def test_even_split() -> None:
    p = ExpertPlacement(num_experts=8, ep_size=4)
    assert [list(p.local_experts(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_uneven_split_gives_first_ranks_one_more() -> None:
    p = ExpertPlacement(num_experts=6, ep_size=4)
    assert [list(p.local_experts(r)) for r in range(4)] == [[0, 1], [2, 3], [4], [5]]
    assert [p.num_local_experts(r) for r in range(4)] == [2, 2, 1, 1]
    assert [p.rank_of(e) for e in range(6)] == [0, 0, 1, 1, 2, 3]
    assert p.rank_table().tolist() == [0, 0, 1, 1, 2, 3]
    assert p.rank_table().dtype == torch.int64


def test_single_rank_holds_everything() -> None:
    p = ExpertPlacement(num_experts=5, ep_size=1)
    assert p.local_experts(0) == range(0, 5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"num_experts": 4, "ep_size": 0}, "ep_size"), ({"num_experts": 3, "ep_size": 4}, "num_experts")],
)
def test_invalid_placement_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ExpertPlacement(**kwargs)


def test_out_of_range_lookups_raise() -> None:
    p = ExpertPlacement(num_experts=4, ep_size=2)
    with pytest.raises(ValueError, match="rank"):
        p.local_experts(2)
    with pytest.raises(ValueError, match="expert_id"):
        p.rank_of(4)
