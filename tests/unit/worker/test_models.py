"""worker.models: the paged forward equals a naive full-recompute forward; weight files.

The naive forward recomputes every token's attention from scratch with plain causal
attention (no cache), reusing the model's own projections, norms and MoE; the paged
forward computes the same tokens in chunks and decodes over scattered KV blocks, mixed
with another sequence in the same batch. Tolerance: float32, atol = rtol = 1e-4 on
the logits (the two differ only in summation order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.block_pool import BlockPool
from worker.model_runner import ModelRunner
from worker.models import ModelConfig, WeightsError, build_model, save_weights
from worker.scheduler import RequestState, Step

BS = 4
TOL = {"atol": 1e-4, "rtol": 1e-4}
CONFIG = ModelConfig(num_layers=2, seed=3)


def naive_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of every position, by full causal attention without a cache."""
    positions = torch.arange(len(token_ids))
    hidden = model.model.embed_tokens(torch.tensor(token_ids))
    for layer in model.model.layers:
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(hidden), positions)
        groups = attn.num_heads // attn.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        hidden = hidden + attn.o_proj(out.transpose(0, 1).reshape(len(token_ids), -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.compute_logits(model.model.norm(hidden))


def all_logits(runner: ModelRunner, step: Step, pool: BlockPool) -> torch.Tensor:
    """Logits of every token of a step (the engine only computes the sampled ones)."""
    inputs = runner.prepare(step, pool)
    hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
    return runner.model.compute_logits(hidden)


def request(request_id: str, tokens: list[int]) -> RequestState:
    return RequestState(request_id, list(tokens), len(tokens), 8, None, None)


@torch.inference_mode()
def test_paged_forward_equals_naive_forward_over_chunks_decodes_and_scattered_blocks():
    model = build_model(CONFIG)
    pool = BlockPool(32, BS, enable_caching=False)
    runner = ModelRunner(model, 32, BS)
    tokens_x = [(i * 37 + 11) % 256 for i in range(23)]
    tokens_y = [(i * 53 + 5) % 256 for i in range(9)]
    pool.allocate("filler", list(range(8)))  # blocks 0-1, freed below: x gets non-contiguous blocks
    pool.allocate("y", tokens_y)
    pool.free("filler")
    pool.allocate("x", tokens_x)
    assert pool.block_ids("x") == [0, 1, 5, 6, 7, 8]  # not contiguous
    x, y = request("x", tokens_x), request("y", tokens_y)

    # Step 1: x's first chunk (10 tokens) and all of y (9) in one batch.
    logits = all_logits(runner, Step([(x, 10), (y, 9)], [0, 0]), pool)
    torch.testing.assert_close(logits[:10], naive_logits(model, tokens_x)[:10], **TOL)
    torch.testing.assert_close(logits[10:], naive_logits(model, tokens_y), **TOL)
    pool.commit("x", 10)
    pool.commit("y", 9)
    # Step 2: the rest of x's prompt (13) next to one decode of y.
    y.token_ids.append(42)
    pool.append("y", [42])
    logits = all_logits(runner, Step([(x, 13), (y, 1)], [10, 9]), pool)
    torch.testing.assert_close(logits[:13], naive_logits(model, tokens_x)[10:], **TOL)
    torch.testing.assert_close(logits[13], naive_logits(model, y.token_ids)[-1], **TOL)
    pool.commit("x", 23)
    pool.commit("y", 10)
    # Steps 3-6: both decode together, x crossing block boundaries.
    for new_x, new_y in ((7, 8), (100, 9), (3, 250), (64, 1)):
        x.token_ids.append(new_x)
        y.token_ids.append(new_y)
        pool.append("x", [new_x])
        pool.append("y", [new_y])
        step = Step([(x, 1), (y, 1)], [len(x.token_ids) - 1, len(y.token_ids) - 1])
        logits = all_logits(runner, step, pool)
        torch.testing.assert_close(logits[0], naive_logits(model, x.token_ids)[-1], **TOL)
        torch.testing.assert_close(logits[1], naive_logits(model, y.token_ids)[-1], **TOL)
        pool.commit("x", len(x.token_ids))
        pool.commit("y", len(y.token_ids))


def test_moe_routes_each_token_to_top_k_experts_with_normalized_weights():
    model = build_model(CONFIG)
    moe = model.model.layers[0].mlp
    x = torch.randn(5, CONFIG.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, expert_ids = moe.route(x)
    assert weights.shape == expert_ids.shape == (5, CONFIG.num_experts_per_tok)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    # The grouped computation equals a per-token loop over the chosen experts.
    expected = torch.stack([
        sum(w * moe.experts[e](x[t : t + 1])[0] for w, e in zip(weights[t], expert_ids[t].tolist()))
        + moe.shared_expert(x[t : t + 1])[0]
        for t in range(5)
    ])
    torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-5)


def test_random_weights_are_seeded():
    a, b, c = build_model(CONFIG), build_model(CONFIG), build_model(ModelConfig(seed=4))
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_weights_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "model.safetensors"
    save_weights(build_model(CONFIG), path)
    loaded = build_model(ModelConfig(num_layers=2, seed=99), weights=path)
    expected = build_model(CONFIG)
    for (name, tensor), (_, other) in zip(loaded.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(tensor, other), name
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in loaded.state_dict()

    with pytest.raises(WeightsError, match="missing tensors: model.layers.2.input_layernorm.weight"):
        build_model(ModelConfig(num_layers=3), weights=path)
    with pytest.raises(WeightsError, match=r"model.embed_tokens.weight has shape \[260, 64\], the model needs \[260, 32\]"):
        build_model(ModelConfig(hidden_size=32), weights=path)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightsError, match="cannot read weights file"):
        build_model(CONFIG, weights=tmp_path / "bad.safetensors")


def test_config_names_the_bad_field():
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_experts_per_tok must be <= num_experts"):
        ModelConfig(num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match="hidden_size must be positive"):
        ModelConfig(hidden_size=0)
