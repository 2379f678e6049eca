"""Dual Batch Overlap across real processes: 2 EP ranks joined in a gloo group.

One launch of two rank processes (this file, torchrun's environment) checks, on every
rank: the DP-wide split agreement (`agree_split`) for vetoes, padding and the
prefill threshold; that DBO output equals the plain EP output (float32, atol 1e-5)
for uneven batches, a padded batch and an empty micro-batch, with the all-to-alls
issued by the micro-batch threads and through a `CommStreamBackend`; and a soak of
2000 steps whose per-rank token counts differ (zero included), alternating the two,
every step agreeing on the split and matching the single-rank MoE. Each rank prints
one JSON line the test asserts on.
"""

from __future__ import annotations

import json

import torch

from worker.moe.launch import launch_local_ranks

ATOL = 1e-5
WORLD_SIZE = 2
NUM_SOAK_STEPS = 2000


def _launch() -> list[dict]:
    results = launch_local_ranks([__file__], WORLD_SIZE, timeout_s=90)
    for result in results:
        assert result.returncode == 0, result.stderr
    return [json.loads(result.last_line()) for result in results]


def test_dbo_across_two_gloo_ranks() -> None:
    results = _launch()
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["agree"] == {
            "one_rank_too_small": None,
            "both_decode": [40, 20],
            "prefill_and_decode": [600, 300],
            "prefill_below_threshold": None,
            "disabled": None,
        }, r
        for name in ("uneven", "padded", "empty_ubatch"):
            assert r["max_err"][name] <= ATOL, (name, r)
            assert r["max_err_stream"][name] <= ATOL, (name, r)
        assert r["soak"]["max_err"] <= ATOL, r
        assert r["soak"]["num_steps"] == NUM_SOAK_STEPS
        # Steps where both ranks had >= 2 tokens split, the rest ran plainly.
        assert r["soak"]["num_split"] == r["soak"]["num_expected_split"] > 0
        assert r["soak"]["num_plain"] == NUM_SOAK_STEPS - r["soak"]["num_split"] > 0
    assert results[0]["soak"]["num_split"] == results[1]["soak"]["num_split"]


# ---- rank process -------------------------------------------------------------------


def _soak_tokens(step: int, rank: int) -> int:
    """Uneven load: the ranks' counts differ on most steps and are sometimes 0."""
    return (step * 7 + rank * 3) % 5


def _agreement_cases(rank: int) -> dict:
    from worker.moe.dbo import DboConfig, agree_split

    on = DboConfig(enable_dbo=True)
    cases = {
        "one_rank_too_small": (on, (40, 10)[rank], False),
        "both_decode": (on, (40, 33)[rank], False),
        "prefill_and_decode": (on, (600, 40)[rank], rank == 0),
        "prefill_below_threshold": (on, (100, 40)[rank], rank == 0),
        "disabled": (DboConfig(), (40, 40)[rank], False),
    }
    out = {}
    for name, (config, num_tokens, has_prefill) in cases.items():
        split = agree_split(num_tokens, has_prefill, config)
        out[name] = None if split is None else [split.num_tokens_padded, split.split_at]
    return out


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return (got - want).abs().max().item() if got.numel() else 0.0


def _equality_cases(layers, rank: int) -> dict:
    from worker.moe.dbo import UBatchSplit, dbo_forward

    def model(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = x + layer(x)
        return x

    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn((37, 29)[rank], 32, generator=gen)
    errs = {"uneven": _max_err(dbo_forward(model, x, UBatchSplit(37, 18)), model(x))}
    # Rank 1's second micro-batch is padding only.
    x = torch.randn((40, 12)[rank], 32, generator=gen)
    errs["padded"] = _max_err(dbo_forward(model, x, UBatchSplit(40, 20)), model(x))
    # Rank 0's first micro-batch is empty: its collectives still pair with rank 1's.
    x = torch.randn(8, 32, generator=gen)
    errs["empty_ubatch"] = _max_err(dbo_forward(model, x, UBatchSplit(8, (0, 4)[rank])), model(x))
    return errs


def _soak(layers, moe, rank: int) -> dict:
    from worker.moe.dbo import DboConfig, maybe_dbo_forward

    config = DboConfig(enable_dbo=True, dbo_decode_token_threshold=2)
    gen = torch.Generator().manual_seed(20 + rank)
    num_split = num_expected = 0
    max_err = 0.0
    for step in range(NUM_SOAK_STEPS):
        x = torch.randn(_soak_tokens(step, rank), 32, generator=gen)
        # Even steps: collectives issued by the micro-batch threads; odd: by the stream.
        out, split = maybe_dbo_forward(layers[step % 2], x, has_prefill=False, config=config)
        num_split += split
        num_expected += min(_soak_tokens(step, r) for r in range(WORLD_SIZE)) >= 2
        max_err = max(max_err, _max_err(out, moe(x)))
    return {
        "num_steps": NUM_SOAK_STEPS,
        "num_split": num_split,
        "num_plain": NUM_SOAK_STEPS - num_split,
        "num_expected_split": num_expected,
        "max_err": max_err,
    }


def _rank_main() -> None:
    from worker.models.config import ModelConfig
    from worker.models.moe import MoE
    from worker.moe import ExpertParallelMoE
    from worker.moe.a2a_stream import CommStreamBackend
    from worker.moe.a2a_torch import init_process_group_from_env

    torch.set_num_threads(1)
    backend = init_process_group_from_env("gloo")
    stream = CommStreamBackend(backend)
    config = ModelConfig(hidden_size=32, num_experts=6, moe_intermediate_size=24, shared_expert_intermediate_size=16)
    result: dict = {"rank": backend.rank, "agree": _agreement_cases(backend.rank)}
    with torch.no_grad():
        torch.manual_seed(0)
        moes = [MoE(config) for _ in range(2)]
        layers = [ExpertParallelMoE.from_moe(config, moe, backend) for moe in moes]
        stream_layers = [ExpertParallelMoE.from_moe(config, moe, stream) for moe in moes]
        result["max_err"] = _equality_cases(layers, backend.rank)
        result["max_err_stream"] = _equality_cases(stream_layers, backend.rank)
        result["soak"] = _soak([layers[0], stream_layers[0]], moes[0], backend.rank)
    stream.close()
    torch.distributed.destroy_process_group()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _rank_main()
