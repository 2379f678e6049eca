"""worker.api: every request field's validation, typed errors, exact response JSON."""

from __future__ import annotations

import json
import math

import pytest

from indexer.tokenizer import ByteTokenizer
from worker.api import (
    SSE_DONE,
    EngineUnavailable,
    GenerateRequest,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    ServedModel,
    Usage,
    chunk_body,
    parse_chat,
    parse_completion,
    response_body,
    sse_event,
    usage_chunk_body,
)

TOK = ByteTokenizer()
SERVED = ServedModel("sim-model", TOK, 64)
BOS = ByteTokenizer.BOS_ID
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
CHAT_IDS = list(TOK.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"))


def ids(text: str) -> list[int]:
    return list(TOK.encode(text))


# -- parsing: accepted bodies ---------------------------------------------------------


def test_completion_defaults():
    request = parse_completion({"model": "sim-model", "prompt": "hi"}, SERVED)
    assert request.request_id.startswith("cmpl-") and len(request.request_id) == 5 + 32
    assert (request.kind, request.model) == ("completion", "sim-model")
    assert list(request.prompt_token_ids) == [BOS, *ids("hi")]
    assert request.max_tokens == 16  # OpenAI's completions default
    assert request.stop == () and request.seed is None
    assert (request.ignore_eos, request.stream, request.include_usage) == (False, False, False)
    assert (request.temperature, request.top_p) == (1.0, 1.0)


def test_chat_defaults_to_the_rest_of_the_context():
    request = parse_chat(CHAT, SERVED)
    assert request.request_id.startswith("chatcmpl-")
    assert list(request.prompt_token_ids) == CHAT_IDS
    assert request.max_tokens == 64 - len(CHAT_IDS)
    assert request.model == "sim-model"  # model may be left out


def test_completion_default_is_capped_by_the_context():
    prompt = "x" * 60  # 61 tokens with the BOS: room for 3
    assert parse_completion({"prompt": prompt}, SERVED).max_tokens == 3


def test_every_option_is_read():
    body = {
        "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0, "top_p": 0.5, "n": 1, "stream": True,
        "stream_options": {"include_usage": True}, "stop": ["ab", "cd", "ab"], "seed": -7,
        "ignore_eos": True, "user": "u1", "echo": False, "logprobs": None, "best_of": 1,
        "kv_transfer_params": {"anything": [1]}, "unknown_field": {"x": 1},
        "top_k": 20, "stop_token_ids": [7, 9, 7],
    }
    request = parse_completion(body, SERVED)
    assert list(request.prompt_token_ids) == [1, 2, 3]
    assert (request.top_k, request.stop_token_ids) == (20, (7, 9))
    assert (request.max_tokens, request.temperature, request.top_p, request.seed) == (5, 0.0, 0.5, -7)
    assert request.stop == ("ab", "cd")  # de-duplicated, order kept
    assert (request.stream, request.include_usage, request.ignore_eos) == (True, True, True)


def test_a_single_stop_string_and_nulls():
    body = {**CHAT, "stop": "\n", "max_tokens": None, "temperature": None, "stream_options": None}
    request = parse_chat(body, SERVED)
    assert request.stop == ("\n",) and request.max_tokens == 64 - len(CHAT_IDS) and request.temperature == 1.0


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse_chat({**CHAT, "max_tokens": 3, "max_completion_tokens": 7}, SERVED).max_tokens == 7
    assert parse_chat({**CHAT, "max_tokens": 3}, SERVED).max_tokens == 3


def test_router_token_ids_replace_tokenization():
    completion = parse_completion({"prompt_token_ids": [5, 6, 7]}, SERVED)  # no prompt needed
    assert list(completion.prompt_token_ids) == [5, 6, 7]
    chat = parse_chat({"messages": "never read", "prompt_token_ids": [9]}, SERVED)
    assert list(chat.prompt_token_ids) == [9]


def test_max_tokens_exactly_filling_the_context_is_accepted():
    request = parse_completion({"prompt_token_ids": [1] * 60, "max_tokens": 4}, SERVED)
    assert request.num_prompt_tokens + request.max_tokens == SERVED.max_model_len


# -- parsing: refused bodies ----------------------------------------------------------

BAD_COMPLETIONS = [
    ([], None, "must be a JSON object"),
    ({"prompt": "a", "model": 5}, "model", "model must be a string"),
    ({}, "prompt", "prompt is required"),
    ({"prompt": 5}, "prompt", "prompt must be a string or a list of token ids"),
    ({"prompt": []}, "prompt", "prompt is empty"),
    ({"prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
    ({"prompt": [1, "a"]}, "prompt", "batched prompts"),
    ({"prompt": [1, 2.5]}, "prompt", "prompt token ids must be integers"),
    ({"prompt": [260]}, "prompt", "token id 260 is out of range [0, 260)"),
    ({"prompt": "\ud800"}, "prompt", "not valid Unicode"),
    ({"prompt_token_ids": []}, "prompt_token_ids", "non-empty list of integers"),
    ({"prompt_token_ids": "abc"}, "prompt_token_ids", "non-empty list of integers"),
    ({"prompt_token_ids": [1, True]}, "prompt_token_ids", "non-empty list of integers"),
    ({"prompt_token_ids": [1.0]}, "prompt_token_ids", "non-empty list of integers"),
    ({"prompt_token_ids": [-1]}, "prompt_token_ids", "token ids must be integers in [0, 2**32)"),
    ({"prompt_token_ids": [999]}, "prompt_token_ids", "token id 999 is out of range"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens", "max_tokens must be >= 1, got -1"),
    ({"prompt": "a", "max_tokens": 2.0}, "max_tokens", "max_tokens must be an integer"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens", "max_tokens must be an integer"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens", "max_tokens must be an integer"),
    ({"prompt": "a", "temperature": -0.1}, "temperature", "temperature must be in [0.0, 2.0], got -0.1"),
    ({"prompt": "a", "temperature": 2.5}, "temperature", "temperature must be in [0.0, 2.0]"),
    ({"prompt": "a", "temperature": "1"}, "temperature", "temperature must be a number"),
    ({"prompt": "a", "temperature": math.nan}, "temperature", "temperature must be a number"),
    ({"prompt": "a", "temperature": math.inf}, "temperature", "temperature must be a number"),
    ({"prompt": "a", "top_p": 0}, "top_p", "top_p must be in (0.0, 1.0], got 0"),
    ({"prompt": "a", "top_p": 1.01}, "top_p", "top_p must be in (0.0, 1.0]"),
    ({"prompt": "a", "top_p": False}, "top_p", "top_p must be a number"),
    ({"prompt": "a", "top_k": -2}, "top_k", "top_k must be >= -1, got -2"),
    ({"prompt": "a", "top_k": 1.5}, "top_k", "top_k must be an integer"),
    ({"prompt": "a", "stop_token_ids": [1, 260]}, "stop_token_ids", "token ids in [0, 260)"),
    ({"prompt": "a", "stop_token_ids": 5}, "stop_token_ids", "must be a list"),
    ({"prompt": "a", "n": 2}, "n", "only n=1 is supported"),
    ({"prompt": "a", "n": 0}, "n", "n must be >= 1, got 0"),
    ({"prompt": "a", "n": "1"}, "n", "n must be an integer"),
    ({"prompt": "a", "stream": "true"}, "stream", "stream must be a boolean"),
    ({"prompt": "a", "stream": 1}, "stream", "stream must be a boolean"),
    ({"prompt": "a", "stream": True, "stream_options": []}, "stream_options", "must be an object"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": "y"}}, "stream_options", "include_usage"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"prompt": "a", "stop": ""}, "stop", "stop must be a non-empty string or a list of them"),
    ({"prompt": "a", "stop": ["x", ""]}, "stop", "stop must be a non-empty string"),
    ({"prompt": "a", "stop": [1]}, "stop", "stop must be a non-empty string"),
    ({"prompt": "a", "stop": 5}, "stop", "stop must be a non-empty string"),
    ({"prompt": "a", "stop": [str(i) for i in range(17)]}, "stop", "stop holds 17 strings, at most 16"),
    ({"prompt": "a", "seed": 1.5}, "seed", "seed must be an integer"),
    ({"prompt": "a", "seed": 2**64}, "seed", "seed must be in [-9223372036854775808, 18446744073709551615]"),
    ({"prompt": "a", "ignore_eos": "no"}, "ignore_eos", "ignore_eos must be a boolean"),
    ({"prompt": "a", "echo": True}, "echo", "echo=True is not supported"),
    ({"prompt": "a", "logprobs": 1}, "logprobs", "logprobs=1 is not supported"),
    ({"prompt": "a", "best_of": 2}, "best_of", "best_of=2 is not supported"),
    ({"prompt": "a", "suffix": "x"}, "suffix", "suffix='x' is not supported"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_COMPLETIONS)
def test_bad_completion_fields(body, param, message):
    with pytest.raises(InvalidRequest) as info:
        parse_completion(body, SERVED)
    assert info.value.status == 400 and info.value.param == param
    assert message in info.value.message


BAD_CHATS = [
    ({}, "messages", "messages is required"),
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0].content must be a string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages", "must be a part of type 'text'"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be >= 1"),
    ({**CHAT, "max_completion_tokens": 5, "max_tokens": "5"}, "max_tokens", "max_tokens must be an integer"),
    ({**CHAT, "logprobs": True}, "logprobs", "logprobs=True is not supported"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs", "top_logprobs=2 is not supported"),
    ({**CHAT, "n": 3}, "n", "only n=1 is supported"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_CHATS)
def test_bad_chat_fields(body, param, message):
    with pytest.raises(InvalidRequest) as info:
        parse_chat(body, SERVED)
    assert info.value.param == param and message in info.value.message


def test_unknown_model_is_404():
    with pytest.raises(ModelNotFound) as info:
        parse_chat({**CHAT, "model": "gpt-4"}, SERVED)
    assert info.value.status == 404 and info.value.param == "model"
    assert info.value.body() == {
        "error": {
            "message": "model 'gpt-4' is not served here (this worker serves 'sim-model')",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found",
        }
    }


def test_prompt_that_leaves_no_room_is_400_context_length_exceeded():
    with pytest.raises(InvalidRequest) as info:
        parse_completion({"prompt_token_ids": [1] * 64}, SERVED)
    assert (info.value.param, info.value.code) == ("prompt", "context_length_exceeded")
    assert info.value.message.startswith("the prompt has 64 tokens; this model's maximum context length is 64")
    with pytest.raises(InvalidRequest) as info:
        parse_chat({"messages": [{"role": "user", "content": "x" * 100}]}, SERVED)
    assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")


def test_max_tokens_beyond_the_context_is_400():
    with pytest.raises(InvalidRequest) as info:
        parse_completion({"prompt_token_ids": [1] * 60, "max_tokens": 5}, SERVED)
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    assert "the prompt has 60 and max_tokens asks for 5" in info.value.message


def test_error_classes_map_to_statuses_and_types():
    assert [(e.status, e.error_type, e.code) for e in (PayloadTooLarge("x"), EngineUnavailable("y"))] == [
        (413, "invalid_request_error", "payload_too_large"),
        (503, "service_unavailable_error", "engine_unavailable"),
    ]
    assert InvalidRequest("bad", param="p", code="c").body() == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "p", "code": "c"}
    }


# -- response formatting --------------------------------------------------------------


def request(kind: str, *, include_usage: bool = False) -> GenerateRequest:
    return GenerateRequest(
        request_id="rid", kind=kind, model="sim-model", prompt_token_ids=TOK.encode("p"), max_tokens=4,
        stream=include_usage, include_usage=include_usage, created=1700000000,
    )


USAGE = Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=8)
USAGE_JSON = {
    "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13, "prompt_tokens_details": {"cached_tokens": 8}
}


def test_completion_response():
    assert response_body(request("completion"), "abc", "length", USAGE) == {
        "id": "rid", "object": "text_completion", "created": 1700000000, "model": "sim-model",
        "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}],
        "usage": USAGE_JSON,
    }


def test_chat_response():
    assert response_body(request("chat"), "abc", "stop", USAGE) == {
        "id": "rid", "object": "chat.completion", "created": 1700000000, "model": "sim-model",
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "abc"}, "logprobs": None, "finish_reason": "stop",
        }],
        "usage": USAGE_JSON,
    }


