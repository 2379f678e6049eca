"""The reference worker's model: a decoder-only MoE transformer over a paged KV cache.

`ModelConfig` needs no torch; the rest is imported on first use, so the sim worker and
the CLI load this package where torch is not installed.
"""

from importlib import import_module
from typing import Any

from worker.models.config import ModelConfig

_LAZY = {
    "AttentionMetadata": "worker.models.attention",
    "PrefillSeq": "worker.models.attention",
    "KVCache": "worker.models.transformer",
    "MoETransformer": "worker.models.transformer",
    "build_model": "worker.models.transformer",
    "WeightsError": "worker.models.weights",
    "load_weights": "worker.models.weights",
    "save_weights": "worker.models.weights",
}

__all__ = ["ModelConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'worker.models' has no attribute {name!r}")
    return getattr(import_module(module), name)
