"""A fake OpenAI-compatible LLM worker that answers at once, for router benchmarks.

Owns: the backend side of `bench/gateway.py`. It speaks enough of the worker HTTP
contract for kvgate and its peers (sglang-router, vllm-router) to accept it as a
worker, and does no work a router could be blamed for waiting on:
- `POST /v1/completions`, `POST /v1/chat/completions`: a small OpenAI response with
  `usage`; with `"stream": true`, `--num-chunks` SSE content chunks (each its own
  write, so a relaying router sees them one by one), a usage chunk when
  `stream_options.include_usage`, then `data: [DONE]`.
- `GET /health`, `GET /v1/models`, and the model/server info routes sglang-router
  probes on start.
Invariants: no sleep anywhere on the request path; a malformed body gets an
OpenAI-style 400, never a 500; TCP_NODELAY on every connection (aiohttp's default).

Run: `python bench/fake_backend.py --host 127.0.0.1 --port 0 --model NAME`; once
listening it prints one JSON line `{"event": "ready", "url": ..., "model": ...}`
and serves until SIGINT/SIGTERM. `bench/gateway.py` starts one process per backend.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import sys
import time
from dataclasses import dataclass, field

import msgspec
import uvloop
from aiohttp import web

_ENCODE = msgspec.json.encode
_DECODE = msgspec.json.Decoder(dict)
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class BackendConfig:
    model: str
    num_chunks: int
    ids: itertools.count = field(default_factory=itertools.count)


CONFIG = web.AppKey("config", BackendConfig)


class BadRequest(ValueError):
    """A request body this backend cannot answer; becomes an OpenAI-style 400."""


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}}
    return web.Response(status=status, body=_ENCODE(body), content_type="application/json")


async def _read_body(request: web.Request) -> dict:
    try:
        return _DECODE.decode(await request.read())
    except msgspec.DecodeError as exc:
        raise BadRequest(f"body is not a JSON object: {exc}") from None


def _num_prompt_tokens(body: dict, chat: bool) -> int:
    """Bytes of the prompt: the count kvgate's default byte tokenizer would give."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        return sum(len(str(m.get("content", "")).encode()) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if not isinstance(prompt, (str, list)):
        raise BadRequest("'prompt' must be a string or a list")
    return len(prompt.encode()) if isinstance(prompt, str) else len(prompt)


def _usage(num_prompt: int, num_completion: int) -> dict:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _choice(chat: bool, text: str, finish: str | None, delta: bool) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    message = {"role": "assistant", "content": text}
    return {"index": 0, "delta" if delta else "message": message, "logprobs": None, "finish_reason": finish}


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    config = request.app[CONFIG]
    try:
        body = await _read_body(request)
        num_prompt = _num_prompt_tokens(body, chat)
    except BadRequest as exc:
        return _error(400, str(exc))
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{next(config.ids)}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model") or config.model,
    }
    if body.get("stream"):
        return await _stream(request, head, chat, num_prompt, body.get("stream_options"))
    text = " tok" * config.num_chunks
    response = {**head, "choices": [_choice(chat, text, "length", False)], "usage": _usage(num_prompt, config.num_chunks)}
    return web.Response(body=_ENCODE(response), content_type="application/json")


async def _stream(
    request: web.Request, head: dict, chat: bool, num_prompt: int, options: object
) -> web.StreamResponse:
    num_chunks = request.app[CONFIG].num_chunks
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    for i in range(num_chunks):
        finish = "length" if i == num_chunks - 1 else None
        chunk = {**head, "choices": [_choice(chat, " tok", finish, True)]}
        await response.write(b"data: " + _ENCODE(chunk) + b"\n\n")
    if isinstance(options, dict) and options.get("include_usage"):
        chunk = {**head, "choices": [], "usage": _usage(num_prompt, num_chunks)}
        await response.write(b"data: " + _ENCODE(chunk) + b"\n\n")
    await response.write(_DONE)
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(request: web.Request) -> web.Response:
    model = request.app[CONFIG].model
    card = {"id": model, "object": "model", "created": 0, "owned_by": "kvgate-bench", "max_model_len": 32768}
    return web.json_response({"object": "list", "data": [card]})


async def model_info(request: web.Request) -> web.Response:
    # sglang-router asks the worker what it serves when it registers it.
    model = request.app[CONFIG].model
    return web.json_response({"model_path": model, "tokenizer_path": model, "is_generation": True})


async def server_info(request: web.Request) -> web.Response:
    return web.json_response({"model_path": request.app[CONFIG].model, "max_total_num_tokens": 1 << 20})


def build_app(model: str, num_chunks: int) -> web.Application:
    app = web.Application(client_max_size=16 << 20)
    app[CONFIG] = BackendConfig(model=model, num_chunks=num_chunks)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/server_info", server_info)
    return app


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(build_app(args.model, args.num_chunks), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=1024)
    await site.start()
    port = runner.addresses[0][1]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    ready = {"event": "ready", "url": f"http://{args.host}:{port}", "model": args.model}
    print(json.dumps(ready), flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fake OpenAI worker that answers immediately.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed in the ready line)")
    parser.add_argument("--model", default="kvgate-bench")
    parser.add_argument("--num-chunks", type=int, default=4, help="content tokens per answer = SSE chunks per stream")
    args = parser.parse_args(argv)
    if args.num_chunks < 1:
        parser.error("--num-chunks must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    uvloop.run(serve(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