def test_completion_chunks():
    head = {"id": "rid", "object": "text_completion", "created": 1700000000, "model": "sim-model"}
    assert chunk_body(request("completion"), "ab", None) == {
        **head, "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}]
    }
    with_usage = chunk_body(request("completion", include_usage=True), "", "length")
    assert with_usage == {
        **head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}], "usage": None
    }
    assert usage_chunk_body(request("completion", include_usage=True), USAGE) == {
        **head, "choices": [], "usage": USAGE_JSON
    }


def test_chat_chunks():
    head = {"id": "rid", "object": "chat.completion.chunk", "created": 1700000000, "model": "sim-model"}
    assert chunk_body(request("chat"), "", None, role=True) == {
        **head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]
    }
    assert chunk_body(request("chat", include_usage=True), "x", "stop") == {
        **head, "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": "stop"}],
        "usage": None,
    }
    assert usage_chunk_body(request("chat", include_usage=True), USAGE) == {**head, "choices": [], "usage": USAGE_JSON}


def test_sse_framing():
    assert sse_event({"a": "é", "b": None}) == b'data: {"a":"\xc3\xa9","b":null}\n\n'
    assert json.loads(sse_event({"x": [1]})[6:]) == {"x": [1]}
    assert SSE_DONE == b"data: [DONE]\n\n"
