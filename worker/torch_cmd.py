"""`kvgate worker --engine torch`: the torch engine's flags and how they build the engine.

Owns the "torch engine", "model" and "data and expert parallelism" argument groups,
`build_torch_engine`, which turns the parsed flags into an `worker.engine_core.EngineCore`
(model built, weights loaded, KV cache allocated) wrapped in a
`worker.torch_engine.TorchEngine`, and `build_dp_engine`, the same for one DP rank
(`worker.dp_engine`: expert shards, Dual Batch Overlap, the DP participant).
Called by `worker/worker_cmd.py` and `worker/dp_worker.py`; every invalid flag becomes
a `SystemExit` naming it.

NOTE: torch is imported only when a torch engine is built, so `kvgate worker --engine
sim` (and the router, the sidecar) run where torch is not installed.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from indexer.tokenizer import Tokenizer
from worker.api import ServedModel
from worker.models.config import ModelConfig

if TYPE_CHECKING:
    from worker.dp_engine import CommMeter, DPTorchEngine
    from worker.dp_participant import DPParticipant
    from worker.engine_core import EngineConfig, EngineCore
    from worker.moe.dbo import DboConfig
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
    parallel = parser.add_argument_group("data and expert parallelism (torch engine)")
    parallel.add_argument(
        "--dp", type=int, default=1,
        help="data-parallel ranks, one process and one worker each (default: 1; under torchrun: WORLD_SIZE)",
    )
    parallel.add_argument(
        "--enable-expert-parallel", action="store_true", help="shard the routed experts over the DP ranks"
    )
    parallel.add_argument(
        "--enable-dbo", action="store_true",
        help="Dual Batch Overlap: split large steps into two overlapped micro-batches",
    )
    parallel.add_argument(
        "--dbo-decode-token-threshold", type=int, default=32, help="fewest tokens of a decode-only step to split"
    )
    parallel.add_argument(
        "--dbo-prefill-token-threshold", type=int, default=512, help="fewest tokens of a step with prefill to split"
    )
    parallel.add_argument(
        "--dp-heartbeat-interval", type=float, default=1.0, help="seconds between DP liveness heartbeats"
    )
    parallel.add_argument(
        "--dp-liveness-timeout", type=float, default=10.0, help="seconds of silence after which a DP rank is dead"
    )


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


def wants_parallel(args: argparse.Namespace) -> bool:
    """True when the flags ask for DP ranks or expert parallelism (`worker.dp_worker` runs it)."""
    return args.engine == "torch" and (args.dp != 1 or args.enable_expert_parallel or args.enable_dbo)


def check_parallel_args(args: argparse.Namespace, num_ranks: int) -> None:
    """`SystemExit` naming the flag unless the parallelism flags make a group of `num_ranks`."""
    problems = []
    if num_ranks < 1:
        problems.append(f"--dp must be >= 1, got {num_ranks}")
    if num_ranks > 1 and not args.enable_expert_parallel:
        problems.append("--dp > 1 needs --enable-expert-parallel (the experts are the layers the ranks share)")
    if args.enable_dbo and not args.enable_expert_parallel:
        problems.append("--enable-dbo needs --enable-expert-parallel")
    if args.num_experts < num_ranks:
        problems.append(f"--num-experts must be >= the DP size ({num_ranks}), got {args.num_experts}")
    if args.dp_heartbeat_interval <= 0 or args.dp_liveness_timeout <= args.dp_heartbeat_interval:
        problems.append("--dp-heartbeat-interval must be > 0 and --dp-liveness-timeout must exceed it")
    for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
        if getattr(args, name) < 2:
            problems.append(f"--{name.replace('_', '-')} must be >= 2 (two non-empty micro-batches)")
    if problems:
        raise SystemExit("kvgate worker: " + "; ".join(problems))


def dbo_config(args: argparse.Namespace) -> DboConfig:
    from worker.moe.dbo import DboConfig

    return DboConfig(args.enable_dbo, args.dbo_decode_token_threshold, args.dbo_prefill_token_threshold)


def build_torch_engine(args: argparse.Namespace, served_name: str, tokenizer: Tokenizer, worker_id: str) -> TorchEngine:
    """The torch engine the flags describe; `SystemExit` if they cannot make one."""
    try:
        from worker.torch_engine import TorchEngine
    except ImportError as exc:
        raise SystemExit(f"kvgate worker --engine torch needs torch: pip install 'kvgate[worker]' ({exc})") from None
    core = _build_core(args, served_name, tokenizer)
    return TorchEngine(core, ServedModel(served_name, tokenizer, core.max_model_len), **_engine_kwargs(args, worker_id))


def build_dp_engine(
    args: argparse.Namespace, served_name: str, tokenizer: Tokenizer, worker_id: str,
    participant: DPParticipant, meter: CommMeter,
) -> DPTorchEngine:
    """One DP rank's engine: experts sharded over `meter`'s group, steps paced by `participant`."""
    from worker.dp_engine import DPMetrics, DPTorchEngine, make_dp_runner

    metrics = DPMetrics()
    core = _build_core(args, served_name, tokenizer, make_dp_runner(meter, dbo_config(args), metrics))
    return DPTorchEngine(
        core, ServedModel(served_name, tokenizer, core.max_model_len), participant=participant,
        metrics=metrics, drain_timeout_s=args.shutdown_timeout, drain_quiet_s=max(0.5, 2 * args.dp_heartbeat_interval),
        **_engine_kwargs(args, worker_id),
    )


def _build_core(
    args: argparse.Namespace, served_name: str, tokenizer: Tokenizer, make_runner: Any = None
) -> EngineCore:
    try:
        from worker.engine_core import EngineCore
        from worker.models import WeightsError
    except ImportError as exc:
        raise SystemExit(f"kvgate worker --engine torch needs torch: pip install 'kvgate[worker]' ({exc})") from None
    config = engine_config(args)
    extra = {"make_runner": make_runner} if make_runner is not None else {}
    try:
        return EngineCore(
            config, model_config(args, tokenizer.vocab_size), model_name=served_name,
            eos_token_id=tokenizer.eos_token_id, weights=args.weights, **extra,
        )
    except WeightsError as exc:
        raise SystemExit(f"kvgate worker: --weights: {exc}") from None
    except ValueError as exc:
        raise SystemExit(f"kvgate worker: {exc}") from None


def _engine_kwargs(args: argparse.Namespace, worker_id: str) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "events_endpoint": args.events_endpoint or None,
        "replay_endpoint": args.replay_endpoint or None,
        "load_endpoint": args.load_endpoint or None,
        "load_interval_s": args.load_interval,
        "remote_prefill_timeout_s": args.remote_prefill_timeout,
    }
