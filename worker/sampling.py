"""Sampling: a request's sampling parameters and the batched sampler that applies them.

Owns `SamplingParams` (validated on construction: a bad field raises `ValueError`
naming it), `sampling_params` (a validated `worker.api.GenerateRequest` -> params)
and `Sampler`, which turns one step's logits into one token per sampled request.

- temperature 0 is greedy (argmax); otherwise logits / temperature, then top-k (keep
  the k most likely; 0 or -1: off), then top-p (keep the smallest set of most likely
  tokens whose probability reaches p), then one draw.
- a request with a `seed` draws from its own generator, seeded once, so its output
  depends only on its prompt and params, not on what it was batched with; requests
  without one share the sampler's generator (seeded by the engine's seed).
- stop strings are not sampling: `worker/text.py` cuts the text at them and the server
  then aborts the request in the engine. Stop token ids, EOS and `max_tokens` end a
  request in the scheduler (`worker.scheduler`), which sets `finish_reason`.

Callers: `worker/engine_core.py` (one `Sampler`, one generator per seeded request).
Sampling runs on the CPU in float32: [num_sampled, vocab] is small, and CPU
generators give the same draws whatever the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.api import GenerateRequest

_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick a request's tokens and when to stop (besides stop strings)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if type(self.top_k) is not int or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1: off), got {self.top_k!r}")
        if self.seed is not None and not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{_SEED_RANGE[0]}, {_SEED_RANGE[1]}], got {self.seed}")
        if not all(type(t) is int and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sampling_params(request: GenerateRequest) -> SamplingParams:
    """The sampling params of a request parsed by `worker.api` (already range-checked)."""
    return SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        ignore_eos=request.ignore_eos,
        stop_token_ids=request.stop_token_ids,
    )


class Sampler:
    """Logits of one step -> one token per row, each row with its own params."""

    def __init__(self, seed: int = 0) -> None:
        self._shared = torch.Generator().manual_seed(seed)

    @staticmethod
    def new_generator(params: SamplingParams) -> torch.Generator | None:
        """A request's own generator: seeded requests that draw get one, others None."""
        if params.seed is None or params.is_greedy:
            return None
        return torch.Generator().manual_seed(params.seed)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        """logits [N, vocab] -> N token ids; row i follows params[i], draws from generators[i]."""
        assert logits.shape[0] == len(params) == len(generators)
        logits = logits.float().cpu()
        tokens = logits.argmax(dim=-1).tolist()
        drawing = [i for i, p in enumerate(params) if not p.is_greedy]
        if not drawing:
            return tokens
        probs = self._probs(logits[drawing], [params[i] for i in drawing])
        for row, index in enumerate(drawing):
            generator = generators[index] or self._shared
            tokens[index] = int(torch.multinomial(probs[row], 1, generator=generator).item())
        return tokens

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k and top-p applied: [n, vocab] probabilities."""
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        logits = logits / temperatures.unsqueeze(1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        ranks = torch.arange(vocab).unsqueeze(0)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
        drop = ranks >= top_k
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).unsqueeze(1)
        # A token is dropped when the more likely ones already reach top_p; the first never is.
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return filtered.softmax(dim=-1)
