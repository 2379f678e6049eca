"""worker.engine_core: the torch engine's scheduling never changes what the model says.

Greedy outputs of the tiny model must be the same whatever the engine does around
them: a prefix-cache hit vs a cold run, chunked vs whole prefill, preempted and
recomputed vs uninterrupted, batched with others vs alone. Also: finish reasons,
stop token ids, seeded sampling and rejected requests.
"""

from __future__ import annotations

import pytest
import torch

from indexer.tokenizer import ByteTokenizer
from worker.engine_core import EngineConfig, EngineCore, RequestRejected
from worker.models import ModelConfig
from worker.sampling import SamplingParams

MODEL = ModelConfig(seed=7)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SYSTEM = list(b"You are a helpful assistant. Answer briefly and precisely. ")  # 59 tokens


def core(**config) -> EngineCore:
    return EngineCore(EngineConfig(**{"block_size": 8, "num_blocks": 256, **config}), MODEL, eos_token_id=ByteTokenizer.EOS_ID)


def prompts() -> list[list[int]]:
    return [SYSTEM + list(f"Question {i}: {'why ' * i}?".encode()) for i in range(6)]


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each prompt's greedy output, run alone in a cache-less engine."""
    engine = core(enable_prefix_caching=False)
    return [engine.generate([prompt], GREEDY)[0] for prompt in prompts()]


def test_a_batch_gives_each_request_the_same_tokens_as_alone(alone):
    engine = core(enable_prefix_caching=False)
    assert engine.generate(prompts(), GREEDY) == alone
    assert all(len(tokens) == 12 for tokens in alone)
    assert len({tuple(tokens) for tokens in alone}) > 1  # the prompts matter


def test_a_prefix_cache_hit_gives_the_same_tokens_as_a_cold_run(alone):
    engine = core()
    first = engine.add_request("first", prompts()[0], GREEDY)
    while engine.has_work():
        engine.step()
    assert first.num_cached_tokens == 0
    hit = engine.add_request("hit", prompts()[3], GREEDY)
    outputs = []
    while engine.has_work():
        outputs += [r.token_id for r in engine.step()]
    assert hit.num_cached_tokens == 64  # SYSTEM + "Question " share 68 tokens: 8 full blocks of 8
    assert outputs == alone[3]
    assert engine.scheduler.num_cached_prompt_tokens == 64


def test_chunked_prefill_gives_the_same_tokens_as_whole_prefill(alone):
    engine = core(max_num_batched_tokens=16, enable_prefix_caching=False)
    assert engine.generate(prompts(), GREEDY) == alone
    assert engine.scheduler.num_steps > 20  # every prompt took several chunks


def test_preemption_and_recompute_give_the_same_tokens(alone):
    # 20 blocks of 8 tokens: six requests growing to ~11 blocks each cannot all stay.
    engine = core(num_blocks=20, enable_prefix_caching=False)
    assert engine.generate(prompts(), GREEDY) == alone
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_used_blocks == 0


def test_max_num_seqs_caps_the_running_batch(alone):
    engine = core(max_num_seqs=2)
    for i, prompt in enumerate(prompts()):
        engine.add_request(str(i), prompt, GREEDY)
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        results = engine.step()
        assert len(engine.scheduler.running) <= 2
        for r in results:
            outputs.setdefault(r.request.request_id, []).append(r.token_id)
    assert [outputs[str(i)] for i in range(6)] == alone


def test_finish_reasons_stop_tokens_and_max_tokens(alone):
    engine = core()
    stop_at = alone[1][4]
    first_hit = alone[1].index(stop_at)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,))
    engine.add_request("stop", prompts()[1], params)
    engine.add_request("length", prompts()[2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    results: dict[str, list] = {"stop": [], "length": []}
    while engine.has_work():
        for r in engine.step():
            results[r.request.request_id].append((r.token_id, r.finish_reason))
    assert results["stop"] == [(t, None) for t in alone[1][:first_hit]] + [(stop_at, "stop")]
    assert results["length"] == [(t, None) for t in alone[2][:2]] + [(alone[2][2], "length")]


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    engine = core()
    alone_run = engine.generate([prompts()[2]], params)[0]
    others = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    batched = engine.generate([prompts()[0], prompts()[2], prompts()[4]], [others, params, others])[1]
    assert batched == alone_run
    other_seed = engine.generate([prompts()[2]], SamplingParams(**{**_fields(params), "seed": 99}))[0]
    assert other_seed != alone_run


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def test_requests_that_cannot_fit_are_rejected_and_the_engine_goes_on(alone):
    engine = core(num_blocks=16)  # 128 tokens of cache
    with pytest.raises(RequestRejected, match="prompt \\+ max_tokens = 129 exceeds the maximum context length 128"):
        engine.add_request("long", [1] * 120, SamplingParams(max_tokens=9))
    with pytest.raises(RequestRejected, match=r"prompt token ids must be in \[0, 260\)"):
        engine.add_request("vocab", [1, 260], GREEDY)
    with pytest.raises(RequestRejected, match="the prompt is empty"):
        engine.add_request("empty", [], GREEDY)
    assert engine.generate([prompts()[0]], GREEDY) == [alone[0]]


def test_abort_frees_the_request_blocks():
    engine = core()
    engine.add_request("a", prompts()[0], GREEDY)
    engine.step()
    assert engine.pool.num_used_blocks > 0
    assert engine.abort("a") and not engine.abort("a")
    assert engine.pool.num_used_blocks == 0 and not engine.has_work()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_gives_the_cpu_greedy_tokens(alone):
    engine = core(device="cuda", enable_prefix_caching=False)
    assert engine.runner.kv_caches[0][0].is_cuda
    assert engine.generate(prompts(), GREEDY) == alone
    bf16 = core(device="cuda", dtype="bfloat16")
    outputs = bf16.generate(prompts(), GREEDY)
    assert [len(tokens) for tokens in outputs] == [12] * 6
    assert bf16.generate([prompts()[0]], GREEDY)[0] == outputs[0]  # cached prefix, same tokens
