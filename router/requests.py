"""OpenAI completions and chat bodies at the gateway: parse, validate, tokenize, re-encode.

Owns the checks every `/v1/completions` and `/v1/chat/completions` body passes before
any worker sees it, and the body that is forwarded. Called by the app's handlers and
by `POST /admin/route` (the dry run parses exactly as the real route does).

- Malformed JSON, a body that is not an object, a wrong type or an out-of-range value
  of a known field: `BadRequest` (400) naming the field. Unknown fields pass through
  untouched: workers may understand more than the gateway checks.
- A prompt over `max_prompt_tokens` tokens: `PayloadTooLarge` (413). The body size
  limit is enforced while reading (the app's `client_max_size`), before parsing.
- The prompt is tokenized once, with `indexer.tokenizer` / `indexer.chat_template`,
  the same code the reference worker uses, so both get identical token ids; the ids
  are forwarded as `prompt_token_ids` unless that is switched off.
- While disaggregation is active, the proxy sets `kv_transfer_params` in the
  forwarded body per attempt (`with_kv_transfer_params`), replacing any the client
  sent; otherwise the body passes through as the client sent it.

Pure and synchronous: no I/O, no logging (this is the per-request hot path).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import msgspec

from indexer.chat_template import ChatTemplateError, render_and_encode
from indexer.tokenizer import Tokenizer, TokenizerError, prompt_ids
from router.errors import BadRequest, PayloadTooLarge

COMPLETIONS = "completions"
CHAT = "chat"
# What the load prediction assumes when a body sets no limit (OpenAI's completions
# default is 16; chat has none, so a typical answer length is assumed).
DEFAULT_MAX_TOKENS = {COMPLETIONS: 16, CHAT: 256}

_decode = msgspec.json.decode
_encode = msgspec.json.encode
_NUMBER = (int, float)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_body_bytes: int = 16 * 1024 * 1024
    max_prompt_tokens: int = 131072

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024 or self.max_prompt_tokens < 1:
            raise ValueError("max_body_bytes must be at least 1024 and max_prompt_tokens at least 1")


@dataclass(slots=True)
class ParsedRequest:
    kind: str  # COMPLETIONS or CHAT
    model: str
    stream: bool
    max_tokens: int  # the body's limit, or DEFAULT_MAX_TOKENS
    token_ids: array
    body: bytes  # what is forwarded
    has_kv_transfer_params: bool = False  # the client's body sets kv_transfer_params


def decode_object(raw: bytes) -> dict[str, Any]:
    """The JSON object in `raw`, or `BadRequest`."""
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError included: a number out of range
        raise BadRequest(f"malformed JSON body: {exc}") from None
    except UnicodeDecodeError:  # msgspec checks UTF-8 lazily, in object keys
        raise BadRequest("malformed JSON body: not valid UTF-8") from None
    except RecursionError:
        raise BadRequest("malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(body).__name__}")
    return body


def parse_request(
    raw: bytes,
    kind: str,
    tokenizer: Tokenizer,
    limits: RequestLimits,
    *,
    forward_token_ids: bool = True,
) -> ParsedRequest:
    """A validated, tokenized request and the body to forward (see the module docstring)."""
    body = decode_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    _check_common(body)
    if kind == CHAT:
        max_tokens = _check_chat(body)
        token_ids = _chat_ids(tokenizer, body)
    else:
        max_tokens = _check_completions(body)
        token_ids = _completion_ids(tokenizer, body)
    if len(token_ids) > limits.max_prompt_tokens:
        raise PayloadTooLarge(
            f"the prompt has {len(token_ids)} tokens, over the limit of {limits.max_prompt_tokens}",
            param="messages" if kind == CHAT else "prompt", code="prompt_too_long",
        )
    forwarded = _forwarded_body(raw, body, token_ids) if forward_token_ids else raw
    stream = body.get("stream") is True
    return ParsedRequest(
        kind, model, stream, max_tokens or DEFAULT_MAX_TOKENS[kind], token_ids, forwarded,
        "kv_transfer_params" in body,
    )


def _completion_ids(tokenizer: Tokenizer, body: dict[str, Any]) -> array:
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", param="prompt")
    try:
        return prompt_ids(tokenizer, body["prompt"])
    except TokenizerError as exc:
        raise BadRequest(f"invalid 'prompt': {exc}", param="prompt") from None


def _chat_ids(tokenizer: Tokenizer, body: dict[str, Any]) -> array:
    if "messages" not in body:
        raise BadRequest("'messages' is required", param="messages")
    try:
        return render_and_encode(tokenizer, body["messages"])
    except (ChatTemplateError, TokenizerError) as exc:
        raise BadRequest(f"invalid 'messages': {exc}", param="messages") from None


def _forwarded_body(raw: bytes, body: dict[str, Any], token_ids: array) -> bytes:
    ids = _encode(token_ids.tolist())
    if "prompt_token_ids" in body:  # the gateway's tokenization wins over a client's
        return _encode({**body, "prompt_token_ids": msgspec.Raw(ids)})
    # Splicing the field in before the closing brace avoids re-encoding the body.
    end = raw.rstrip()
    return b"".join((end[:-1], b',"prompt_token_ids":', ids, b"}"))


def with_kv_transfer_params(parsed: ParsedRequest, params: bytes) -> bytes:
    """The forwarded body with `kv_transfer_params` set to the JSON value `params`."""
    body = parsed.body
    if parsed.has_kv_transfer_params:  # rare: a client's own value is replaced
        fields = _decode(body)
        fields["kv_transfer_params"] = msgspec.Raw(params)
        return _encode(fields)
    # A forwarded body is a JSON object with at least `model`: splice before its end.
    end = body.rstrip()
    return b"".join((end[:-1], b',"kv_transfer_params":', params, b"}"))


# -- field checks: only fields that are present and not null are checked ---------------


def _check_common(body: dict[str, Any]) -> None:
    get = body.get
    stream = get("stream")
    if stream is not None and stream.__class__ is not bool:
        raise BadRequest("'stream' must be a boolean", param="stream")
    options = get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("'stream_options' must be an object", param="stream_options")
        include = options.get("include_usage")
        if include is not None and include.__class__ is not bool:
            raise BadRequest("'stream_options.include_usage' must be a boolean", param="stream_options")
    _check_number(get("temperature"), "temperature", 0.0, 2.0)
    _check_number(get("top_p"), "top_p", 0.0, 1.0, low_open=True)
    _check_number(get("presence_penalty"), "presence_penalty", -2.0, 2.0)
    _check_number(get("frequency_penalty"), "frequency_penalty", -2.0, 2.0)
    n = get("n")
    if n is not None and (n.__class__ is not int or n != 1):
        raise BadRequest("'n' must be 1: one choice per request", param="n")
    _check_stop(get("stop"))
    seed = get("seed")
    if seed is not None and seed.__class__ is not int:
        raise BadRequest("'seed' must be an integer", param="seed")
    for name in ("ignore_eos",):
        value = get(name)
        if value is not None and value.__class__ is not bool:
            raise BadRequest(f"'{name}' must be a boolean", param=name)
    user = get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string", param="user")


def _check_completions(body: dict[str, Any]) -> int | None:
    return _check_max_tokens(body.get("max_tokens"), "max_tokens")


def _check_chat(body: dict[str, Any]) -> int | None:
    max_tokens = _check_max_tokens(body.get("max_tokens"), "max_tokens")
    max_completion = _check_max_tokens(body.get("max_completion_tokens"), "max_completion_tokens")
    return max_completion if max_completion is not None else max_tokens


def _check_max_tokens(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if value.__class__ is not int:
        raise BadRequest(f"'{name}' must be an integer", param=name)
    if value < 1:
        raise BadRequest(f"'{name}' must be at least 1, got {value}", param=name)
    return value


def _check_number(value: Any, name: str, low: float, high: float, *, low_open: bool = False) -> None:
    if value is None:
        return
    if value.__class__ not in _NUMBER:
        raise BadRequest(f"'{name}' must be a number", param=name)
    if value > high or value < low or (low_open and value == low):
        bound = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise BadRequest(f"'{name}' must be in {bound}, got {value}", param=name)


def _check_stop(stop: Any) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings", param="stop")
    if len(stop) > 16:
        raise BadRequest("'stop' may hold at most 16 strings", param="stop")
