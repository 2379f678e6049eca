"""The disaggregation benchmark's figures: per round, over rounds, the targets and the table.

Owns: turning `bench.disagg_load.ClientRun`s into figures. Per round and mode: TTFT
(send to first token) p50/p99, overall and for short and long prompts; ITL (every gap
between consecutive streamed tokens of every request) p50/p99/p99.9; the remote
prefills the router announced (`x-kvgate-prefill`); the client's own lag. Per mode:
the median over rounds of each round figure (what the ratios use: a round hit by a
stall of this machine does not decide the result) and the pooled figures (every
request of every round in one distribution), both reported.

All latencies are model milliseconds: wall time x the fleet's speedup.
Callers: `bench/disagg.py`.
"""

from __future__ import annotations

import json
import statistics

from bench.disagg_load import ClientRun, Outcome
from bench.routing_measure import percentile
from worker.sim import SimConfig

TARGETS = {"itl_p99_ratio": ("min", 2.0), "ttft_p50_ratio": ("max", 1.2)}
_ROUND_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "ttft_short_p50_ms", "ttft_long_p50_ms", "itl_p50_ms", "itl_p99_ms",
               "itl_p999_ms")
# NOTE: the client keeps up iff its lags stay under half a decode step of the sim's model.
_CLIENT_LAG_BOUND_MS = SimConfig().decode_ms_per_step / 2


def model_ms(values_s: list[float], q: float, speedup: float) -> float | None:
    """The q-quantile of wall-second values, in model milliseconds; None for none."""
    return round(percentile(sorted(values_s), q) * speedup * 1e3, 2) if values_s else None


def latency_figures(outcomes: list[Outcome], speedup: float) -> dict:
    ok = [o for o in outcomes if not o.error]
    gaps = [gap for o in ok for gap in o.gaps_s()]
    ttfts = [o.ttft_s for o in ok]
    return {
        "ttft_p50_ms": model_ms(ttfts, 0.5, speedup), "ttft_p99_ms": model_ms(ttfts, 0.99, speedup),
        "ttft_short_p50_ms": model_ms([o.ttft_s for o in ok if not o.is_long], 0.5, speedup),
        "ttft_long_p50_ms": model_ms([o.ttft_s for o in ok if o.is_long], 0.5, speedup),
        "itl_p50_ms": model_ms(gaps, 0.5, speedup), "itl_p99_ms": model_ms(gaps, 0.99, speedup),
        "itl_p999_ms": model_ms(gaps, 0.999, speedup), "num_gaps": len(gaps),
    }


def client_figures(runs: list[ClientRun], speedup: float) -> dict:
    """The load generator's lag over all rounds; `is_ok` iff both p99 lags stay under the bound."""
    loop_lags = [lag for run in runs for lag in run.loop_lags_s]
    send_lags = [o.sent - o.due for run in runs for o in run.outcomes]
    figures = {
        "loop_lag_p99_ms": model_ms(loop_lags, 0.99, speedup) or 0.0,
        "loop_lag_max_ms": round(max(loop_lags, default=0.0) * speedup * 1e3, 2),
        "send_lag_p99_ms": model_ms(send_lags, 0.99, speedup) or 0.0,
        "cpu_frac": round(sum(r.cpu_s for r in runs) / sum(r.wall_s for r in runs), 3),
    }
    figures["is_ok"] = max(figures["loop_lag_p99_ms"], figures["send_lag_p99_ms"]) < _CLIENT_LAG_BOUND_MS
    return figures


def mode_figures(runs: list[ClientRun], counters: dict[str, int], speedup: float) -> dict:
    """Median over rounds (top level), pooled over rounds, per round, counters and client lag."""
    outcomes = [o for run in runs for o in run.outcomes]
    errors = [o.error for o in outcomes if o.error]
    rounds = [latency_figures(run.outcomes, speedup) for run in runs]
    medians = {}
    for key in _ROUND_KEYS:
        values = [r[key] for r in rounds if r[key] is not None]
        medians[key] = round(statistics.median(values), 2) if values else None
    return {
        **medians,
        "num_requests": len(outcomes), "num_ok": len(outcomes) - len(errors), "num_errors": len(errors),
        "first_error": errors[0] if errors else None, "num_long": sum(o.is_long for o in outcomes),
        "num_remote_header": sum(o.prefill == "remote" for o in outcomes if not o.error),
        **counters,
        "pooled": latency_figures(outcomes, speedup),
        "rounds": [{key: r[key] for key in ("ttft_p50_ms", "itl_p99_ms")} for r in rounds],
        "client": client_figures(runs, speedup),
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 3)


def targets(result: dict) -> dict:
    checks = {}
    for key, (sense, bound) in TARGETS.items():
        value = result.get(key)
        met = value is not None and (value >= bound if sense == "min" else value <= bound)
        checks[key] = {"value": value, sense: bound, "met": met}
    return checks


def json_line(result: dict) -> str:
    """The whole result as one JSON object: the bench's last printed line."""
    return json.dumps(result, allow_nan=False)


def print_table(result: dict) -> None:
    columns = ("num_ok", "num_errors", "ttft_p50_ms", "ttft_p99_ms", "ttft_short_p50_ms", "ttft_long_p50_ms",
               "itl_p50_ms", "itl_p99_ms", "num_remote", "num_fallback_deadline", "num_fallback_unqueued")
    heads = ("ok", "errors", "TTFT p50", "TTFT p99", "short p50", "long p50", "ITL p50", "ITL p99", "remote",
             "fb deadline", "fb unqueued")
    widths = [max(9, len(h) + 2) for h in heads]
    config = result["config"]
    print(f"\n{config['num_workers']} sim workers, {config['num_rounds']} rounds, {config['num_requests']} requests "
          f"({config['num_long']} of {config['long_tokens']} tokens) per mode; model ms (wall x {config['speedup']})")
    for title, pick in (("median over rounds", lambda f: f), ("pooled over rounds", lambda f: {**f, **f["pooled"]})):
        print(f"\n{title}:\n{'mode':<16}" + "".join(f"{h:>{w}}" for h, w in zip(heads, widths)))
        for mode, figures in result["modes"].items():
            row = pick(figures)
            cells = ["-" if row.get(c) is None else row[c] for c in columns]
            print(f"{mode:<16}" + "".join(f"{c!s:>{w}}" for c, w in zip(cells, widths)))
    print()
    for mode, figures in result["modes"].items():
        client = figures["client"]
        verdict = "keeps up" if client["is_ok"] else "LAGS (this machine is busy: latencies include its stalls)"
        print(f"client during {mode}: {verdict}; {client}")
    for key, check in result["targets"].items():
        print(f"target {key}: {check}")
