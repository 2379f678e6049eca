"""`PolicyConfig`: every weight and threshold of the routing policies, validated.

Owns the one place where policy settings are checked. The router builds a config at
startup (flags, config file) and again for `PATCH /admin/config`; `load_config` turns
any mapping into a validated, immutable `PolicyConfig` or raises `PolicyConfigError`
naming the bad field. Plugins read the fields they need in `from_config`; a policy that
does not use a field ignores it, so one config serves every policy name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

_NonNeg = Annotated[float, msgspec.Meta(ge=0.0)]
_Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
_Count = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]


class PolicyConfigError(ValueError):
    """A policy setting that cannot be applied; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"policy config `{field}`: {message}")
        self.field = field


class PolicyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Weights and thresholds of the routing policies (see each plugin's Config)."""

    # -- scorer weights (magnitudes; a cost scorer's weight enters the sum negated)
    prefix_weight: _NonNeg = 1.0
    load_weight: _NonNeg = 1.0
    kv_usage_weight: _NonNeg = 0.0
    queue_weight: _NonNeg = 0.0
    share_weight: _NonNeg = 1.0
    # -- the load scorer's mix (normalised to sum 1) and its request-count floor
    load_prefill_share: _NonNeg = 0.7
    load_requests_share: _NonNeg = 0.15
    load_kv_share: _NonNeg = 0.15
    load_requests_floor: _Positive = 8
    queue_floor: _Positive = 4
    # -- the dispatch-share scorer: tolerated excess over a fair share, decay horizon
    share_tolerance: Annotated[float, msgspec.Meta(gt=0.0, le=10.0)] = 0.1
    share_half_life: _Positive = 512
    share_warmup: _Count = 8
    # -- busy filter: a worker over either threshold is skipped while one is under both
    busy_max_kv_usage: _Fraction = 0.98
    busy_max_waiting: _Count = 64
    # -- pickers
    temperature: _NonNeg = 0.0  # kv: 0 picks the best score, > 0 samples a softmax
    seed: int | None = None  # random tie-breaks, sampling, random and power-of-two
    # -- cache_aware (approximate trees, imbalance guard)
    cache_threshold: _Fraction = 0.3
    balance_abs_threshold: _Count = 16
    balance_rel_threshold: Annotated[float, msgspec.Meta(ge=1.0)] = 1.5
    approx_tree_max_blocks: _Positive = 1 << 16

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            # JSON parsers accept NaN and Infinity; a weight of either poisons every score.
            if isinstance(value, float) and not math.isfinite(value):
                raise PolicyConfigError(name, f"must be a finite number, got {value}")
        if self.load_prefill_share + self.load_requests_share + self.load_kv_share <= 0:
            raise PolicyConfigError("load_prefill_share", "the three load shares cannot all be 0")

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    def updated(self, changes: Mapping[str, Any]) -> PolicyConfig:
        """A validated copy with `changes` applied (for `PATCH /admin/config`)."""
        return load_config({**self.to_dict(), **changes})


def load_config(source: PolicyConfig | Mapping[str, Any] | None) -> PolicyConfig:
    """A validated `PolicyConfig` from a config, a mapping (JSON, TOML) or None (defaults)."""
    if source is None:
        return PolicyConfig()
    if isinstance(source, PolicyConfig):
        return source
    if not isinstance(source, Mapping):
        raise PolicyConfigError("$", f"expected an object, got {type(source).__name__}")
    try:
        return msgspec.convert(dict(source), PolicyConfig, strict=True)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, PolicyConfigError):  # raised by __post_init__
            raise exc.__cause__ from None
        raise _named(exc) from None


def _named(exc: msgspec.ValidationError) -> PolicyConfigError:
    message = str(exc)
    # msgspec ends its message with "- at `$.field`" when it knows the field.
    head, sep, where = message.rpartition(" - at `$.")
    if sep:
        return PolicyConfigError(where.rstrip("`").split(".")[0].split("[")[0], head)
    if message.startswith("Object contains unknown field `"):
        return PolicyConfigError(message.split("`")[1], "unknown field")
    return PolicyConfigError("$", message)
