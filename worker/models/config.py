"""The reference model's shape: `ModelConfig`, validated at construction.

Owns the hyperparameters of `worker.models.transformer.MoETransformer` (a decoder-only
transformer with RoPE, RMSNorm, grouped-query attention and a mixture-of-experts FFN).
The defaults are a tiny model that runs a step in a few milliseconds on one CPU core,
with the byte tokenizer's vocabulary (`indexer.tokenizer.ByteTokenizer`, 260 ids).

Callers: `kvgate worker --engine torch` (flags -> config), the engine, tests, benches.
Invariants (checked in `__post_init__`, naming the bad field): every size is positive,
`num_heads` is a multiple of `num_kv_heads`, `top_k <= num_experts`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Sizes of the MoE transformer; the defaults are the tiny CPU model."""

    vocab_size: int = 260
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 64  # 0: no shared expert
    norm_topk_prob: bool = True  # renormalize the top-k router weights to sum to 1
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    seed: int = 0  # seeds the random weights when no weights file is given

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("norm_topk_prob", "seed"):
                continue
            if f.name == "shared_expert_intermediate_size":
                if value < 0:
                    raise ValueError(f"{f.name} must be >= 0, got {value}")
            elif value <= 0:
                raise ValueError(f"{f.name} must be positive, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads must be a multiple of num_kv_heads, got {self.num_heads} and {self.num_kv_heads}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be <= num_experts, got {self.num_experts_per_tok} > {self.num_experts}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
