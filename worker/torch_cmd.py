"""`kvgate worker --engine torch`: the torch engine's flags and how they build the engine.

Owns the "torch engine" and "model" argument groups and `build_torch_engine`, which
turns the parsed flags into an `worker.engine_core.EngineCore` (model built, weights
loaded, KV cache allocated) wrapped in a `worker.torch_engine.TorchEngine`.
Called by `worker/worker_cmd.py`; every invalid flag becomes a `SystemExit` naming it.

NOTE: torch is imported only when a torch engine is built, so `kvgate worker --engine
sim` (and the router, the sidecar) run where torch is not installed.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from indexer.tokenizer import Tokenizer
from worker.api import ServedModel
from worker.models.config import ModelConfig

if TYPE_CHECKING:
    from worker.engine_core import EngineConfig
    from worker.torch_engine import TorchEngine

DEFAULT_MODEL_NAME = "kvgate-moe-tiny"
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # worker.engine_core.DTYPES, without torch
# ModelConfig fields settable by a flag of the same name (--hidden-size, ...).
_MODEL_FLAGS = (
    "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("torch engine")
    engine.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    engine.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="default: float32 on cpu, bfloat16 on cuda")
    engine.add_argument("--weights", help="a safetensors file of the model's tensors (default: seeded random weights)")
    engine.add_argument("--seed", type=int, default=0, help="seed of the random weights and of unseeded sampling")
    engine.add_argument("--no-prefix-caching", action="store_true", help="switch the prefix cache off")
    model = parser.add_argument_group("model shape (torch engine; must match --weights)")
    defaults = ModelConfig()
    for name in _MODEL_FLAGS:
        flag = "--" + name.replace("_", "-")
        model.add_argument(flag, type=int, default=getattr(defaults, name), help=f"default: {getattr(defaults, name)}")


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The model's shape from the flags; its vocabulary covers the tokenizer's."""
    values = {name: getattr(args, name) for name in _MODEL_FLAGS}
    try:
        return ModelConfig(**values, vocab_size=max(vocab_size, ModelConfig().vocab_size), seed=args.seed)
    except ValueError as exc:
        field_name, _, rest = str(exc).partition(" ")
        raise SystemExit(f"kvgate worker: --{field_name.replace('_', '-')} {rest}") from None


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from worker.engine_core import EngineConfig

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    try:
        return EngineConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            device=args.device,
            dtype=dtype,
            seed=args.seed,
            enable_prefix_caching=not args.no_prefix_caching,
        )
    except ValueError as exc:
        field_name, _, rest = str(exc).partition(" ")
        raise SystemExit(f"kvgate worker: --{field_name.replace('_', '-')} {rest}") from None


def build_torch_engine(args: argparse.Namespace, served_name: str, tokenizer: Tokenizer, worker_id: str) -> TorchEngine:
    """The torch engine the flags describe; `SystemExit` if they cannot make one."""
    try:
        from worker.engine_core import EngineCore
        from worker.models import WeightsError
        from worker.torch_engine import TorchEngine
    except ImportError as exc:
        raise SystemExit(f"kvgate worker --engine torch needs torch: pip install 'kvgate[worker]' ({exc})") from None
    config = engine_config(args)
    try:
        core = EngineCore(
            config, model_config(args, tokenizer.vocab_size), model_name=served_name,
            eos_token_id=tokenizer.eos_token_id, weights=args.weights,
        )
    except WeightsError as exc:
        raise SystemExit(f"kvgate worker: --weights: {exc}") from None
    except ValueError as exc:
        raise SystemExit(f"kvgate worker: {exc}") from None
    served = ServedModel(served_name, tokenizer, core.max_model_len)
    return TorchEngine(
        core, served, worker_id=worker_id,
        events_endpoint=args.events_endpoint or None,
        replay_endpoint=args.replay_endpoint or None,
        load_endpoint=args.load_endpoint or None,
        load_interval_s=args.load_interval,
    )
