"""The reference model's small building blocks: RMSNorm, rotary embedding, a SwiGLU MLP.

Owns the layers with no state beyond their weights (and RoPE's cos/sin table).
Used by `worker.models.attention`, `worker.models.moe` and
`worker.models.transformer`. Parameter names follow the Hugging Face Llama/Qwen
convention (`weight`, `gate_proj`, `up_proj`, `down_proj`), which is what
`worker.models.weights` loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, rotate-half (GPT-NeoX) layout, cos/sin cached per position."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # NOTE: a plain attribute, not a buffer: it stays float32 when the model is cast to
        # bf16, and is absent from weight files (it derives from the config).
        self._cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q [T, H, D] and k [T, Hkv, D] by their tokens' positions [T]."""
        if self._cos_sin.device != positions.device:
            self._cos_sin = self._cos_sin.to(positions.device)
        cos, sin = self._cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): one expert, or the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
