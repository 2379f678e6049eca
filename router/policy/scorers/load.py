"""Scorer `load`: how much work already sits on a worker, in [0, 1] (a cost).

The `kv` policy scores `w_prefix * match_rate - w_load * load`, so `load` must be on
the scale of what a prefix match buys. Three parts, mixed by configurable shares
(normalised to sum 1):

- prefill: `predicted_prefill_tokens / max(num_prompt_tokens, largest predicted
  prefill tokens among the candidates)`. Prefill is what delays a first token: on a
  worker with `Q` tokens of prefill queued, a prompt of `P` tokens matching a share
  `m` starts its first token after about `Q + (1 - m) * P` tokens of compute, so
  minimising that is maximising `m - Q / P`. Dividing by `P` (the request's own
  prompt) makes `match_rate - load` that trade exactly while queues are shorter than
  the prompt. Once some queue is longer than the prompt, the divisor becomes that
  queue, which keeps the term in [0, 1] and its order, and leans toward the cache
  when every worker is far behind: a hit then saves work for everyone queued after.
- requests: in-flight requests (the router's prediction or the worker's report,
  whichever is larger) over `max(load_requests_floor, most requests among the
  candidates)`. Decode sequences slow every step a worker takes; the floor keeps one
  or two requests from counting as "fully loaded" on an idle fleet.
- kv: KV usage, reported or predicted (see `kv-usage`), already in [0, 1]. A full
  cache evicts prefixes and preempts requests.

Relative parts (divided by the largest among candidates) compare workers with each
other, which is all a ranking needs, and stay bounded without a per-model capacity
constant; the prompt-size floor stops them from blowing up small differences on an
idle fleet. A strictly TTFT-greedy variant (queue over the least loaded candidate's,
in prompts, saturating at 1) was measured with `bench/routing.py`: on the synthetic
Mooncake trace it cut `kv`'s hit rate from 0.43 to 0.40 for no better p99 TTFT, since
leaving a cached worker scatters a conversation's context over the fleet.

Consumes: `Candidate.predicted_prefill_tokens`, `predicted_requests`, `num_running`,
`num_waiting`, `kv_usage`, `predicted_blocks`, `num_kv_blocks_total`;
`RouteRequest.num_prompt_tokens`. Produces: `scores["load"]` in [0, 1].
Config: `load_weight`, `load_prefill_share`, `load_requests_share`, `load_kv_share`,
`load_requests_floor`.
"""

from __future__ import annotations

from router.policy.base import Candidate, PolicyState, RouteRequest, ScorerBase, register_scorer
from router.policy.config import PolicyConfig


@register_scorer("load")
class LoadScorer(ScorerBase):
    higher_is_better = False
    weight_field = "load_weight"

    def __init__(
        self,
        weight: float = -1.0,
        prefill_share: float = 0.7,
        requests_share: float = 0.15,
        kv_share: float = 0.15,
        requests_floor: int = 8,
    ) -> None:
        super().__init__(weight)
        total = prefill_share + requests_share + kv_share
        if total <= 0:
            raise ValueError("the load shares cannot all be 0")
        self.prefill_share = prefill_share / total
        self.requests_share = requests_share / total
        self.kv_share = kv_share / total
        self.requests_floor = max(1, requests_floor)

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> LoadScorer:
        return cls(
            -config.load_weight,
            config.load_prefill_share,
            config.load_requests_share,
            config.load_kv_share,
            config.load_requests_floor,
        )

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]:
        # NOTE: hot path (every request, every candidate): fields are read inline rather
        # than through `Candidate.num_requests` / `kv_fill`, which compute the same.
        prefill = [c.predicted_prefill_tokens for c in candidates]
        requests = [
            max(c.predicted_requests, c.num_running + c.num_waiting) for c in candidates
        ]
        prefill_weight = self.prefill_share / max(request.num_prompt_tokens, max(prefill), 1)
        requests_weight = self.requests_share / max(self.requests_floor, max(requests))
        kv_share = self.kv_share
        values = []
        append = values.append
        for c, num_tokens, num_requests in zip(candidates, prefill, requests):
            value = num_tokens * prefill_weight + num_requests * requests_weight
            if kv_share:
                usage = c.kv_usage
                if c.num_kv_blocks_total > 0 and c.predicted_blocks > usage * c.num_kv_blocks_total:
                    usage = c.predicted_blocks / c.num_kv_blocks_total
                value += kv_share * (1.0 if usage > 1.0 else usage)
            append(1.0 if value > 1.0 else value)
        return values

    def describe(self) -> dict[str, object]:
        return {
            "weight": self.weight,
            "prefill_share": self.prefill_share,
            "requests_share": self.requests_share,
            "kv_share": self.kv_share,
            "requests_floor": self.requests_floor,
        }
