"""The reference model: a decoder-only MoE transformer over a paged KV cache.

Owns `MoETransformer` (embedding, `num_layers` pre-norm decoder layers of GQA
attention and MoE FFN, final RMSNorm, LM head), its seeded random initialisation and
`build_model`, which makes one on a device and dtype with random or loaded weights.

The model runner (`worker/model_runner.py`) calls `forward` once per engine step
with the batch's flat token ids, their positions, one `(K, V)` cache pair per layer
and the step's `AttentionMetadata`, then `compute_logits` on the hidden states of
the tokens to sample. `replace_moe` swaps the MoE layers for expert-parallel shards
(`worker.dp_engine`). Parameter names (`state_dict()`) are the tensor names of
weight files; `worker/models/weights.py` documents them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from worker.models.attention import Attention, AttentionMetadata
from worker.models.config import ModelConfig
from worker.models.layers import RMSNorm
from worker.models.moe import MoE
from worker.models.weights import load_weights

KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then h + moe(norm(h))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config)

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MoETransformer(nn.Module):
    """Token ids -> hidden states over the paged cache -> logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]; writes the tokens' K/V."""
        hidden = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(hidden, positions, kv_cache, meta)
        return self.model.norm(hidden)

    def replace_moe(self, make_layer: Callable[[int, MoE], nn.Module]) -> None:
        """Swaps every decoder layer's `MoE` for `make_layer(layer index, that MoE)`.

        The hook expert parallelism uses (`worker.dp_engine`): the replacement must take
        and return [T, hidden] like `MoE`; the old layer is dropped once replaced.
        """
        for index, layer in enumerate(self.model.layers):
            if not isinstance(layer.mlp, MoE):
                raise TypeError(f"layer {index}'s feed-forward is already a {type(layer.mlp).__name__}")
            layer.mlp = make_layer(index, layer.mlp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab_size]."""
        return self.lm_head(hidden).float()

    def init_random(self, seed: int) -> None:
        """Seeded weights, the same on every device: normal(0, 1/sqrt(fan_in)) matrices, unit norms."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                    continue
                fan_in = param.shape[-1] if not name.endswith("embed_tokens.weight") else 1
                values = torch.randn(param.shape, generator=generator) / fan_in**0.5
                param.copy_(values)


def build_model(
    config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    weights: Path | str | None = None,
) -> MoETransformer:
    """A model in eval mode on `device` in `dtype`: random weights seeded by `config.seed`,
    or the tensors of the safetensors file `weights` (see `worker.models.weights`)."""
    model = MoETransformer(config)
    if weights is None:
        model.init_random(config.seed)
    else:
        load_weights(model, weights)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
