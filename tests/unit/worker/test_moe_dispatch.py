"""Dispatch planning and the single-process path of ExpertParallelMoE.

Multi-rank behaviour (gloo, 2 and 4 processes) is in
tests/integration/test_expert_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from worker.models.config import ModelConfig
from worker.models.moe import MoE
from worker.moe import (
    CompletedHandle,
    ExpertDispatcher,
    ExpertParallelMoE,
    ExpertPlacement,
    SingleProcessBackend,
    plan_dispatch,
)

CONFIG = ModelConfig(hidden_size=32, num_experts=5, moe_intermediate_size=24, shared_expert_intermediate_size=16)


def _moe(config: ModelConfig = CONFIG, dtype: torch.dtype = torch.float32) -> MoE:
    torch.manual_seed(0)
    return MoE(config).to(dtype)


def test_plan_sends_each_token_once_per_rank_grouped_by_rank() -> None:
    table = ExpertPlacement(num_experts=4, ep_size=2).rank_table()
    expert_ids = torch.tensor([[0, 1], [2, 0], [3, 2]])
    token_index, dest_rank, send_counts = plan_dispatch(expert_ids, table, ep_size=2)
    assert token_index.tolist() == [0, 1, 1, 2]
    assert dest_rank.tolist() == [0, 0, 1, 1]
    assert send_counts == [2, 2]


def test_plan_with_a_rank_receiving_nothing() -> None:
    table = ExpertPlacement(num_experts=6, ep_size=3).rank_table()
    token_index, dest_rank, send_counts = plan_dispatch(torch.tensor([[5, 4], [4, 0]]), table, ep_size=3)
    assert token_index.tolist() == [1, 0, 1]
    assert dest_rank.tolist() == [0, 2, 2]
    assert send_counts == [1, 0, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_process_equals_moe_exactly(dtype: torch.dtype) -> None:
    moe = _moe(dtype=dtype)
    layer = ExpertParallelMoE.from_moe(CONFIG, moe, SingleProcessBackend())
    x = torch.randn(11, CONFIG.hidden_size).to(dtype)
    with torch.no_grad():
        assert torch.equal(layer(x), moe(x))


def test_single_process_without_shared_expert_and_empty_batch() -> None:
    config = ModelConfig(hidden_size=32, num_experts=4, shared_expert_intermediate_size=0)
    moe = _moe(config)
    layer = ExpertParallelMoE.from_moe(config, moe, SingleProcessBackend())
    with torch.no_grad():
        x = torch.randn(6, 32)
        assert torch.equal(layer(x), moe(x))
        assert layer(x[:0]).shape == (0, 32)


def test_staged_calls_return_completed_handles() -> None:
    layer = ExpertParallelMoE.from_moe(CONFIG, _moe(), SingleProcessBackend())
    x = torch.randn(4, CONFIG.hidden_size)
    with torch.no_grad():
        pending = layer.start_dispatch(x)
        assert pending.is_completed()
        tokens = pending.wait()
        assert tokens.plan.send_counts == [4] and tokens.plan.recv_counts == [4]
        combine = layer.start_combine(layer.run_experts(tokens), tokens.plan)
        assert combine.is_completed()
        assert combine.wait().shape == (4, CONFIG.hidden_size)


def test_layer_holds_only_local_experts_with_moe_parameter_names() -> None:
    layer = ExpertParallelMoE(CONFIG, SingleProcessBackend())
    assert set(layer.state_dict()) == set(_moe().state_dict())


def test_dispatcher_rejects_placement_for_another_group_size() -> None:
    with pytest.raises(ValueError, match="ep_size"):
        ExpertDispatcher(SingleProcessBackend(), ExpertPlacement(num_experts=4, ep_size=2))


def test_single_process_backend_checks_counts() -> None:
    backend = SingleProcessBackend()
    rows = torch.ones(3, 2)
    assert backend.exchange_counts([3]) == [3]
    handle = backend.all_to_all(rows, [3], [3])
    assert isinstance(handle, CompletedHandle) and handle.wait() is rows
    with pytest.raises(ValueError, match="split"):
        backend.all_to_all(rows, [2], [2])
    with pytest.raises(ValueError, match="1 entry"):
        backend.exchange_counts([1, 2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_single_process_on_cuda_equals_moe() -> None:
    moe = _moe().cuda()
    layer = ExpertParallelMoE.from_moe(CONFIG, moe, SingleProcessBackend()).cuda()
    x = torch.randn(9, CONFIG.hidden_size, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(layer(x), moe(x), atol=1e-5, rtol=0)
