"""worker.engine: `EngineStats`' derived ratios, the empty case included."""

from __future__ import annotations

from worker.engine import EngineStats


def test_engine_stats_ratios():
    stats = EngineStats(3, 1, 25, 100, 40, 200, 150, 10, 0, 7, 2.5)
    assert (stats.kv_usage, stats.prefix_hit_rate) == (0.25, 0.75)
    empty = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0)
    assert (empty.kv_usage, empty.prefix_hit_rate) == (0.0, 0.0)
