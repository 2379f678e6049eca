"""The OpenAI wire format of kvgate workers: request validation, errors, response JSON.

Owns what every worker engine (the simulated one now, the torch one later) shares
between HTTP and its scheduler:

- typed `ApiError`s, each with its HTTP status and OpenAI error type, and the one
  error body `{"error": {"message", "type", "param", "code"}}`;
- `ServedModel` (what requests are validated against) and `parse_completion` /
  `parse_chat`: an OpenAI body -> a validated `GenerateRequest` (token ids, output
  limit, stop strings, stream options), what engines receive;
- the JSON of responses, streamed chunks and the final usage chunk.

Callers: `worker/server.py` (parsing, formatting), `worker/engine.py` and the engines
(`GenerateRequest`, `ServedModel`, `EngineUnavailable`). Output text (detokenization,
stop strings) is `worker/text.py`.
Pure: no I/O, no aiohttp, no clock except a request's `created` stamp.

Invariants:
- a parsed request always fits its model: prompt + `max_tokens` <= `max_model_len`,
  and the prompt is not empty; engines may rely on it.
- every field is checked for type and range; a bad one raises `InvalidRequest` naming
  it in `param`. Unknown fields are ignored, as OpenAI-compatible servers do.
- `prompt_token_ids` (kvgate's router extension) replaces tokenization when present:
  `prompt` / `messages` are then neither required nor read.
"""

from __future__ import annotations

import math
import time
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from indexer.chat_template import ChatTemplateError, render_and_encode
from indexer.tokenizer import Tokenizer, TokenizerError, check_token_ids, prompt_ids

RequestKind = Literal["completion", "chat"]
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
SSE_DONE = b"data: [DONE]\n\n"

_encode = msgspec.json.Encoder().encode


class ApiError(Exception):
    """A client-facing failure: HTTP status, OpenAI error type, message, param, code."""

    status = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequest(ApiError):
    status = 400
    error_type = "invalid_request_error"


class ModelNotFound(ApiError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class PayloadTooLarge(ApiError):
    status = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class EngineUnavailable(ApiError):
    status = 503
    error_type = "service_unavailable_error"
    code = "engine_unavailable"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# -- what engines receive ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What requests are validated against: the model's name, tokenizer and context."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int


@dataclass(slots=True)
class GenerateRequest:
    """One validated request, as engines receive it."""

    request_id: str
    kind: RequestKind
    model: str
    prompt_token_ids: array
    max_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off (vLLM's extension, as are stop_token_ids)
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # Disaggregation: the router asks for a remote prefill ("kv_transfer_params":
    # {"do_remote_prefill": true}); `hold_blocks` is set by a prefill worker's own loop.
    remote_prefill: bool = False
    hold_blocks: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


# -- parsing -------------------------------------------------------------------------


def parse_completion(body: Any, served: ServedModel) -> GenerateRequest:
    """A `/v1/completions` body -> a validated request (raises `ApiError`)."""
    body = _check_body(body, served)
    _check_unsupported(body, echo=False, logprobs=None, best_of=1, suffix=None)
    token_ids = _router_ids(body, served)
    if token_ids is None:
        if "prompt" not in body:
            raise InvalidRequest("prompt is required", param="prompt")
        try:
            token_ids = prompt_ids(served.tokenizer, body["prompt"])
        except TokenizerError as exc:
            raise InvalidRequest(str(exc), param="prompt") from None
    max_tokens = _int(body, "max_tokens", 1)
    return _build("completion", "cmpl", body, served, token_ids, max_tokens, "prompt")


def parse_chat(body: Any, served: ServedModel) -> GenerateRequest:
    """A `/v1/chat/completions` body -> a validated request (raises `ApiError`)."""
    body = _check_body(body, served)
    _check_unsupported(body, logprobs=False, top_logprobs=None)
    token_ids = _router_ids(body, served)
    if token_ids is None:
        if "messages" not in body:
            raise InvalidRequest("messages is required", param="messages")
        try:
            token_ids = render_and_encode(served.tokenizer, body["messages"])
        except (ChatTemplateError, TokenizerError) as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        if not token_ids:
            raise InvalidRequest("messages render to an empty prompt", param="messages")
    max_tokens, max_completion_tokens = _int(body, "max_tokens", 1), _int(body, "max_completion_tokens", 1)
    if max_completion_tokens is not None:
        max_tokens = max_completion_tokens  # the newer name wins, as in OpenAI's API
    return _build("chat", "chatcmpl", body, served, token_ids, max_tokens, "messages")


def _check_body(body: Any, served: ServedModel) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", param="model")
    if model is not None and model != served.name:
        raise ModelNotFound(f"model {model!r} is not served here (this worker serves {served.name!r})", param="model")
    return body


def _check_unsupported(body: dict[str, Any], **allowed: Any) -> None:
    """Fields this worker cannot honour must be absent, null or their neutral value."""
    for name, neutral in allowed.items():
        value = body.get(name)
        if value is not None and not (value == neutral and type(value) is type(neutral)):
            raise InvalidRequest(f"{name}={value!r} is not supported by this worker", param=name)
    n = _int(body, "n", 1)
    if n not in (None, 1):
        raise InvalidRequest("only n=1 is supported", param="n")


def _router_ids(body: dict[str, Any], served: ServedModel) -> array | None:
    value = body.get("prompt_token_ids")
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(type(v) is int for v in value):
        raise InvalidRequest("prompt_token_ids must be a non-empty list of integers", param="prompt_token_ids")
    try:
        return check_token_ids(value, served.tokenizer.vocab_size)
    except TokenizerError as exc:
        raise InvalidRequest(str(exc), param="prompt_token_ids") from None


def _build(
    kind: RequestKind,
    id_prefix: str,
    body: dict[str, Any],
    served: ServedModel,
    token_ids: array,
    max_tokens: int | None,
    prompt_param: str,
) -> GenerateRequest:
    stream = _bool(body, "stream")
    num_room = served.max_model_len - len(token_ids)
    if num_room < 1:
        raise InvalidRequest(
            f"the prompt has {len(token_ids)} tokens; this model's maximum context length is "
            f"{served.max_model_len} tokens, prompt and output together",
            param=prompt_param, code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, num_room) if kind == "completion" else num_room
    elif max_tokens > num_room:
        raise InvalidRequest(
            f"this model's maximum context length is {served.max_model_len} tokens; the prompt has "
            f"{len(token_ids)} and max_tokens asks for {max_tokens}",
            param="max_tokens", code="context_length_exceeded",
        )
    return GenerateRequest(
        request_id=f"{id_prefix}-{uuid.uuid4().hex}",
        kind=kind,
        model=served.name,
        prompt_token_ids=token_ids,
        max_tokens=max_tokens,
        stop=_stop(body),
        ignore_eos=_bool(body, "ignore_eos"),
        seed=_int(body, "seed", -(2**63), 2**64 - 1),
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0, low_open=False),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0, low_open=True),
        top_k=_int(body, "top_k", -1) or 0,
        stop_token_ids=_stop_token_ids(body, served.tokenizer.vocab_size),
        stream=stream,
        include_usage=_include_usage(body, stream),
        remote_prefill=_remote_prefill(body),
    )


