"""worker.prom_scrape: vLLM's and SGLang's Prometheus text read into exact LoadReports."""

import pytest

from indexer.load import LoadReport
from worker.prom_scrape import (
    SGLANG,
    USAGE_SCALE,
    VLLM,
    VLLM_CACHE_CONFIG,
    VLLM_KV_USAGE,
    EngineLoad,
    MetricsParseError,
    RankLoad,
    read_load,
    to_reports,
)

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="2000"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1234.0
"""

SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen"} 0.5
"""


def test_vllm_metrics_map_to_one_report():
    load = read_load(VLLM_TEXT)
    assert load == EngineLoad(
        kind=VLLM, ranks={0: RankLoad(3, 5, 0.25, 2000)}, block_size=16, missing=()
    )
    assert to_reports(load, "w0", 12.5) == [LoadReport(
        worker_id="w0", dp_rank=0, timestamp=12.5, num_running=3, num_waiting=5,
        num_kv_blocks_used=500, num_kv_blocks_total=2000, num_prefill_tokens=0,
    )]


def test_older_vllm_usage_name_and_unlabelled_cache_config():
    text = VLLM_TEXT.replace(VLLM_KV_USAGE, "vllm:gpu_cache_usage_perc").replace(',engine="0",num', ",num")
    load = read_load(text)
    assert load.ranks == {0: RankLoad(3, 5, 0.25, 2000)}
    assert load.missing == ()


def test_data_parallel_engines_give_one_report_per_rank():
    text = VLLM_TEXT + "\n".join([
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5',
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0',
    ]) + "\n"
    reports = to_reports(read_load(text), "w0", 1.0)
    assert [(r.dp_rank, r.num_running, r.num_waiting, r.num_kv_blocks_used, r.num_kv_blocks_total)
            for r in reports] == [(0, 3, 5, 500, 2000), (1, 1, 0, 500, 1000)]


def test_sglang_metrics_without_a_block_count_use_the_configured_one_or_the_scale():
    load = read_load(SGLANG_TEXT)
    assert load == EngineLoad(kind=SGLANG, ranks={0: RankLoad(7, 2, 0.5, None)}, block_size=None, missing=())
    configured = to_reports(load, "s0", 2.0, num_kv_blocks=300)[0]
    assert (configured.num_running, configured.num_waiting) == (7, 2)
    assert (configured.num_kv_blocks_used, configured.num_kv_blocks_total) == (150, 300)
    scaled = to_reports(load, "s0", 2.0)[0]
    assert (scaled.num_kv_blocks_used, scaled.num_kv_blocks_total) == (USAGE_SCALE // 2, USAGE_SCALE)
    assert scaled.kv_usage == 0.5


def test_missing_metrics_are_listed_and_read_as_zero():
    text = 'vllm:num_requests_running{engine="0"} 2.0\n'
    load = read_load(text)
    assert load.missing == ("vllm:num_requests_waiting", VLLM_KV_USAGE, VLLM_CACHE_CONFIG)
    report = to_reports(load, "w0", 1.0)[0]
    assert (report.num_running, report.num_waiting, report.num_kv_blocks_used) == (2, 0, 0)


def test_an_unknown_engine_is_reported_not_fatal():
    load = read_load("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n")
    assert load.kind is None
    assert load.missing == ("any vllm: or sglang: metric",)
    assert to_reports(load, "w0", 1.0) == []  # no numbers at all: no report, not a made-up zero


def test_bad_values_are_clamped_and_uncomputed_block_counts_ignored():
    text = "\n".join([
        'vllm:num_requests_running{engine="0"} -1.0',
        'vllm:num_requests_waiting{engine="0"} NaN',
        'vllm:kv_cache_usage_perc{engine="0"} 1.7',
        'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="None"} 1.0',
    ]) + "\n"
    load = read_load(text)
    assert load.block_size == 32
    assert load.ranks == {0: RankLoad(0, 0, 1.0, None)}
    report = to_reports(load, "w0", 1.0, num_kv_blocks=64)[0]
    assert (report.num_kv_blocks_used, report.num_kv_blocks_total) == (64, 64)


def test_mirrored_series_of_one_rank_are_not_added_up():
    text = 'sglang:num_running_reqs{tp_rank="0"} 4.0\nsglang:num_running_reqs{tp_rank="1"} 4.0\n'
    assert read_load(text).ranks[0].num_running == 4


def test_malformed_text_raises_a_typed_error():
    with pytest.raises(MetricsParseError):
        read_load("vllm:num_requests_running{engine=0 3\n")
