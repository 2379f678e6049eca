"""The HTTP prefill queue's wire (`kvstore.queue_server`) and client checks (`kvstore.http_queue`)."""

from __future__ import annotations

import time

import msgspec
import pytest

from kvstore.http_queue import HttpPrefillQueue, QueueRejected
from kvstore.memory_queue import MemoryPrefillQueue
from kvstore.prefill_job import ClaimedJob, DeadLetter, PrefillJob
from kvstore.prefill_queue import QueueConfig, QueueUnavailable
from kvstore.queue_server import (
    ClaimReply,
    ClaimRequest,
    RenewReply,
    ServerState,
    WireClaim,
    claim_from_wire,
    claim_to_wire,
    dead_letter_from_wire,
    dead_letter_to_wire,
)

JOB = PrefillJob(
    request_id="r1",
    model="tiny-moe",
    token_ids=[1, 2, 3],
    block_ids=[4],
    decode_worker_id="decode-0",
    transfer_endpoint="tcp://127.0.0.1:5555",
    deadline=1_900_000_000.0,
    agent_metadata=b"\x00agent",
)


def test_claimed_job_round_trips_through_the_wire() -> None:
    claimed = ClaimedJob(JOB, "17-0", "prefill-1", 2)
    payload = msgspec.msgpack.encode(ClaimReply(claim_to_wire(claimed), num_expired=1))
    reply = msgspec.msgpack.decode(payload, type=ClaimReply)
    assert claim_from_wire(reply.claimed) == claimed
    assert (reply.num_reclaimed, reply.num_expired, reply.num_dead_lettered) == (0, 1, 0)


def test_renew_sends_the_claim_and_gets_a_yes_or_no() -> None:
    claimed = ClaimedJob(JOB, "17-0", "prefill-1", 2)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(claim_to_wire(claimed)), type=WireClaim)
    assert claim_from_wire(wire) == claimed
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(RenewReply(True)), type=RenewReply) == RenewReply(True)
    with pytest.raises(msgspec.ValidationError, match=r"Object missing required field `renewed`"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({}), type=RenewReply)


def test_dead_letters_round_trip_and_an_undecodable_job_becomes_none() -> None:
    dead = DeadLetter("3-0", "delivered 4 times without ack (limit 3)", 4, JOB)
    assert dead_letter_from_wire(dead_letter_to_wire(dead)) == dead
    assert dead_letter_from_wire(dead_letter_to_wire(DeadLetter("4-0", "x", 1, None))).job is None
    wire = dead_letter_to_wire(dead)
    wire.job = b"\xc1"
    assert dead_letter_from_wire(wire) == DeadLetter("3-0", dead.reason, 4, None)


def test_wire_requests_are_validated() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"Expected `str` of length >= 1 - at `\$.consumer`"):
        bad = {"model": "m", "consumer": "", "timeout_s": 0}
        msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=ClaimRequest)
    with pytest.raises(msgspec.ValidationError, match=r"Expected `int` >= 1 - at `\$.num_deliveries`"):
        bad = {"job": b"", "entry_id": "1-0", "consumer": "w", "num_deliveries": 0}
        msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=WireClaim)


async def test_retirements_are_reported_once_each() -> None:
    queue = MemoryPrefillQueue()
    queue.counters.num_expired = 2  # before serving: nobody's
    state = ServerState(queue, None)
    state.take_retirements()
    queue.counters.num_expired += 1
    queue.counters.num_reclaimed += 2
    assert state.take_retirements() == {"num_reclaimed": 2, "num_expired": 1, "num_dead_lettered": 0}
    assert state.take_retirements() == {"num_reclaimed": 0, "num_expired": 0, "num_dead_lettered": 0}


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379", "http://", "127.0.0.1:8000", "ftp://host"])
def test_client_url_must_be_http_with_a_host(url: str) -> None:
    with pytest.raises(ValueError, match="prefill queue URL must be http://host:port or https://host:port"):
        HttpPrefillQueue(url)


def test_rejections_are_a_kind_of_unavailability() -> None:
    rejected = QueueRejected("refused", 400)
    assert isinstance(rejected, QueueUnavailable) and rejected.status == 400


async def test_closed_client_fails_at_once_without_network() -> None:
    queue = HttpPrefillQueue("http://127.0.0.1:9", QueueConfig(op_timeout_s=5.0))
    await queue.close()
    started = time.monotonic()
    with pytest.raises(QueueUnavailable, match="is closed"):
        await queue.depth("m")
    with pytest.raises(QueueUnavailable, match="is closed"):
        await queue.renew(ClaimedJob(JOB, "17-0", "prefill-1", 1))
    assert time.monotonic() - started < 0.05
    assert (queue.is_available, queue.counters.num_unavailable) == (False, 2)
