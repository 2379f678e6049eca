"""Expert parallelism across real processes: EP output equals the single-rank MoE.

Each test launches `world_size` copies of this file as rank processes (torchrun's
environment: RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT), joined in a gloo
group. Every rank builds the same full `MoE` from one seed, keeps its shard in an
`ExpertParallelMoE`, and checks its scenarios against the full layer on its own
tokens (random routing, two dispatches in flight at once, skewed routing, and the
same through a `CommStreamBackend`); it prints one JSON line that the test asserts on.

Tolerance: float32, atol 1e-5 (the EP path sums the same products in a different
order). Ranks hold different numbers of tokens, one holds none.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from worker.moe.launch import launch_local_ranks

ATOL = 1e-5
TOKENS_PER_RANK = (5, 0, 3, 9)


def _launch(world_size: int, num_experts: int) -> list[dict]:
    results = launch_local_ranks([__file__, str(num_experts)], world_size, timeout_s=60)
    for result in results:
        assert result.returncode == 0, result.stderr
    return [json.loads(result.last_line()) for result in results]


@pytest.mark.parametrize(("world_size", "num_experts"), [(2, 7), (4, 6)])
def test_ep_matches_single_rank(world_size: int, num_experts: int) -> None:
    results = _launch(world_size, num_experts)
    assert [r["rank"] for r in results] == list(range(world_size))
    for r in results:
        assert r["max_err_random"] <= ATOL, r
        assert r["max_err_skewed"] <= ATOL, r
        assert r["max_err_overlap"] <= ATOL, r
        assert r["max_err_stream"] <= ATOL, r
        assert r["a2a_handle"] == "TorchWorkHandle"
        assert r["a2a_exact"] is True
    # Skewed routing: every token's top-k experts live on rank 0, so only it receives.
    num_sent = sum(TOKENS_PER_RANK[:world_size])
    assert [r["num_recv_skewed"] for r in results] == [num_sent] + [0] * (world_size - 1)


# ---- rank process -------------------------------------------------------------------


def _tokens(rank: int, hidden_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(TOKENS_PER_RANK[rank], hidden_size, generator=gen)


def _uneven_all_to_all(backend) -> tuple[str, bool]:
    """Rank s sends (s + d) % 3 rows to rank d, valued 100 s + 10 d + i; check every row."""
    world, rank = backend.world_size, backend.rank
    send_counts = [(rank + d) % 3 for d in range(world)]
    rows = [[100.0 * rank + 10 * d + i] for d in range(world) for i in range(send_counts[d])]
    recv_counts = backend.exchange_counts(send_counts)
    handle = backend.all_to_all(torch.tensor(rows).reshape(-1, 1), send_counts, recv_counts)
    got = handle.wait()
    want = [[100.0 * s + 10 * rank + i] for s in range(world) for i in range((s + rank) % 3)]
    return type(handle).__name__, recv_counts == [(s + rank) % 3 for s in range(world)] and got.tolist() == want


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return (got - want).abs().max().item() if got.numel() else 0.0


def _skew_to_rank0(moe, placement, x: torch.Tensor) -> torch.Tensor:
    """Make every token prefer rank 0's experts; returns the matching tokens."""
    with torch.no_grad():
        moe.gate.weight[:, 0] = -5.0
        moe.gate.weight[list(placement.local_experts(0)), 0] = 5.0
    x = x.clone()
    x[:, 0] = 10.0
    return x


def _overlapped(layer, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Two micro-batches with both dispatches in flight at once, as DBO will run them."""
    pending = [layer.start_dispatch(x) for x in xs]
    received = []
    combines = []
    for p in pending:
        tokens = p.wait()
        received.append(tokens)
        combines.append(layer.start_combine(layer.run_experts(tokens), tokens.plan))
    outs = []
    for x, c in zip(xs, combines):
        outs.append(c.wait() + layer.shared_expert(x).float())
    return outs


def _rank_main(num_experts: int) -> None:
    from worker.models.config import ModelConfig
    from worker.models.moe import MoE
    from worker.moe import ExpertParallelMoE, ExpertPlacement
    from worker.moe.a2a_stream import CommStreamBackend
    from worker.moe.a2a_torch import init_process_group_from_env

    torch.set_num_threads(1)
    backend = init_process_group_from_env("gloo")
    rank = backend.rank
    config = ModelConfig(
        hidden_size=32, num_experts=num_experts, moe_intermediate_size=24, shared_expert_intermediate_size=16
    )
    placement = ExpertPlacement(num_experts, backend.world_size)
    torch.manual_seed(0)
    moe = MoE(config)
    result: dict = {"rank": rank}
    result["a2a_handle"], result["a2a_exact"] = _uneven_all_to_all(backend)
    with torch.no_grad():
        layer = ExpertParallelMoE.from_moe(config, moe, backend, placement)
        x = _tokens(rank, config.hidden_size, seed=1)
        result["max_err_random"] = _max_err(layer(x), moe(x))

        xs = [_tokens(rank, config.hidden_size, seed=2), _tokens(rank, config.hidden_size, seed=3)]
        outs = _overlapped(layer, xs)
        result["max_err_overlap"] = max(_max_err(o, moe(x)) for o, x in zip(outs, xs))

        stream = CommStreamBackend(backend)
        stream_layer = ExpertParallelMoE.from_moe(config, moe, stream, placement)
        outs = [stream_layer(xs[0]), *_overlapped(stream_layer, xs)]
        result["max_err_stream"] = max(_max_err(o, moe(x)) for o, x in zip(outs, [xs[0], *xs]))
        stream.close()

        x = _skew_to_rank0(moe, placement, _tokens(rank, config.hidden_size, seed=4))
        layer = ExpertParallelMoE.from_moe(config, moe, backend, placement)
        tokens = layer.start_dispatch(x).wait()
        result["num_recv_skewed"] = tokens.hidden.shape[0]
        out = layer.start_combine(layer.run_experts(tokens), tokens.plan).wait() + layer.shared_expert(x)
        result["max_err_skewed"] = _max_err(out, moe(x))
    torch.distributed.destroy_process_group()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]))
