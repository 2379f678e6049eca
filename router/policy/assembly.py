"""The named policies: which filters, scorers and picker each one assembles.

Every policy starts with the same filters, cheapest first: `healthy`, `serves-model`,
`not-draining`, `role`, `busy`. Then:

| name | scorers (weight) | picker |
|---|---|---|
| `kv` (default) | `prefix-match` (+prefix_weight), `load` (-load_weight), `dispatch-share` (-share_weight), `kv-usage` (-kv_usage_weight), `queue` (-queue_weight); a scorer whose weight is 0 is left out | `max-score`, or `softmax` when temperature > 0 |
| `round_robin` | none | `round-robin` |
| `random` | none | `random` |
| `least_load` | `load` (-1) | `max-score` |
| `power_of_two` | `load` (-1) | `power-of-two` |
| `cache_aware` | `approx-prefix` (+1) | `cache-aware` |

So `kv` scores `match rate - load` (weights 1 and 1 by default), minus a fair-share
guard that stays 0 until a worker has been sent more than `1 + share_tolerance` times
its share of recent requests (see `dispatch-share`: it is what keeps a prefix that is
hot on every worker from drawing all traffic to the few that cached it first).
`kv-usage` and `queue` are off by default (weight 0): `load` already mixes both in.

`least_load` and `power_of_two` rank by load alone, so their weight is fixed at -1 (a
configured `load_weight` of 0 for `kv` must not turn them into random pickers).
`cache_aware` needs no KV events: its scorer remembers what the router sent where.

`build_policy(name, config)` is the one constructor the router uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.policy import filters, pickers, scorers
from router.policy.base import FILTERS, PICKERS, SCORERS, PluginBase, PolicyState
from router.policy.config import PolicyConfig, PolicyConfigError
from router.policy.pipeline import Assembly, Pipeline, Policy
from router.policy.scorers.load import LoadScorer

# Imported for their side effect: each plugin module registers itself by name.
_PLUGIN_PACKAGES = (filters, pickers, scorers)
COMMON_FILTERS = ("healthy", "serves-model", "not-draining", "role", "busy")
DEFAULT_POLICY = "kv"


def _filters_for(config: PolicyConfig, state: PolicyState) -> tuple[PluginBase, ...]:
    return tuple(FILTERS[name].from_config(config, state) for name in COMMON_FILTERS)


def _plugin(table: dict[str, type[PluginBase]], name: str, config: PolicyConfig, state: PolicyState) -> PluginBase:
    return table[name].from_config(config, state)


def _kv(config: PolicyConfig, state: PolicyState) -> Pipeline:
    weights = {
        "prefix-match": config.prefix_weight,
        "load": config.load_weight,
        "kv-usage": config.kv_usage_weight,
        "queue": config.queue_weight,
        "dispatch-share": config.share_weight,
    }
    scorers = tuple(_plugin(SCORERS, name, config, state) for name, weight in weights.items() if weight > 0)
    picker = "softmax" if config.temperature > 0 else "max-score"
    return Pipeline(_filters_for(config, state), scorers, _plugin(PICKERS, picker, config, state))


def _unscored(picker: str) -> Assembly:
    def assemble(config: PolicyConfig, state: PolicyState) -> Pipeline:
        return Pipeline(_filters_for(config, state), (), _plugin(PICKERS, picker, config, state))

    return assemble


def _by_load(picker: str) -> Assembly:
    def assemble(config: PolicyConfig, state: PolicyState) -> Pipeline:
        load = _plugin(SCORERS, "load", config, state)
        assert isinstance(load, LoadScorer)
        load.weight = -1.0
        return Pipeline(_filters_for(config, state), (load,), _plugin(PICKERS, picker, config, state))

    return assemble


def _cache_aware(config: PolicyConfig, state: PolicyState) -> Pipeline:
    approx = _plugin(SCORERS, "approx-prefix", config, state)
    approx.weight = 1.0  # type: ignore[attr-defined]  # the picker reads the raw match rate
    return Pipeline(_filters_for(config, state), (approx,), _plugin(PICKERS, "cache-aware", config, state))


ASSEMBLIES: dict[str, Assembly] = {
    "kv": _kv,
    "round_robin": _unscored("round-robin"),
    "random": _unscored("random"),
    "least_load": _by_load("max-score"),
    "power_of_two": _by_load("power-of-two"),
    "cache_aware": _cache_aware,
}
POLICY_NAMES: tuple[str, ...] = tuple(ASSEMBLIES)


def build_policy(name: str = DEFAULT_POLICY, config: PolicyConfig | Mapping[str, Any] | None = None) -> Policy:
    """The policy `name` under `config` (validated; `PolicyConfigError` names what is wrong)."""
    assembly = ASSEMBLIES.get(name)
    if assembly is None:
        raise PolicyConfigError("policy", f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    return Policy(name, assembly, config)