def _remote_prefill(body: dict[str, Any]) -> bool:
    params = body.get("kv_transfer_params")
    if params is None:
        return False
    if not isinstance(params, dict):
        raise InvalidRequest("kv_transfer_params must be an object", param="kv_transfer_params")
    return _bool(params, "do_remote_prefill")


def _int(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise InvalidRequest(f"{name} must be an integer", param=name)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequest(f"{name} must be {bound}, got {value}", param=name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float, default: float, *, low_open: bool) -> float:
    value = body.get(name)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a number", param=name)
    if value > high or value < low or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise InvalidRequest(f"{name} must be in {bound}, got {value}", param=name)
    return float(value)


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if type(value) is not bool:
        raise InvalidRequest(f"{name} must be a boolean", param=name)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("stop must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop holds {len(stops)} strings, at most {MAX_STOP_STRINGS} allowed", param="stop")
    return tuple(dict.fromkeys(stops))


def _stop_token_ids(body: dict[str, Any], vocab_size: int) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(type(t) is int and 0 <= t < vocab_size for t in value):
        raise InvalidRequest(f"stop_token_ids must be a list of token ids in [0, {vocab_size})", param="stop_token_ids")
    if len(value) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"stop_token_ids holds {len(value)} ids, at most {MAX_STOP_STRINGS} allowed", param="stop_token_ids"
        )
    return tuple(dict.fromkeys(value))


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object", param="stream_options")
    if not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    value = options.get("include_usage")
    if value is not None and type(value) is not bool:
        raise InvalidRequest("stream_options.include_usage must be a boolean", param="stream_options")
    return bool(value)


# -- responses -----------------------------------------------------------------------


def _head(request: GenerateRequest, object_name: str) -> dict[str, Any]:
    return {"id": request.request_id, "object": object_name, "created": request.created, "model": request.model}


def response_body(request: GenerateRequest, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
    """The non-streaming response of a completion or chat request."""
    if request.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        head = _head(request, "chat.completion")
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        head = _head(request, "text_completion")
    return {**head, "choices": [choice], "usage": usage.to_dict()}


def chunk_body(request: GenerateRequest, text: str, finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
    """A streamed chunk; `role` marks a chat stream's first chunk (`delta.role`)."""
    if request.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**_head(request, "chat.completion.chunk"), "choices": [choice]}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**_head(request, "text_completion"), "choices": [choice]}
    if request.include_usage:
        chunk["usage"] = None  # OpenAI: every chunk but the last carries a null usage
    return chunk


def usage_chunk_body(request: GenerateRequest, usage: Usage) -> dict[str, Any]:
    """The last chunk of a stream with `stream_options.include_usage`: no choices."""
    object_name = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
    return {**_head(request, object_name), "choices": [], "usage": usage.to_dict()}


def to_json(body: dict[str, Any]) -> bytes:
    return _encode(body)


def sse_event(body: dict[str, Any]) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + _encode(body) + b"\n\n"
