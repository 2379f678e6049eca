"""worker.sampling: greedy, temperature, top-k, top-p, seeds and parameter checks, exactly."""

from __future__ import annotations

from array import array

import pytest
import torch

from worker.api import GenerateRequest
from worker.sampling import Sampler, SamplingParams, sampling_params

LOGITS = torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.15]]))  # probabilities 0.05, 0.5, 0.3, 0.15


def draws(params: SamplingParams, n: int = 400) -> set[int]:
    sampler = Sampler(seed=0)
    return {sampler.sample(LOGITS, [params], [None])[0] for _ in range(n)}


def test_greedy_takes_the_argmax_per_row():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    assert Sampler().sample(logits, [greedy, greedy], [None, None]) == [1, 0]
    assert Sampler().sample(logits, [SamplingParams(top_k=1)] * 2, [None, None]) == [1, 0]


def test_top_k_top_p_and_temperature_restrict_the_draws():
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {1, 2}
    assert draws(SamplingParams(temperature=1.0, top_p=0.7)) == {1, 2}  # 0.5 < 0.7 <= 0.8
    assert draws(SamplingParams(temperature=1.0, top_p=0.5)) == {1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.9, top_k=3)) == {1, 2, 3}
    assert draws(SamplingParams(temperature=0.01)) == {1}


def test_a_seeded_request_draws_the_same_tokens_whatever_else_is_drawn():
    params = SamplingParams(temperature=1.0, seed=5)
    runs = []
    for noise in range(3):
        sampler = Sampler(seed=noise)
        generator = Sampler.new_generator(params)
        unseeded = SamplingParams(temperature=1.0)
        rows = [sampler.sample(LOGITS.repeat(2, 1), [unseeded, params], [None, generator])[1] for _ in range(20)]
        runs.append(rows)
    assert runs[0] == runs[1] == runs[2]
    assert Sampler.new_generator(SamplingParams(temperature=0.0, seed=5)) is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature must be in"),
        ("top_p", 0.0, "top_p must be in"),
        ("top_k", -2, "top_k must be an integer >= -1"),
        ("max_tokens", 0, "max_tokens must be an integer >= 1"),
        ("seed", 2**64, "seed must be in"),
        ("stop_token_ids", (-1,), "stop_token_ids must be non-negative"),
    ],
)
def test_invalid_params_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_params_of_a_parsed_request():
    request = GenerateRequest(
        "r", "completion", "m", array("I", [1, 2]), max_tokens=7, ignore_eos=True, seed=3, temperature=0.5, top_p=0.8,
        top_k=5, stop_token_ids=(4, 2),
    )
    assert sampling_params(request) == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.8, top_k=5, seed=3, ignore_eos=True, stop_token_ids=(4, 2)
    )
