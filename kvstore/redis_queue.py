"""The global prefill queue on Redis Streams (Redis 7.0 commands only).

Owns the Redis layout of the queue and the commands that implement the
`PrefillQueue` contract (see `kvstore.prefill_queue`). Per model, under
`{key_prefix}:prefill:{model}`:
- the stream itself: one entry per unfinished job (field `job`: msgpack
  `PrefillJob`), read by one consumer group (`group`) of prefill workers;
- `...:dead`: the dead-letter stream (fields `job`, `reason`, `deliveries`, `entry_id`);
- `...:seen:{request_id}`: de-duplication keys, set with NX and a TTL.

Invariants:
- Enqueue is one Lua script (SET NX + XADD MAXLEN ~), so a duplicate never reaches
  the stream and an accepted job is in the stream when `enqueue` returns True.
- An entry leaves the stream only by XACK + XDEL in one MULTI (ack, expiry,
  dead-letter) or by trimming; so XLEN is the number of unfinished jobs.
- Delivery counts are Redis's own (XREADGROUP sets 1, XAUTOCLAIM adds 1); a renewal
  (XCLAIM ... JUSTID) resets the idle time and adds nothing.
- Renewal is one Lua script: it checks that the entry is pending with the claim's
  consumer and delivery count before it XCLAIMs, so it never takes over a job that
  another delivery holds.
- Every call is bounded and raises `QueueUnavailable` when Redis is unreachable
  (`kvstore.redis_link`), which also reconnects with backoff by itself.

Called through `kvstore.prefill_queue.open_prefill_queue()` or directly by tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import redis.asyncio as redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from kvstore.prefill_job import ClaimedJob, DeadLetter, PrefillJob, decode_job, encode_job
from kvstore.prefill_queue import QueueConfig, QueueCounters
from kvstore.redis_link import RedisLink, as_str

# KEYS: stream, dedupe key. ARGV: dedupe TTL (ms), max length, job payload.
_ENQUEUE_LUA = """
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then
  return false
end
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'job', ARGV[3])
"""

# KEYS: stream. ARGV: group, consumer, delivery count, entry id. Returns 1 if renewed.
# XCLAIM JUSTID with min-idle 0 resets the idle time without counting a delivery; it
# claims nothing, and drops the pending entry, when the entry was trimmed away.
_RENEW_LUA = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[4], ARGV[4], 1)[1]
if not pending or pending[2] ~= ARGV[2] or pending[4] ~= tonumber(ARGV[3]) then
  return 0
end
return #redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[4], 'JUSTID')
"""

_Entry = tuple[str, dict[bytes, bytes]]


