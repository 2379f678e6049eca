"""The model runner: one scheduler step -> the model's forward over the paged KV cache.

Owns the KV cache tensors (per layer, K and V of shape `[num_blocks, block_size,
num_kv_heads, head_dim]`, so block `b` of the `worker.block_pool.BlockPool` is
index `b` of every layer's cache) and `ModelRunner`, which turns a
`worker.scheduler.Step` into the model's inputs (flat token ids, positions, slot
mapping, block tables, context lengths: `worker.models.AttentionMetadata`), runs the
model and returns the logits of the tokens to sample.

Called by `worker/engine_core.py` between `Scheduler.schedule` and
`Scheduler.finish_step`, from the engine's one thread.
NOTE: block ids are read from the pool for every step, after `schedule` and before
`commit`: the pool may hand a request a different (identical) block at `commit`.
Invariant: the sampled rows come in `Step.sampling_indices()` order, which is what
`finish_step` expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.block_pool import BlockPool
from worker.models import AttentionMetadata, KVCache, MoETransformer, PrefillSeq
from worker.scheduler import Step


@dataclass(slots=True)
class ModelInputs:
    """One step's batch, on the model's device."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] long: batch index of each token whose logits are needed


class ModelRunner:
    """Owns the paged KV cache and runs the model over one step's batch."""

    def __init__(self, model: MoETransformer, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        config = model.config
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        with torch.inference_mode():
            self.kv_caches: list[KVCache] = [
                (torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(config.num_layers)
            ]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def execute(self, step: Step, pool: BlockPool) -> torch.Tensor:
        """Runs `step`; returns float32 logits [num_sampled, vocab] in sampling order."""
        with torch.inference_mode():
            inputs = self.prepare(step, pool)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))

    def prepare(self, step: Step, pool: BlockPool) -> ModelInputs:
        """The step's tokens, positions, cache slots and per-sequence attention layout."""
        size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decodes: list[tuple[int, list[int], int]] = []  # (batch index, block ids, context length)
        prefills: list[PrefillSeq] = []
        sample_rows: list[int] = []
        for (request, num_tokens), start in zip(step.scheduled, step.num_computed_tokens, strict=True):
            end = start + num_tokens
            block_ids = pool.block_ids(request.request_id)[: -(-end // size)]
            offset = len(input_ids)
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(block_ids[p // size] * size + p % size for p in range(start, end))
            if num_tokens == 1:
                decodes.append((offset, block_ids, end))
            else:
                prefills.append(PrefillSeq(offset, num_tokens, end, self._long(block_ids)))
            if end == len(request.token_ids):
                sample_rows.append(offset + num_tokens - 1)
        meta = AttentionMetadata(self._long(slots), size, prefills=tuple(prefills))
        if decodes:
            max_blocks = max(len(block_ids) for _, block_ids, _ in decodes)
            tables = [block_ids + [0] * (max_blocks - len(block_ids)) for _, block_ids, _ in decodes]
            meta.decode_token_indices = self._long([index for index, _, _ in decodes])
            meta.decode_block_tables = self._long(tables)
            meta.decode_context_lens = self._long([length for _, _, length in decodes])
        return ModelInputs(self._long(input_ids), self._long(positions), meta, self._long(sample_rows))

    def _long(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
