"""Grouped-query attention over the paged KV cache, in pure torch.

Owns `AttentionMetadata` (where a batch's tokens sit in the paged cache: slot mapping,
block tables, context lengths), `paged_attention` (write this step's K/V into the
cache, then attend over each sequence's cached context) and the `Attention` layer.
The model runner (`worker/model_runner.py`) builds the metadata once per step; every
layer of `worker.models.transformer.MoETransformer` reads it.

The cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads,
head_dim]` (K and V); token slot `s` is block `s // block_size`, offset `s %
block_size`. A batch is a flat run of tokens, sequence after sequence; a sequence's
`num_tokens` new tokens are the last of its `context_len` tokens, so query `i` sits at
position `context_len - num_tokens + i` and sees keys at positions `<= ` its own.

Correctness over speed: single-token sequences (decodes) are attended together in one
padded batch, gathered through their block tables; longer ones (prefill chunks) one by
one. NOTE: K/V are written to the cache before attention reads it, so a sequence's
own new tokens are attended through the cache like the cached ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.models.config import ModelConfig
from worker.models.layers import RotaryEmbedding


@dataclass(slots=True)
class PrefillSeq:
    """A sequence computing more than one token this step."""

    start: int  # index of its first token in the batch
    num_tokens: int
    context_len: int  # cached tokens + num_tokens
    block_ids: torch.Tensor  # [num_blocks_of_seq] long, on the model's device


@dataclass(slots=True)
class AttentionMetadata:
    """Where one step's tokens sit in the paged cache (built by the model runner)."""

    slot_mapping: torch.Tensor  # [num_tokens] long: cache slot of each new token
    block_size: int
    decode_token_indices: torch.Tensor | None = None  # [num_decodes] long: batch index of each decode
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] long, padded with 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] long
    prefills: tuple[PrefillSeq, ...] = ()


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Stores this step's keys and values [T, Hkv, D] at their cache slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each sequence's cached context; returns [T, H, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.decode_token_indices is not None:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        q_dec = q.index_select(0, meta.decode_token_indices)
        out.index_copy_(0, meta.decode_token_indices, _decode(q_dec, k_cache, v_cache, meta))
    for seq in meta.prefills:
        end = seq.start + seq.num_tokens
        out[seq.start : end] = _prefill(q[seq.start : end], k_cache, v_cache, seq)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One query per sequence [B, H, D] over its context, all sequences in one padded batch."""
    assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
    tables = meta.decode_block_tables
    num_seqs, max_len = tables.shape[0], tables.shape[1] * meta.block_size
    keys = k_cache[tables].reshape(num_seqs, max_len, *k_cache.shape[2:])
    values = v_cache[tables].reshape(num_seqs, max_len, *v_cache.shape[2:])
    positions = torch.arange(max_len, device=q.device)
    mask = (positions.unsqueeze(0) < meta.decode_context_lens.unsqueeze(1))[:, None, None, :]
    out = _sdpa(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), mask)
    return out.squeeze(2)


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq) -> torch.Tensor:
    """A chunk's queries [n, H, D] over the sequence's first `context_len` cached tokens."""
    keys = k_cache[seq.block_ids].flatten(0, 1)[: seq.context_len]
    values = v_cache[seq.block_ids].flatten(0, 1)[: seq.context_len]
    offset = seq.context_len - seq.num_tokens
    query_pos = torch.arange(offset, seq.context_len, device=q.device)
    key_pos = torch.arange(seq.context_len, device=q.device)
    mask = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
    out = _sdpa(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), mask)
    return out.transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention [..., H, Lq, D] with Hkv K/V heads shared by H / Hkv queries."""
    num_groups = q.shape[-3] // k.shape[-3]
    if num_groups > 1:
        k = k.repeat_interleave(num_groups, dim=-3)
        v = v.repeat_interleave(num_groups, dim=-3)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)


class Attention(nn.Module):
    """QKV projections, RoPE, paged GQA attention, output projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, dim = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, config.num_heads * dim, bias=False)
        self.k_proj = nn.Linear(hidden, config.num_kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, config.num_kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * dim, hidden, bias=False)
        self.rotary = RotaryEmbedding(dim, config.max_position_embeddings, config.rope_theta)

    def project(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> rotated q [T, H, D], rotated k and v [T, Hkv, D]."""
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project(hidden, positions)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(hidden.shape[0], -1))