class RedisPrefillQueue:
    """`PrefillQueue` on Redis Streams; see the module doc for the key layout."""

    def __init__(self, url: str, config: QueueConfig | None = None) -> None:
        self.config = config or QueueConfig()
        self.counters = QueueCounters()
        self._link = RedisLink(url, self.config, self.counters, on_up=self._forget_groups)
        self._enqueue_script = self._link.client.register_script(_ENQUEUE_LUA)
        self._renew_script = self._link.client.register_script(_RENEW_LUA)
        self._groups: set[str] = set()

    @property
    def is_available(self) -> bool:
        return self._link.is_up

    async def start(self) -> None:
        await self._link.start()

    async def close(self) -> None:
        await self._link.close()

    async def enqueue(self, job: PrefillJob) -> bool:
        stream = self._stream_key(job.model)
        keys = [stream, f"{stream}:seen:{job.request_id}"]
        args = [int(self.config.dedupe_ttl_s * 1000), self.config.max_len, encode_job(job)]
        entry_id = await self._link.call(lambda _: self._enqueue_script(keys=keys, args=args))
        if entry_id is None:
            self.counters.num_duplicates += 1
            return False
        self.counters.num_enqueued += 1
        return True

    async def claim(self, model: str, consumer: str, timeout_s: float) -> ClaimedJob | None:
        stream = self._stream_key(model)
        try:
            return await self._claim(model, stream, consumer, timeout_s)
        except ResponseError as exc:
            # The group vanished under us (Redis restarted without persistence).
            if "NOGROUP" not in str(exc):
                raise
            self._groups.discard(stream)
            return await self._claim(model, stream, consumer, timeout_s)

    async def ack(self, claimed: ClaimedJob) -> bool:
        stream = self._stream_key(claimed.job.model)
        num_acked = await self._remove(stream, claimed.entry_id)
        if num_acked:
            self.counters.num_acked += 1
        return num_acked == 1

    async def renew(self, claimed: ClaimedJob) -> bool:
        keys = [self._stream_key(claimed.job.model)]
        args = [self.config.group, claimed.consumer, claimed.num_deliveries, claimed.entry_id]
        try:
            num_renewed = await self._link.call(lambda _: self._renew_script(keys=keys, args=args))
        except ResponseError as exc:
            # No stream or no group (Redis restarted empty): nothing is pending.
            if "NOGROUP" not in str(exc):
                raise
            return False
        if num_renewed:
            self.counters.num_renewed += 1
        return num_renewed == 1

    async def depth(self, model: str) -> int:
        stream = self._stream_key(model)
        return await self._link.call(lambda client: client.xlen(stream))

    async def dead_letters(self, model: str, limit: int = 100) -> list[DeadLetter]:
        dead = f"{self._stream_key(model)}:dead"
        entries = await self._link.call(lambda client: client.xrange(dead, count=limit))
        return [_dead_letter_from(fields) for _, fields in entries]

    def _stream_key(self, model: str) -> str:
        return f"{self.config.key_prefix}:prefill:{model}"

    def _forget_groups(self) -> None:
        # After an outage the server may be a fresh one: check the groups again.
        self._groups.clear()

    async def _claim(self, model: str, stream: str, consumer: str, timeout_s: float) -> ClaimedJob | None:
        await self._ensure_group(stream)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            claimed = await self._reclaim(stream, consumer)
            if claimed is not None:
                return claimed
            remaining = end - loop.time()
            # Block at most one idle timeout, so idle jobs get reclaimed in time.
            block_s = min(remaining, self.config.idle_timeout_s) if remaining > 0 else 0.0
            entry = await self._read_new(stream, consumer, block_s)
            if entry is not None:
                claimed = await self._accept(stream, consumer, entry, num_deliveries=1)
                if claimed is not None:
                    return claimed
            elif remaining <= 0:
                return None

    async def _ensure_group(self, stream: str) -> None:
        if stream in self._groups:
            return

        async def create(client: redis.Redis) -> None:
            try:
                await client.xgroup_create(stream, self.config.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

        await self._link.call(create)
        self._groups.add(stream)

    async def _reclaim(self, stream: str, consumer: str) -> ClaimedJob | None:
        """Take over the oldest job left idle past the timeout, if any."""
        idle_ms = int(self.config.idle_timeout_s * 1000)
        while True:
            reply = await self._link.call(
                lambda client: client.xautoclaim(stream, self.config.group, consumer, idle_ms, "0-0", count=1)
            )
            entries = [(as_str(entry_id), fields) for entry_id, fields in reply[1] if fields is not None]
            if not entries:
                return None
            entry_id = entries[0][0]
            pending = await self._link.call(
                lambda client: client.xpending_range(stream, self.config.group, entry_id, entry_id, 1)
            )
            if not pending:
                continue  # acked by its previous consumer in between: nothing to redo
            self.counters.num_reclaimed += 1
            num_deliveries = int(pending[0]["times_delivered"])
            claimed = await self._accept(stream, consumer, entries[0], num_deliveries)
            if claimed is not None:
                return claimed

    async def _read_new(self, stream: str, consumer: str, block_s: float) -> _Entry | None:
        """One never-delivered entry, waiting up to `block_s` (0: do not wait)."""
        block_ms = max(1, int(block_s * 1000)) if block_s > 0 else None
        reply = await self._link.call(
            lambda client: client.xreadgroup(self.config.group, consumer, {stream: ">"}, count=1, block=block_ms),
            extra_s=block_s,
        )
        if not reply:
            return None
        entry_id, fields = reply[0][1][0]
        return as_str(entry_id), fields

    async def _accept(self, stream: str, consumer: str, entry: _Entry, num_deliveries: int) -> ClaimedJob | None:
        """The delivered job, or None after retiring it (undecodable, too many deliveries, expired)."""
        entry_id, fields = entry
        payload = fields.get(b"job", b"")
        try:
            job = decode_job(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self._dead_letter(stream, entry_id, payload, num_deliveries, f"undecodable job: {exc}")
            return None
        if num_deliveries > self.config.max_deliveries:
            reason = f"delivered {num_deliveries} times without ack (limit {self.config.max_deliveries})"
            await self._dead_letter(stream, entry_id, payload, num_deliveries, reason)
            return None
        if job.is_expired():
            await self._remove(stream, entry_id)
            self.counters.num_expired += 1
            return None
        self.counters.num_delivered += 1
        return ClaimedJob(job, entry_id, consumer, num_deliveries)

    async def _remove(self, stream: str, entry_id: str) -> int:
        """XACK + XDEL in one MULTI; the number of entries acked (0 or 1)."""
        num_acked, _ = await self._transaction(
            lambda pipe: pipe.xack(stream, self.config.group, entry_id).xdel(stream, entry_id)
        )
        return int(num_acked)

    async def _dead_letter(self, stream: str, entry_id: str, payload: bytes, num_deliveries: int, reason: str) -> None:
        fields = {"job": payload, "reason": reason, "deliveries": num_deliveries, "entry_id": entry_id}
        await self._transaction(
            lambda pipe: pipe.xadd(f"{stream}:dead", fields, maxlen=self.config.dead_letter_max_len, approximate=True)
            .xack(stream, self.config.group, entry_id)
            .xdel(stream, entry_id)
        )
        self.counters.num_dead_lettered += 1

    async def _transaction(self, queue_commands: Callable[[Pipeline], object]) -> list:
        async def run(client: redis.Redis) -> list:
            async with client.pipeline(transaction=True) as pipe:
                queue_commands(pipe)
                return await pipe.execute()

        return await self._link.call(run)


def _dead_letter_from(fields: dict[bytes, bytes]) -> DeadLetter:
    try:
        job: PrefillJob | None = decode_job(fields[b"job"])
    except (msgspec.DecodeError, msgspec.ValidationError):
        job = None
    return DeadLetter(
        entry_id=as_str(fields[b"entry_id"]),
        reason=as_str(fields[b"reason"]),
        num_deliveries=int(fields[b"deliveries"]),
        job=job,
    )
