"""The torch engine's synchronous core: scheduler + block pool + model runner + sampler.

Owns `EngineConfig` (cache, batching and device settings, validated naming the bad
field), `RequestRejected` and `EngineCore`, which adds requests, runs one step at a
time (`schedule` -> model forward -> sample -> `finish_step`) and aborts requests.
No threads, no I/O, no clock: `worker/torch_engine.py` runs one in its engine thread
and publishes what it queues; tests and `bench/engine.py` drive one directly
(`generate` runs a batch of requests to completion).

Invariants:
- every accepted request fits the cache on its own (prompt + max_tokens <=
  max_model_len <= num_blocks * block_size) and the model's vocabulary, so the
  scheduler's oldest request always progresses;
- one sampling state per unfinished request, dropped when it finishes or is aborted.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.block_pool import BlockPool
from worker.model_runner import ModelRunner
from worker.models import ModelConfig, MoETransformer, build_model
from worker.sampling import Sampler, SamplingParams
from worker.scheduler import RequestState, Scheduler, StepResult

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RequestRejected(ValueError):
    """A request the engine cannot run; `param` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """KV cache, batching and device settings of the torch engine."""

    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: the whole cache (capped by the model's positions)
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0  # seeds the sampler's shared generator
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.max_model_len <= self.num_blocks * self.block_size:
            raise ValueError(
                f"max_model_len must be in [0, num_blocks * block_size = {self.num_blocks * self.block_size}], "
                f"got {self.max_model_len}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")

    def context_len(self, model_config: ModelConfig) -> int:
        limit = self.max_model_len or self.num_blocks * self.block_size
        return min(limit, model_config.max_position_embeddings)


class EngineCore:
    """Continuous batching over a paged KV cache with one model; see the module docstring."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        *,
        model_name: str = "",
        eos_token_id: int | None = None,
        weights: Path | str | None = None,
        make_runner: Callable[[MoETransformer, int, int], ModelRunner] = ModelRunner,
    ) -> None:
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} asked for, but CUDA is not available")
        self.config = config
        self.model_config = model_config
        self.max_model_len = config.context_len(model_config)
        self.eos_token_id = eos_token_id
        model = build_model(model_config, config.device, DTYPES[config.dtype], weights)
        self.pool = BlockPool(
            config.num_blocks, config.block_size, model=model_name, enable_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.pool)
        # make_runner(model, num_blocks, block_size): the DP worker's runner shards the
        # model's experts and micro-batches steps (`worker.dp_engine`).
        self.runner = make_runner(model, config.num_blocks, config.block_size)
        self.sampler = Sampler(config.seed)
        self._sampling: dict[str, tuple[SamplingParams, torch.Generator | None]] = {}
        self._generate_ids = itertools.count()
        self.stalled = False  # the last step scheduled nothing: wait for a KV transfer

    # -- requests ------------------------------------------------------------------

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises `RequestRejected` unless the request fits the model and the cache."""
        if len(prompt_token_ids) == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        vocab_size = self.model_config.vocab_size
        if max(prompt_token_ids) >= vocab_size or min(prompt_token_ids) < 0:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        if (num_tokens := len(prompt_token_ids) + params.max_tokens) > self.max_model_len:
            raise RequestRejected(
                f"prompt + max_tokens = {num_tokens} exceeds the maximum context length {self.max_model_len}",
                "max_tokens",
            )
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise RequestRejected(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
        remote_prefill: bool = False, hold_blocks: bool = False,
    ) -> RequestState:
        """Queues a request (after `check`); its tokens come out of `step`.

        `remote_prefill` and `hold_blocks`: see `worker.scheduler` (disaggregation)."""
        if request_id in self._sampling:
            raise RequestRejected(f"request id {request_id!r} is already in use", "request_id")
        self.check(prompt_token_ids, params)
        prompt = list(prompt_token_ids)
        eos = None if params.ignore_eos else self.eos_token_id
        state = RequestState(
            request_id, prompt, len(prompt), params.max_tokens, None, eos,
            stop_token_ids=frozenset(params.stop_token_ids),
            remote_prefill=remote_prefill, hold_blocks=hold_blocks,
        )
        self._sampling[request_id] = (params, self.sampler.new_generator(params))
        self.scheduler.add(state)
        return state

    def abort(self, request_id: str) -> bool:
        """Drops an unfinished request and frees its blocks (held while remote-prefilling);
        False if unknown or finished."""
        self._sampling.pop(request_id, None)
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- steps ---------------------------------------------------------------------

    def step(self) -> list[StepResult]:
        """Schedules, runs and samples one step; returns the tokens it produced."""
        step = self.scheduler.schedule()
        self.stalled = not step.scheduled
        if self.stalled:
            # Every admitted request went remote, or KV transfers hold the room it needs.
            assert self.scheduler.waits_on_transfers(), "work queued but nothing schedulable: a request outgrew the pool"
            return []
        logits = self.runner.execute(step, self.pool)
        requests = [step.scheduled[index][0] for index in step.sampling_indices()]
        states = [self._sampling[request.request_id] for request in requests]
        token_ids = self.sampler.sample(logits, [p for p, _ in states], [g for _, g in states])
        results = self.scheduler.finish_step(step, token_ids)
        for result in results:
            if result.finish_reason is not None:
                del self._sampling[result.request.request_id]
        return results

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
        """Runs the prompts together to completion; returns each one's output token ids."""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        request_ids = [f"generate-{next(self._generate_ids)}" for _ in prompts]
        outputs: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
        for request_id, prompt, request_params in zip(request_ids, prompts, all_params, strict=True):
            self.add_request(request_id, prompt, request_params)
        while self.has_work():
            for result in self.step():
                outputs[result.request.request_id].append(result.token_id)
        return [outputs[request_id] for request_id in request_ids]
