"""The routing pipeline's vocabulary: requests, candidates, plugin protocols and registries.

A routing decision runs once per request on the router's hot path:

1. the router builds one `Candidate` per `(worker_id, dp_rank)` from its registry, the
   latest load reports and the `LoadTracker`'s predictions;
2. the lookup step (`router.policy.lookup.fill_matches`) hashes the prompt and fills
   every candidate's `matched_blocks` from the prefix index;
3. the `Policy` runs its filters, then its weighted scorers, then its picker, which
   returns the candidates ranked best first (the router retries down that list).

Plugins never touch the index, the registry or the network: they read the fields
filled before them and write only `Candidate.scores` / `Candidate.score` (the policy
does that for scorers) or their own state. Each plugin is one file, registered here by
a kebab-case name, with a Consumes / Produces / Config docstring.

Score convention: every scorer measures one quantity in [0, 1] and says whether more
of it is better (`higher_is_better`). The policy adds `weight * value` into
`Candidate.score`, where the weight carries the sign: `+w` for a benefit (prefix match
rate), `-w` for a cost (load, KV usage, queue), so `kv` scores exactly
`w_prefix * match_rate - w_load * load`.

Hooks (`on_dispatch`, `on_finish`, `on_worker_removed`) have no-op defaults in
`PluginBase`; a policy only calls the ones a plugin overrides.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from indexer.load import LoadReport

if TYPE_CHECKING:
    from router.policy.config import PolicyConfig

WorkerKey = tuple[str, int]
"""A worker as the index and the load tracker know it: `(worker_id, dp_rank)`."""


@dataclass(slots=True)
class RouteRequest:
    """What the policy knows about one request."""

    request_id: str
    model: str
    token_ids: array  # uint32, from indexer.tokenizer
    num_prompt_tokens: int
    max_tokens: int
    # Filled by the lookup step: block_size -> chained hashes (hash_prompt with `model`).
    hashes_by_block_size: dict[int, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class Candidate:
    """One `(worker_id, dp_rank)` that may serve the request, with what is known of it."""

    worker_id: str
    dp_rank: int
    url: str
    role: str
    model: str
    block_size: int
    healthy: bool = True
    draining: bool = False
    matched_blocks: int = 0  # filled by the lookup step from PrefixIndex.find_matches
    num_running: int = 0  # from the latest fresh LoadReport (0 if none)
    num_waiting: int = 0
    kv_usage: float = 0.0  # 0..1, LoadReport
    num_kv_blocks_total: int = 0
    predicted_prefill_tokens: int = 0  # router's own prediction (LoadTracker)
    predicted_blocks: int = 0
    predicted_requests: int = 0
    scores: dict[str, float] = field(default_factory=dict)  # per scorer, each in [0, 1]
    score: float = 0.0  # weighted sum

    @property
    def key(self) -> WorkerKey:
        return (self.worker_id, self.dp_rank)

    def apply_report(self, report: LoadReport) -> None:
        """Takes the worker's own figures from its latest fresh load report."""
        self.num_running = report.num_running
        self.num_waiting = report.num_waiting
        self.kv_usage = report.kv_usage
        self.num_kv_blocks_total = report.num_kv_blocks_total

    @property
    def num_requests(self) -> int:
        """In-flight requests: the router's prediction or the worker's report, the larger."""
        reported = self.num_running + self.num_waiting
        return self.predicted_requests if self.predicted_requests > reported else reported


class PolicyState:
    """State a policy keeps across reconfigurations: its random source and named objects
    (round-robin position, approximate prefix trees) that plugins rebuilt from a new
    config must not lose."""

    __slots__ = ("rng", "seed", "_objects")

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self._objects: dict[str, object] = {}

    def reseed(self, seed: int | None) -> None:
        if seed != self.seed:
            self.seed = seed
            self.rng.seed(seed)

    def get_or_create(self, name: str, factory: Callable[[], object]) -> object:
        found = self._objects.get(name)
        if found is None:
            found = self._objects[name] = factory()
        return found


class Filter(Protocol):
    name: str

    def filter(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]: ...


class Scorer(Protocol):
    name: str
    weight: float  # signed: positive rewards a high value, negative penalises it

    def score(self, request: RouteRequest, candidates: list[Candidate]) -> list[float]: ...


class Picker(Protocol):
    name: str

    def pick(self, request: RouteRequest, candidates: list[Candidate]) -> list[Candidate]: ...


class PluginBase:
    """Hooks with no-op defaults, and construction from a `PolicyConfig`."""

    name: ClassVar[str] = ""

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> PluginBase:
        return cls()

    def on_dispatch(self, request: RouteRequest, candidate: Candidate) -> None:
        """The router sent `request` to `candidate` (after a successful pick)."""

    def on_finish(self, request_id: str) -> None:
        """The request ended on the worker it was dispatched to (completed, failed or aborted)."""

    def on_worker_removed(self, worker_id: str) -> None:
        """The worker left the registry (every dp rank)."""

    def describe(self) -> dict[str, object]:
        return {}


class ScorerBase(PluginBase):
    """A scorer whose weight comes from one `PolicyConfig` field, signed by
    `higher_is_better`."""

    higher_is_better: ClassVar[bool] = True
    weight_field: ClassVar[str] = ""

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight

    @classmethod
    def from_config(cls, config: PolicyConfig, state: PolicyState) -> ScorerBase:
        magnitude = getattr(config, cls.weight_field)
        return cls(magnitude if cls.higher_is_better else -magnitude)

    def describe(self) -> dict[str, object]:
        return {"weight": self.weight}


FILTERS: dict[str, type[PluginBase]] = {}
SCORERS: dict[str, type[PluginBase]] = {}
PICKERS: dict[str, type[PluginBase]] = {}

_P = TypeVar("_P", bound=type[PluginBase])


def _registrar(table: dict[str, type[PluginBase]], kind: str) -> Callable[[str], Callable[[_P], _P]]:
    def register(name: str) -> Callable[[_P], _P]:
        def decorate(cls: _P) -> _P:
            if name in table:
                raise ValueError(f"{kind} {name!r} is already registered")
            cls.name = name
            table[name] = cls
            return cls

        return decorate

    return register


register_filter = _registrar(FILTERS, "filter")
register_scorer = _registrar(SCORERS, "scorer")
register_picker = _registrar(PICKERS, "picker")


def rank_by_score(candidates: list[Candidate], rng: random.Random) -> list[Candidate]:
    """Candidates by descending score; equal scores in random order.

    Scores within `TIE_EPSILON` of each other count as ties (sums that differ only by
    float rounding). Sorting is stable and ties are rare outside an idle fleet, so only
    runs of tied neighbours are shuffled.
    """
    ranked = sorted(candidates, key=_negated_score)
    num = len(ranked)
    start = 0
    while start < num - 1:
        end = start + 1
        low = ranked[start].score - TIE_EPSILON
        while end < num and ranked[end].score >= low:
            end += 1
        if end - start > 1:
            tied = ranked[start:end]
            rng.shuffle(tied)
            ranked[start:end] = tied
        start = end
    return ranked


TIE_EPSILON = 1e-9


def _negated_score(candidate: Candidate) -> float:
    return -candidate.score
