"""Gateway request parsing: validation statuses, limits, tokenization, the forwarded body."""

import json
from array import array

import msgspec
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, trainers

from indexer.tokenizer import ByteTokenizer, load_tokenizer
from router.errors import BadRequest, PayloadTooLarge
from router.requests import CHAT, COMPLETIONS, DEFAULT_MAX_TOKENS, RequestLimits, parse_request
from worker.api import ServedModel, parse_chat, parse_completion

BYTES = ByteTokenizer()
LIMITS = RequestLimits()


def _parse(body, kind=COMPLETIONS, limits=LIMITS, tokenizer=BYTES, **kwargs):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(raw, kind, tokenizer, limits, **kwargs)


def test_completion_is_tokenized_and_ids_are_spliced_into_the_body():
    raw = b'{"model": "m", "prompt": "hi", "stream": true, "max_tokens": 7, "future_field": [1]}  \n'
    parsed = parse_request(raw, COMPLETIONS, BYTES, LIMITS)
    assert (parsed.kind, parsed.model, parsed.stream, parsed.max_tokens) == (COMPLETIONS, "m", True, 7)
    assert parsed.token_ids == array("I", [ByteTokenizer.BOS_ID, ord("h"), ord("i")])
    forwarded = json.loads(parsed.body)
    assert forwarded == {
        "model": "m", "prompt": "hi", "stream": True, "max_tokens": 7, "future_field": [1],
        "prompt_token_ids": [256, 104, 105],
    }
    assert parse_request(raw, COMPLETIONS, BYTES, LIMITS, forward_token_ids=False).body == raw


def test_a_clients_prompt_token_ids_are_replaced_by_the_gateways():
    parsed = _parse({"model": "m", "prompt": [5, 6], "prompt_token_ids": [1, 2, 3]})
    assert json.loads(parsed.body) == {"model": "m", "prompt": [5, 6], "prompt_token_ids": [5, 6]}


def test_chat_uses_the_default_template_and_max_completion_tokens():
    body = {"model": "m", "messages": [{"role": "user", "content": "yo"}], "max_tokens": 3, "max_completion_tokens": 9}
    parsed = _parse(body, CHAT)
    prompt = "<|im_start|>user\nyo<|im_end|>\n<|im_start|>assistant\n"
    assert parsed.token_ids == BYTES.encode(prompt)
    assert parsed.max_tokens == 9
    assert not parsed.stream
    assert _parse({"model": "m", "messages": [{"role": "user", "content": "yo"}]}, CHAT).max_tokens == DEFAULT_MAX_TOKENS[CHAT]


