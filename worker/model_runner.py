"""The model runner: one scheduler step -> the model's forward over the paged KV cache.

Owns the KV cache tensors (per layer, K and V of shape `[num_blocks, block_size,
num_kv_heads, head_dim]`, so block `b` of the `worker.block_pool.BlockPool` is
index `b` of every layer's cache) and `ModelRunner`, which turns a
`worker.scheduler.Step` into the model's inputs (flat token ids, positions, slot
mapping, block tables, context lengths: `worker.models.AttentionMetadata`), runs the
model and returns the logits of the tokens to sample.

`sub_batch` cuts a prepared batch into a token range plus padding tokens, for Dual
Batch Overlap's micro-batches and DP dummy steps (`worker.dp_engine`).

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
            hidden = self.forward(inputs)
            return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The model over one prepared batch: final hidden states [T, hidden]. The DP
        runner (`worker.dp_engine`) overrides it to micro-batch or pad the batch."""
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

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


def sub_batch(inputs: ModelInputs, start: int, stop: int, num_pad: int = 0, pad_block: int = 0) -> ModelInputs:
    """Tokens [start, stop) of a prepared batch as a batch of their own, then `num_pad`
    padding tokens, each a decode over slot 0 of block `pad_block` alone.

    A prefill cut by the range keeps its part inside it: that part's context ends at
    its last token. NOTE: the part after `start` attends over cached K/V of the part
    before, so a caller running the pieces separately must run every layer of the
    earlier piece before the same layer of the later one (DBO's micro-batch order).
    `sample_rows` is empty: the caller samples from the whole batch's hidden states.
    """
    meta, device = inputs.meta, inputs.input_ids.device
    num_real = stop - start
    prefills = []
    for seq in meta.prefills:
        seq_end = seq.start + seq.num_tokens
        lo, hi = max(seq.start, start), min(seq_end, stop)
        if lo < hi:
            prefills.append(PrefillSeq(lo - start, hi - lo, seq.context_len - (seq_end - hi), seq.block_ids))
    pad = torch.zeros(num_pad, dtype=torch.long, device=device)
    sub = AttentionMetadata(
        torch.cat([meta.slot_mapping[start:stop], pad + pad_block * meta.block_size]),
        meta.block_size, prefills=tuple(prefills),
    )
    indices, tables, lengths = _decodes_in(meta, start, stop)
    if num_pad:
        width = tables.shape[1] if tables is not None else 1
        pad_tables = torch.zeros((num_pad, width), dtype=torch.long, device=device)
        pad_tables[:, 0] = pad_block
        pad_indices = torch.arange(num_real, num_real + num_pad, device=device)
        indices = pad_indices if indices is None else torch.cat([indices, pad_indices])
        tables = pad_tables if tables is None else torch.cat([tables, pad_tables])
        lengths = pad + 1 if lengths is None else torch.cat([lengths, pad + 1])
    sub.decode_token_indices, sub.decode_block_tables, sub.decode_context_lens = indices, tables, lengths
    return ModelInputs(
        torch.cat([inputs.input_ids[start:stop], pad]), torch.cat([inputs.positions[start:stop], pad]),
        sub, pad[:0],
    )


def _decodes_in(
    meta: AttentionMetadata, start: int, stop: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(batch index - start, block table, context length) of the decodes in [start, stop)."""
    indices = meta.decode_token_indices
    if indices is None:
        return None, None, None
    assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
    keep = (indices >= start) & (indices < stop)
    if not bool(keep.any()):
        return None, None, None
    return indices[keep] - start, meta.decode_block_tables[keep], meta.decode_context_lens[keep]
