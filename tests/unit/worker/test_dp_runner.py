"""worker.dp_engine's runner in one process (EP size 1): expert shards, Dual Batch
Overlap micro-batches, dummy steps and the communication meter never change what the
model says, and padding never touches a request's KV blocks.

With EP size 1 `agree_split` decides alone and `dbo_forward` still runs two real
micro-batch threads, so a split that cuts a prefill or a run of decodes in two is
exercised here exactly as on a DP group; `worker.model_runner.sub_batch` is checked
against the whole batch directly.
"""

from __future__ import annotations

import torch

from indexer.tokenizer import ByteTokenizer
from worker.dp_engine import CommMeter, DPMetrics, DPModelRunner, make_dp_runner
from worker.engine_core import EngineConfig, EngineCore
from worker.model_runner import sub_batch
from worker.models import ModelConfig
from worker.moe import SingleProcessBackend
from worker.moe.a2a_emulated import EmulatedLinkBackend
from worker.moe.a2a_stream import CommStreamBackend
from worker.moe.dbo import DboConfig
from worker.sampling import SamplingParams

MODEL = ModelConfig(seed=3)
CONFIG = EngineConfig(block_size=8, num_blocks=64, enable_prefix_caching=False)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# Decodes split at 2 tokens, prefills at 3: almost every step runs as two micro-batches.
DBO = DboConfig(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=3)


def prompts() -> list[list[int]]:
    return [list(f"Prompt number {i} says {'hello ' * (i + 1)}".encode()) for i in range(4)]


def dp_core(dbo: DboConfig, backend=None) -> tuple[EngineCore, DPMetrics]:
    metrics = DPMetrics()
    meter = CommMeter(backend or SingleProcessBackend())
    core = EngineCore(CONFIG, MODEL, eos_token_id=ByteTokenizer.EOS_ID, make_runner=make_dp_runner(meter, dbo, metrics))
    return core, metrics


def sample_value(metrics: DPMetrics, name: str, labels: dict[str, str] | None = None) -> float:
    for family in (metrics.steps, metrics.batching, metrics.comm, metrics.compute):
        for metric in family.collect():
            for sample in metric.samples:
                if sample.name == name and sample.labels == (labels or {}):
                    return sample.value
    raise AssertionError(f"no sample {name} {labels}")


def test_microbatched_steps_give_the_single_process_tokens():
    want = EngineCore(CONFIG, MODEL, eos_token_id=ByteTokenizer.EOS_ID).generate(prompts(), GREEDY)
    core, metrics = dp_core(DBO)
    assert isinstance(core.runner, DPModelRunner)
    assert core.generate(prompts(), GREEDY) == want
    # 4 prompts batched: one prefill step, then 9 decode steps of 4 tokens, all split.
    assert sample_value(metrics, "kvgate_worker_dbo_steps_total", {"batching": "microbatched"}) == 10
    assert sample_value(metrics, "kvgate_worker_dbo_steps_total", {"batching": "plain"}) == 0
    assert sample_value(metrics, "kvgate_worker_dp_steps_total", {"kind": "real"}) == 10


def test_plain_ep_steps_give_the_single_process_tokens():
    want = EngineCore(CONFIG, MODEL, eos_token_id=ByteTokenizer.EOS_ID).generate(prompts()[:2], GREEDY)
    core, metrics = dp_core(DboConfig())
    assert core.generate(prompts()[:2], GREEDY) == want
    assert sample_value(metrics, "kvgate_worker_dbo_steps_total", {"batching": "plain"}) == 10
    assert sample_value(metrics, "kvgate_worker_dbo_steps_total", {"batching": "microbatched"}) == 0


def test_sub_batches_run_in_order_equal_the_whole_batch():
    """Cuts inside a prefill, plus padding: every real token's hidden state is unchanged."""
    core, _ = dp_core(DboConfig())
    runner = core.runner
    for i, prompt in enumerate(prompts()[:3]):
        core.add_request(f"r{i}", prompt, GREEDY)
    step = core.scheduler.schedule()
    with torch.inference_mode():
        inputs = runner.prepare(step, core.pool)
        whole = runner.forward(inputs)
        num_tokens = inputs.input_ids.shape[0]
        for cut in (1, 13, num_tokens // 2, num_tokens - 1):
            first = sub_batch(inputs, 0, cut, 0, runner.pad_block)
            second = sub_batch(inputs, cut, num_tokens, 3, runner.pad_block)
            parts = [runner.model(p.input_ids, p.positions, runner.kv_caches, p.meta) for p in (first, second)]
            assert parts[1].shape[0] == num_tokens - cut + 3
            got = torch.cat([parts[0], parts[1][: num_tokens - cut]])
            assert torch.allclose(got, whole, atol=1e-5), cut


def test_a_dummy_step_touches_only_the_scratch_block():
    core, metrics = dp_core(DBO)
    core.generate(prompts()[:1], GREEDY)
    runner = core.runner
    before = [k[: runner.num_blocks].clone() for k, _ in runner.kv_caches]
    runner.dummy_step()
    runner.dummy_step()
    after = [k[: runner.num_blocks] for k, _ in runner.kv_caches]
    assert all(torch.equal(b, a) for b, a in zip(before, after))
    assert runner.kv_caches[0][0].shape[0] == CONFIG.num_blocks + 1
    assert sample_value(metrics, "kvgate_worker_dp_steps_total", {"kind": "dummy"}) == 2
    # Alone, a dummy votes to split (it never vetoes), so it runs as micro-batches.
    assert sample_value(metrics, "kvgate_worker_dbo_steps_total", {"batching": "microbatched"}) >= 2


def test_the_meter_charges_time_blocked_on_the_link():
    latency_s = 0.004
    core, metrics = dp_core(DboConfig(), EmulatedLinkBackend(SingleProcessBackend(), latency_s=latency_s))
    core.runner.dummy_step()
    # Per MoE layer: the count exchange sleeps `latency_s`, and so does each transfer's wait.
    comm_s = sample_value(metrics, "kvgate_worker_step_comm_seconds_sum")
    assert comm_s >= MODEL.num_layers * 2 * latency_s
    assert sample_value(metrics, "kvgate_worker_step_comm_seconds_count") == 1
    assert sample_value(metrics, "kvgate_worker_step_compute_seconds_count") == 1
    assert core.runner.meter.take() == 0.0


def test_the_meter_charges_the_stream_path_and_keeps_tokens_exact():
    # The worker's stack: meter over a communication stream over the link. A dispatch
    # starts through `start_all_to_all_v`; its counts and rows are charged when waited on.
    latency_s = 0.004
    link = EmulatedLinkBackend(SingleProcessBackend(), latency_s=latency_s)
    core, metrics = dp_core(DBO, CommStreamBackend(link))
    reference = EngineCore(CONFIG, MODEL, eos_token_id=ByteTokenizer.EOS_ID)
    assert core.generate(prompts(), GREEDY) == reference.generate(prompts(), GREEDY)
    assert sample_value(metrics, "kvgate_worker_step_comm_seconds_sum") >= latency_s
    handle = core.runner.meter.start_all_to_all_v(torch.ones(3, 2), [3])
    assert handle.recv_counts() == [3] and handle.wait().shape == (3, 2)
    core.runner.meter.inner.close()
