"""Decider `disagg`: prefill on the decode worker itself, or remotely on a prefill worker.

Conditional decode-first disaggregation (ARCHITECTURE.md): every request goes to the
decode worker D the policy ranked first; this decides, per attempt (a retry on
another worker decides again), whether D prefills the prompt itself or has a prefill
worker do it through the global prefill queue. Remote iff, checked in this order
(the first that fails names the local decision's reason):

1. disaggregation is active (a prefill queue is configured)       else "disabled"
2. D's role is `decode` (a `both` worker prefills itself)           else "role"
3. a healthy, non-draining `prefill` worker serves the model        else "no_prefill_workers"
4. the queue's depth for the model is known (polled, not failing)   else "queue_unavailable"
5. uncached = prompt tokens - D's matched blocks * block size
   > `max_local_prefill_tokens`                                     else "short_prompt"
6. depth = last polled depth + remote decisions made since that poll
   < `max_prefill_queue_depth`                                      else "queue_full"

A remote decision's reason is "long_prompt".

Consumes: `RouteRequest.num_prompt_tokens`, the dispatched `Candidate` (role,
matched_blocks, block_size, model) and every candidate of the request (roles, health,
draining: prefill workers are candidates the `role` filter drops from ranking), plus
the depths `router.prefill_poller` feeds in. Produces: a `PrefillDecision`, and its
`kv_transfer_params` bytes for the body forwarded to D. Config:
`max_local_prefill_tokens`, `max_prefill_queue_depth` (both changeable at runtime
through `PATCH /admin/config`), `prefill_queue_url`, `prefill_queue_token`,
`poll_interval_s` (`DisaggConfig`).

Pure and synchronous: `decide` reads state only (the dry run `POST /admin/route` calls
it); `on_dispatch` (the routing core, per attempt) and the poller's `begin_poll` /
`set_depth` / `set_unknown` are the only mutations, never across an await.

NOTE: the depth counts remote decisions made since the poll *started*, not since it
ended: a decision taken while the poll awaited Redis may not be in the polled figure,
so it keeps counting until the next poll.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from router.policy.base import Candidate, RouteRequest

QUEUE_SCHEMES = ("redis://", "rediss://", "unix://", "http://", "https://")
REMOTE = "remote"
LOCAL = "local"
LONG_PROMPT = "long_prompt"
_LOCAL_PARAMS = b'{"do_remote_prefill":false}'


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """`kvgate router`'s disaggregation flags; validated on construction, naming the field."""

    prefill_queue_url: str = ""  # "": no queue of its own (one may be injected, see router.app)
    max_local_prefill_tokens: int = 512
    max_prefill_queue_depth: int = 32
    poll_interval_s: float = 0.05
    prefill_queue_token: str | None = field(default=None, repr=False)  # bearer token of an http(s) queue

    def __post_init__(self) -> None:
        check_threshold("max_local_prefill_tokens", self.max_local_prefill_tokens)
        check_threshold("max_prefill_queue_depth", self.max_prefill_queue_depth)
        if not self.poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be > 0, got {self.poll_interval_s!r}")
        url = self.prefill_queue_url
        if url and not url.startswith(QUEUE_SCHEMES):
            raise ValueError(f"prefill_queue_url must start with one of {', '.join(QUEUE_SCHEMES)}; got {url!r}")


def check_threshold(name: str, value: object) -> int:
    """`value` if it is an integer >= 0, else ValueError naming `name`."""
    if value.__class__ is not int or value < 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    is_remote: bool
    reason: str
    num_uncached_tokens: int
    num_cached_tokens: int
    queue_depth: int | None  # polled + in flight; None while unknown

    @property
    def label(self) -> str:
        return REMOTE if self.is_remote else LOCAL

    def kv_transfer_params(self) -> bytes:
        """The JSON value of `kv_transfer_params` in the body forwarded to D."""
        if not self.is_remote:
            return _LOCAL_PARAMS
        return b'{"do_remote_prefill":true,"num_cached_tokens":%d}' % self.num_cached_tokens

    def describe(self) -> dict[str, object]:
        return {"prefill": self.label, "reason": self.reason,
                "uncached_tokens": self.num_uncached_tokens, "queue_depth": self.queue_depth}


class PrefillDecider:
    """See the module docstring."""

    def __init__(self, config: DisaggConfig, is_enabled: bool) -> None:
        self.is_enabled = is_enabled
        self.max_local_prefill_tokens = config.max_local_prefill_tokens
        self.max_prefill_queue_depth = config.max_prefill_queue_depth
        self.is_queue_available = False  # set by the poller
        self._polled: dict[str, int | None] = {}  # model -> last polled depth (None: unknown)
        self._num_remote: dict[str, int] = {}  # model -> remote decisions, ever
        self._num_remote_at_poll: dict[str, int] = {}  # model -> `_num_remote` when its poll began

    # -- the decision -------------------------------------------------------------------

    def decide(self, request: RouteRequest, chosen: Candidate, candidates: Iterable[Candidate]) -> PrefillDecision:
        """Remote or local prefill on `chosen` (see the module docstring); changes nothing."""
        num_cached = chosen.matched_blocks * chosen.block_size
        num_uncached = max(0, request.num_prompt_tokens - num_cached)
        depth = self.queue_depth(chosen.model)
        if not self.is_enabled:
            return PrefillDecision(False, "disabled", num_uncached, num_cached, depth)
        if chosen.role != "decode":
            return PrefillDecision(False, "role", num_uncached, num_cached, depth)
        if not any(c.role == "prefill" and c.healthy and not c.draining for c in candidates):
            return PrefillDecision(False, "no_prefill_workers", num_uncached, num_cached, depth)
        if depth is None or not self.is_queue_available:
            return PrefillDecision(False, "queue_unavailable", num_uncached, num_cached, depth)
        if num_uncached <= self.max_local_prefill_tokens:
            return PrefillDecision(False, "short_prompt", num_uncached, num_cached, depth)
        if depth >= self.max_prefill_queue_depth:
            return PrefillDecision(False, "queue_full", num_uncached, num_cached, depth)
        return PrefillDecision(True, LONG_PROMPT, num_uncached, num_cached, depth)

    def on_dispatch(self, model: str, decision: PrefillDecision) -> None:
        """`decision` was sent to a worker: a remote one adds a job to the queue soon."""
        if decision.is_remote:
            self._num_remote[model] = self._num_remote.get(model, 0) + 1

    def queue_depth(self, model: str) -> int | None:
        """The last polled depth plus the remote decisions since; None while unknown."""
        polled = self._polled.get(model)
        if polled is None:
            return None
        return polled + self._num_remote.get(model, 0) - self._num_remote_at_poll.get(model, 0)

    # -- fed by the poller ----------------------------------------------------------------

    def begin_poll(self, model: str) -> int:
        """A token for `set_depth`: the remote decisions counted when the poll began."""
        return self._num_remote.get(model, 0)

    def set_depth(self, model: str, depth: int, token: int) -> None:
        self._polled[model] = depth
        self._num_remote_at_poll[model] = token

    def set_unknown(self, model: str) -> None:
        self._polled[model] = None

    def keep_models(self, models: set[str]) -> None:
        """Forgets the depths of models that no longer have a prefill worker."""
        for gone in [model for model in self._polled if model not in models]:
            del self._polled[gone]

    def polled_depths(self) -> dict[str, int | None]:
        return dict(self._polled)