BAD = [
    (b'{"model": "m", "prompt": "x"', "malformed JSON", None),
    (b"\xff\xfe", "malformed JSON", None),
    (b'{"model": "m", "\x9bprompt": "x"}', "not valid UTF-8", None),
    (b"[1, 2]", "must be a JSON object", None),
    (b"[" * 5000 + b"]" * 5000, None, None),
    (b'{"model": "m", "prompt": "x", "max_tokens": 1e999}', "malformed JSON", None),
    ({"prompt": "x"}, "'model'", "model"),
    ({"model": "", "prompt": "x"}, "'model'", "model"),
    ({"model": 3, "prompt": "x"}, "'model'", "model"),
    ({"model": "m"}, "'prompt' is required", "prompt"),
    ({"model": "m", "prompt": []}, "prompt is empty", "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "batched", "prompt"),
    ({"model": "m", "prompt": [1, -1]}, "token ids", "prompt"),
    ({"model": "m", "prompt": [1, 999]}, "out of range", "prompt"),
    ({"model": "m", "prompt": {"a": 1}}, "prompt must be", "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": -1}, "at least 1", "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "at least 1", "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": "5"}, "integer", "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 5.0}, "integer", "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "integer", "max_tokens"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "boolean", "stream"),
    ({"model": "m", "prompt": "x", "stream_options": []}, "object", "stream_options"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": 1}}, "boolean", "stream_options"),
    ({"model": "m", "prompt": "x", "temperature": -0.1}, r"\[0, 2\]", "temperature"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "number", "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, r"\(0, 1\]", "top_p"),
    ({"model": "m", "prompt": "x", "top_p": 1.5}, r"\(0, 1\]", "top_p"),
    ({"model": "m", "prompt": "x", "presence_penalty": 3}, "presence_penalty", "presence_penalty"),
    ({"model": "m", "prompt": "x", "n": 2}, "'n' must be 1", "n"),
    ({"model": "m", "prompt": "x", "stop": 5}, "'stop'", "stop"),
    ({"model": "m", "prompt": "x", "stop": ["a"] * 17}, "at most 16", "stop"),
    ({"model": "m", "prompt": "x", "seed": 1.5}, "'seed'", "seed"),
    ({"model": "m", "prompt": "x", "ignore_eos": "no"}, "'ignore_eos'", "ignore_eos"),
    ({"model": "m", "prompt": "x", "user": 7}, "'user'", "user"),
]


@pytest.mark.parametrize(("body", "message", "param"), BAD)
def test_bad_completion_bodies_are_400_naming_the_field(body, message, param):
    with pytest.raises(BadRequest, match=message) as caught:
        _parse(body)
    assert caught.value.status == 400
    assert caught.value.param == param
    error = msgspec.json.decode(caught.value.to_body())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty list"),
        (None, "'messages' is required"),
        ([{"role": "wizard", "content": "x"}], "role"),
        ([{"role": "user", "content": 5}], "content"),
        (["hello"], "must be an object"),
    ],
)
def test_bad_chat_messages_are_400(messages, message):
    body = {"model": "m"} if messages is None else {"model": "m", "messages": messages}
    with pytest.raises(BadRequest, match=message) as caught:
        _parse(body, CHAT)
    assert caught.value.param == "messages"


def test_negative_max_completion_tokens_is_400():
    with pytest.raises(BadRequest, match="max_completion_tokens"):
        _parse({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}, CHAT)


def test_prompt_over_the_token_limit_is_413():
    limits = RequestLimits(max_prompt_tokens=10)
    assert len(_parse({"model": "m", "prompt": "x" * 9}, limits=limits).token_ids) == 10  # BOS + 9 bytes
    with pytest.raises(PayloadTooLarge, match="11 tokens, over the limit of 10") as caught:
        _parse({"model": "m", "prompt": "x" * 10}, limits=limits)
    assert (caught.value.status, caught.value.code, caught.value.param) == (413, "prompt_too_long", "prompt")
    with pytest.raises(PayloadTooLarge) as caught:
        _parse({"model": "m", "messages": [{"role": "user", "content": "x" * 20}]}, CHAT, limits=limits)
    assert caught.value.param == "messages"


def _bpe(tmp_path):
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    backend.train_from_iterator(["routing requests to the worker that holds the prefix"] * 10, trainer=trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    return load_tokenizer(str(tmp_path / "tokenizer.json"))


@pytest.mark.parametrize("tokenizer_kind", ["byte", "bpe"])
def test_router_and_worker_tokenize_identically(tmp_path, tokenizer_kind):
    tokenizer = BYTES if tokenizer_kind == "byte" else _bpe(tmp_path)
    served = ServedModel("m", tokenizer, 100_000)
    completion = {"model": "m", "prompt": "routing requests to the worker, héllo <|im_start|> ✓"}
    chat = {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "the prefix"}, {"type": "text", "text": "holds"}]},
    ]}
    router_ids = _parse(completion, tokenizer=tokenizer).token_ids
    assert router_ids == parse_completion(completion, served).prompt_token_ids
    assert _parse(chat, CHAT, tokenizer=tokenizer).token_ids == parse_chat(chat, served).prompt_token_ids
    # And the forwarded ids are what the worker then uses as is.
    forwarded = json.loads(_parse(completion, tokenizer=tokenizer).body)
    assert parse_completion(forwarded, served).prompt_token_ids == router_ids


def test_limits_are_validated():
    with pytest.raises(ValueError):
        RequestLimits(max_body_bytes=10)
    with pytest.raises(ValueError):
        RequestLimits(max_prompt_tokens=0)
