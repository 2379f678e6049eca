"""An engine's Prometheus text exposition, read into kvgate `LoadReport`s (pure, no I/O).

Owns the mapping from vLLM's and SGLang's metric names to the load the router scores:

| LoadReport field      | vLLM                                                    | SGLang                 |
|-----------------------|---------------------------------------------------------|------------------------|
| `num_running`         | `vllm:num_requests_running`                             | `sglang:num_running_reqs` |
| `num_waiting`         | `vllm:num_requests_waiting`                             | `sglang:num_queue_reqs`   |
| KV usage (fraction)   | `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) | `sglang:token_usage` |
| `num_kv_blocks_total` | label `num_gpu_blocks` of `vllm:cache_config_info`      | (none: the sidecar's `--num-kv-blocks`) |
| block size            | label `block_size` of `vllm:cache_config_info`          | (none: the sidecar's `--block-size`) |

`num_kv_blocks_used` is `round(usage * num_kv_blocks_total)`. When the engine does not
say how many blocks it has and none was configured, the usage is reported on a scale
of `USAGE_SCALE` blocks, so the router's `kv_usage` is still right.
`num_prefill_tokens` is 0: neither engine exports it (the router predicts it itself).

Data-parallel engines: series labelled `engine` (vLLM) or `dp_rank` give one report
per rank; unlabelled series belong to rank 0. Several series of the same rank (per
TP rank, per model name) mirror one another, so the largest value is taken.

The engine kind is told from the metric names. Names that the kind should export but
did not are listed in `EngineLoad.missing` so the caller can log them (once); a
missing name is never an error. Caller: `worker.sidecar`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from indexer.load import LoadReport

VLLM = "vllm"
SGLANG = "sglang"
USAGE_SCALE = 10_000
_RANK_LABELS = ("engine", "dp_rank")

VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"
VLLM_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
VLLM_CACHE_CONFIG = "vllm:cache_config_info"
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_WAITING = "sglang:num_queue_reqs"
SGLANG_KV_USAGE = "sglang:token_usage"

# kind -> (running, waiting, usage names in order of preference)
_NAMES = {
    VLLM: (VLLM_RUNNING, VLLM_WAITING, (VLLM_KV_USAGE, VLLM_KV_USAGE_OLD)),
    SGLANG: (SGLANG_RUNNING, SGLANG_WAITING, (SGLANG_KV_USAGE,)),
}

Samples = dict[str, list[tuple[dict[str, str], float]]]


class MetricsParseError(ValueError):
    """A body that is not Prometheus text exposition."""


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One DP rank's load as the engine exported it."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float | None = None  # fraction in [0, 1]; None: not exported
    num_kv_blocks_total: int | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What one scrape says: the engine kind, per-rank load, block size, missing names."""

    kind: str | None  # VLLM, SGLANG, or None when neither's metrics are present
    ranks: dict[int, RankLoad] = field(default_factory=dict)
    block_size: int | None = None
    missing: tuple[str, ...] = ()


def parse_samples(text: str) -> Samples:
    """Every sample of the exposition, by sample name; `MetricsParseError` if malformed."""
    samples: Samples = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name].append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"not Prometheus text: {exc}") from None
    return dict(samples)


def engine_kind(samples: Samples) -> str | None:
    if any(name.startswith("vllm:") for name in samples):
        return VLLM
    if any(name.startswith("sglang:") for name in samples):
        return SGLANG
    return None


def read_load(text: str) -> EngineLoad:
    """The load in one `/metrics` body (see the module docstring)."""
    samples = parse_samples(text)
    kind = engine_kind(samples)
    if kind is None:
        return EngineLoad(kind=None, missing=(f"any {VLLM}: or {SGLANG}: metric",))
    running_name, waiting_name, usage_names = _NAMES[kind]
    missing = [name for name in (running_name, waiting_name) if name not in samples]
    usage_name = next((name for name in usage_names if name in samples), None)
    if usage_name is None:
        missing.append(usage_names[0])
    running = _by_rank(samples.get(running_name, []))
    waiting = _by_rank(samples.get(waiting_name, []))
    usage = _by_rank(samples.get(usage_name, [])) if usage_name else {}
    block_size, blocks = None, {}
    if kind == VLLM:
        if VLLM_CACHE_CONFIG in samples:
            block_size, blocks = _cache_config(samples[VLLM_CACHE_CONFIG])
        else:
            missing.append(VLLM_CACHE_CONFIG)
    ranks = {
        rank: RankLoad(
            num_running=_count(running.get(rank)),
            num_waiting=_count(waiting.get(rank)),
            kv_usage=_fraction(usage.get(rank)),
            num_kv_blocks_total=blocks.get(rank, blocks.get(-1)),
        )
        for rank in sorted(set(running) | set(waiting) | set(usage)) or [0]
    }
    return EngineLoad(kind=kind, ranks=ranks, block_size=block_size, missing=tuple(missing))


def to_reports(
    load: EngineLoad, worker_id: str, timestamp: float, num_kv_blocks: int | None = None
) -> list[LoadReport]:
    """One `LoadReport` per rank; `num_kv_blocks` is used where the engine gave no count."""
    reports = []
    for rank, rank_load in load.ranks.items():
        total = rank_load.num_kv_blocks_total or num_kv_blocks or USAGE_SCALE
        usage = rank_load.kv_usage or 0.0
        reports.append(LoadReport(
            worker_id=worker_id, dp_rank=rank, timestamp=timestamp,
            num_running=rank_load.num_running, num_waiting=rank_load.num_waiting,
            num_kv_blocks_used=min(total, round(usage * total)), num_kv_blocks_total=total,
            num_prefill_tokens=0,
        ))
    return reports


def _rank(labels: dict[str, str]) -> int | None:
    """The DP rank a series belongs to: 0 when unlabelled, None when the label is not a rank."""
    for name in _RANK_LABELS:
        if name in labels:
            value = labels[name]
            return int(value) if value.isdigit() else None
    return 0


def _by_rank(series: list[tuple[dict[str, str], float]]) -> dict[int, float]:
    values: dict[int, float] = {}
    for labels, value in series:
        rank = _rank(labels)
        if rank is None or math.isnan(value):
            continue
        # NOTE: series of one rank mirror each other (see the module docstring).
        values[rank] = max(value, values.get(rank, value))
    return values


def _cache_config(series: list[tuple[dict[str, str], float]]) -> tuple[int | None, dict[int, int]]:
    """(block size, {rank: num_gpu_blocks}) from `vllm:cache_config_info`; rank -1: unlabelled."""
    block_size = None
    blocks: dict[int, int] = {}
    for labels, _ in series:
        size = _positive_int(labels.get("block_size"))
        block_size = block_size or size
        num_blocks = _positive_int(labels.get("num_gpu_blocks"))
        if num_blocks is None:
            continue
        rank = -1 if not any(name in labels for name in _RANK_LABELS) else _rank(labels)
        if rank is not None:
            blocks[rank] = num_blocks
    return block_size, blocks


def _positive_int(text: str | None) -> int | None:
    # vLLM writes "None" for a count it has not computed yet.
    if text is None or not text.isdigit() or int(text) == 0:
        return None
    return int(text)


def _count(value: float | None) -> int:
    if value is None or not math.isfinite(value) or value < 0:
        return 0
    return int(round(value))


def _fraction(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return min(1.0, max(0.0, value))
