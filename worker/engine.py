"""The engine contract: what the worker's HTTP server needs of an inference engine.

Owns the `Engine` protocol, the types that cross it (`EngineOutput`, one request's new
tokens; `EngineStats`, the gauges and totals scraped into `/metrics`) and
`OutputStreams`, the per-request plumbing from an engine's step loop to the handlers
reading its outputs, which every engine shares.

Implemented by `worker/sim.py` (the simulated engine) and, later, the torch engine;
consumed by `worker/server.py`. Requests come in as `worker.api.GenerateRequest`s,
already validated against the `ServedModel`.

Invariants:
- a request's outputs end with exactly one output carrying a `finish_reason`, or with
  an exception (`EngineUnavailable` when the engine stops or fails);
- `abort` is a no-op for finished or unknown request ids, so callers may always call
  it when they are done with a request;
- `OutputStreams` is touched only from the event loop that runs the engine: `push`
  never blocks, and outputs that pile up reach their reader merged into one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Protocol

from worker.api import GenerateRequest, ServedModel


@dataclass(slots=True)
class EngineOutput:
    """New tokens of one request from one or more engine steps.

    `finish_reason` is "length" (max_tokens reached) or "stop" (EOS) on the last output.
    `num_cached_tokens`: prompt tokens found in the prefix cache when first scheduled.
    `block_ids`: on the last output of a request submitted with `hold_blocks`, the KV
    blocks the engine holds for it until `release`.
    """

    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    block_ids: list[int] | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """An engine's gauges and running totals, read at scrape time."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_cached_blocks: int
    num_prompt_tokens: int  # prompt tokens admitted (first scheduling only)
    num_cached_prompt_tokens: int  # of those, found in the prefix cache
    num_generation_tokens: int
    num_preemptions: int
    num_steps: int
    generation_tokens_per_s: float

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


class OutputStreams:
    """Per-request output queues from an engine's step loop to the requests' readers.

    The engine `open`s one per submitted request and `push`es its outputs from the
    loop. Outputs that pile up while a reader is busy reach it merged into one. A
    reader that stops early (client gone) calls `on_close(request_id)`, so the engine
    aborts the request; `fail_all` ends every open stream with an error.
    """

    def __init__(self, on_close: Callable[[str], None]) -> None:
        self._on_close = on_close
        self._queues: dict[str, asyncio.Queue[EngineOutput | Exception]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queues

    def open(self, request_id: str) -> AsyncGenerator[EngineOutput, None]:
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[EngineOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        return self._read(request_id, queue)

    def push(self, request_id: str, output: EngineOutput) -> None:
        """Hands an output to its reader; the last one (with a finish reason) closes the stream."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(output)
            if output.finish_reason is not None:
                del self._queues[request_id]

    def discard(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def fail_all(self, error: Exception) -> list[str]:
        """Ends every open stream with `error`; returns their request ids."""
        for queue in self._queues.values():
            queue.put_nowait(error)
        request_ids = list(self._queues)
        self._queues.clear()
        return request_ids

    async def _read(
        self, request_id: str, queue: asyncio.Queue[EngineOutput | Exception]
    ) -> AsyncGenerator[EngineOutput, None]:
        try:
            while True:
                output = await queue.get()
                while isinstance(output, EngineOutput) and output.finish_reason is None and not queue.empty():
                    more = queue.get_nowait()
                    if isinstance(more, Exception):
                        output = more  # the request failed: its last tokens do not matter
                    else:
                        output.token_ids.extend(more.token_ids)
                        output.finish_reason = more.finish_reason
                        output.block_ids = more.block_ids
                if isinstance(output, Exception):
                    raise output
                yield output
                if output.finish_reason is not None:
                    return
        finally:
            self._on_close(request_id)


class Engine(Protocol):
    """What the server needs of an inference engine."""

    @property
    def served(self) -> ServedModel: ...

    @property
    def is_alive(self) -> bool:
        """True while started, not stopped and not failed."""

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Stops the engine; unfinished requests' iterators raise `EngineUnavailable`."""

    def submit(self, request: GenerateRequest) -> AsyncGenerator[EngineOutput, None]:
        """Queues a request (raising `ApiError` if refused) and yields its outputs;
        the last output has a `finish_reason`."""

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its KV blocks; a no-op for finished or unknown ids."""

    def stats(self) -> EngineStats: ...
