"""Model weights in safetensors files: loading (strict, named errors) and saving.

Owns `load_weights`, `save_weights` and `WeightsError`. `kvgate worker --engine torch
--weights PATH` loads through `worker.models.transformer.build_model`; tests and users
write files with `save_weights`.

Tensor names (Hugging Face Qwen-MoE style; `L` a layer, `E` an expert; shapes in
`[out, in]` order of `nn.Linear`, with H = hidden_size, D = head_dim, I =
moe_intermediate_size, S = shared_expert_intermediate_size, V = vocab_size):

    model.embed_tokens.weight                              [V, H]
    model.layers.L.input_layernorm.weight                  [H]
    model.layers.L.self_attn.q_proj.weight                 [num_heads * D, H]
    model.layers.L.self_attn.k_proj.weight                 [num_kv_heads * D, H]
    model.layers.L.self_attn.v_proj.weight                 [num_kv_heads * D, H]
    model.layers.L.self_attn.o_proj.weight                 [H, num_heads * D]
    model.layers.L.post_attention_layernorm.weight         [H]
    model.layers.L.mlp.gate.weight                         [num_experts, H]
    model.layers.L.mlp.experts.E.gate_proj.weight          [I, H]
    model.layers.L.mlp.experts.E.up_proj.weight            [I, H]
    model.layers.L.mlp.experts.E.down_proj.weight          [H, I]
    model.layers.L.mlp.shared_expert.{gate,up}_proj.weight [S, H]   (only when S > 0)
    model.layers.L.mlp.shared_expert.down_proj.weight      [H, S]   (only when S > 0)
    model.norm.weight                                      [H]
    lm_head.weight                                         [V, H]

Invariant: a file must hold exactly these tensors with exactly these shapes (any
floating dtype; they are cast to the model's); anything else is a `WeightsError`
naming the offending tensors, raised before the model is touched.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn


class WeightsError(ValueError):
    """A weights file that cannot be read or does not fit the model."""


def load_weights(model: nn.Module, path: Path | str) -> None:
    """Copies the tensors of the safetensors file at `path` into `model` (strict)."""
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise WeightsError(f"cannot read weights file {path}: {exc}") from None
    expected = model.state_dict()
    problems = []
    if missing := sorted(expected.keys() - tensors.keys()):
        problems.append(f"missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if unexpected := sorted(tensors.keys() - expected.keys()):
        problems.append(f"unexpected tensors: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    for name in sorted(expected.keys() & tensors.keys()):
        tensor = tensors[name]
        if tensor.shape != expected[name].shape:
            problems.append(f"{name} has shape {list(tensor.shape)}, the model needs {list(expected[name].shape)}")
        elif not tensor.is_floating_point():
            problems.append(f"{name} has dtype {tensor.dtype}, a floating dtype is needed")
    if problems:
        raise WeightsError(f"weights file {path} does not fit the model: " + "; ".join(problems))
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(tensors[name])


def save_weights(model: nn.Module, path: Path | str) -> None:
    """Writes `model`'s tensors to a safetensors file, in the names `load_weights` reads."""
    save_file({name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}, str(path))
