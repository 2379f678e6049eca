"""The event plane across processes: a worker's BlockPool mirrored by the router's index.

A child process (`event_plane_worker.py`) drives a real `BlockPool` through thousands
of random steps and publishes its events through a real `KVEventPublisher`; this
process runs a real `EventSubscriber` feeding a real `PrefixIndex`, and checks the
index against the pool's `cached_block_hashes()`.

ZMQ's slow joiner: a SUB misses what is published before its subscription reaches the
PUB. The test "nudges" the child (one step that surely publishes) until the subscriber
has heard from it; anything it missed before then is recovered by replay from seq 0.
The same nudge after a run makes sure the last batches are seen even if they were lost.
"""

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest

from indexer.index import PrefixIndex
from indexer.subscriber import EventSubscriber

BLOCK_SIZE = 4
NUM_STEPS = 3000
WORKER = ("w0", 0)
CHILD = Path(__file__).with_name("event_plane_worker.py")
REPO_ROOT = CHILD.parents[2]


class Child:
    """A worker process, driven one command per line over its stdin and stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls, **overrides) -> "Child":
        config = {
            "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*", "seed": 0,
            "num_steps": NUM_STEPS, "num_blocks": 48, "block_size": BLOCK_SIZE, "buffer_size": 10_000,
            "drop_seqs": [], "garbage_every": 0,
        }
        config.update(overrides)
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(CHILD), json.dumps(config),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, cwd=REPO_ROOT,
        )
        child = cls(proc)
        child.endpoints = await child.read()
        return child

    async def read(self) -> dict:
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout=30)
        assert line, f"the worker exited with {await self.proc.wait()}"
        return json.loads(line)

    async def command(self, command: str) -> dict:
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()
        return await self.read()

    async def close(self) -> None:
        if self.proc.returncode is None:
            await asyncio.wait_for(self.proc.communicate(b"exit\n"), timeout=30)
        assert self.proc.returncode == 0


@pytest.fixture
async def plane():
    """Spawns children and subscribers; closes them all whatever the test did."""
    children: list[Child] = []
    subscribers: list[EventSubscriber] = []

    async def spawn(**config) -> Child:
        children.append(await Child.spawn(**config))
        return children[-1]

    def subscribe(index: PrefixIndex, child: Child) -> EventSubscriber:
        sub = EventSubscriber(index, "w0", child.endpoints["endpoint"], child.endpoints["replay_endpoint"])
        sub.start()
        subscribers.append(sub)
        return sub

    yield spawn, subscribe
    for sub in subscribers:
        await sub.stop()
    for child in children:
        if child.proc.returncode is None:
            child.proc.kill()
        await child.proc.communicate()


async def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def join(sub: EventSubscriber, child: Child) -> None:
    """Nudges the child until the subscriber hears a live message from it."""
    num_heard = sub.stats.num_messages
    for _ in range(500):
        await child.command("nudge")
        if await wait_until(lambda: sub.stats.num_messages > num_heard, 0.01):
            return
    raise AssertionError("the subscriber never joined")


async def catch_up(sub: EventSubscriber, child: Child) -> int:
    """Nudges until the subscriber has applied everything the child published."""
    for _ in range(20):
        last_seq = (await child.command("nudge"))["last_seq"]
        if await wait_until(lambda: sub.stats.last_seq == last_seq, 5.0):
            return last_seq
    raise AssertionError(f"the subscriber is stuck at seq {sub.stats.last_seq}")


async def run_to_end(sub: EventSubscriber, child: Child) -> set[int]:
    """Runs the child's random steps; the pool's cached hashes once the index caught up."""
    await child.command("run")
    await catch_up(sub, child)
    return set((await child.command("hashes"))["hashes"])


async def test_the_index_mirrors_the_pool_exactly(plane):
    spawn, subscribe = plane
    child = await spawn(seed=1)
    index = PrefixIndex(BLOCK_SIZE)
    sub = subscribe(index, child)
    await join(sub, child)
    pool_hashes = await run_to_end(sub, child)
    assert len(pool_hashes) > 10
    assert index.worker_block_hashes(WORKER) == pool_hashes
    # Every seq from 0 was applied once, live or replayed; nothing was ever cleared.
    assert sub.stats.num_batches == sub.stats.last_seq + 1
    assert (sub.stats.num_resyncs, sub.stats.num_malformed) == (0, 0)
    assert index.stats().num_unknown_parent == 0


async def test_dropped_live_sends_are_healed_by_replay(plane):
    spawn, subscribe = plane
    drop_seqs = list(range(40, 600, 17)) + list(range(200, 215))
    child = await spawn(seed=2, drop_seqs=drop_seqs)
    index = PrefixIndex(BLOCK_SIZE)
    sub = subscribe(index, child)
    await join(sub, child)
    pool_hashes = await run_to_end(sub, child)
    assert index.worker_block_hashes(WORKER) == pool_hashes
    num_dropped = sum(1 for seq in set(drop_seqs) if seq <= sub.stats.last_seq)
    assert sub.stats.num_replays >= num_dropped > 20
    assert sub.stats.num_batches == sub.stats.last_seq + 1
    assert sub.stats.num_resyncs == 0


async def test_a_gap_beyond_the_replay_buffer_resyncs_to_a_subset(plane):
    spawn, subscribe = plane
    child = await spawn(seed=3, buffer_size=16, drop_seqs=list(range(300, 360)))
    index = PrefixIndex(BLOCK_SIZE)
    sub = subscribe(index, child)
    await join(sub, child)
    pool_hashes = await run_to_end(sub, child)
    indexed = index.worker_block_hashes(WORKER)
    assert sub.stats.num_resyncs >= 1
    # Blocks cached before the resync may be missing, but nothing the pool evicted stays.
    assert indexed <= pool_hashes
    assert indexed


async def test_a_restarted_worker_replaces_its_index_entries(plane, tmp_path):
    spawn, subscribe = plane
    endpoints = {"endpoint": f"ipc://{tmp_path}/events", "replay_endpoint": f"ipc://{tmp_path}/replay"}
    first = await spawn(seed=4, **endpoints)
    index = PrefixIndex(BLOCK_SIZE)
    sub = subscribe(index, first)
    await join(sub, first)
    first_pool_hashes = await run_to_end(sub, first)
    assert index.worker_block_hashes(WORKER) == first_pool_hashes
    await first.close()

    second = await spawn(seed=5, **endpoints)
    before = dataclasses.replace(sub.stats)
    await join(sub, second)
    pool_hashes = await run_to_end(sub, second)
    assert index.worker_block_hashes(WORKER) == pool_hashes
    assert (sub.stats.num_restarts - before.num_restarts, sub.stats.num_resyncs - before.num_resyncs) == (1, 1)


async def test_a_restarted_worker_already_past_the_old_seq_is_not_taken_for_a_gap(plane, tmp_path):
    spawn, subscribe = plane
    endpoints = {"endpoint": f"ipc://{tmp_path}/events", "replay_endpoint": f"ipc://{tmp_path}/replay"}
    first = await spawn(seed=7, **endpoints)
    index = PrefixIndex(BLOCK_SIZE)
    sub = subscribe(index, first)
    await join(sub, first)
    old_last_seq = await catch_up(sub, first)
    assert index.worker_block_hashes(WORKER)
    await first.close()

    # The new process publishes thousands of batches at once: the subscriber most likely
    # reconnects in the middle, at a seq far past the old process's last one.
    second = await spawn(seed=8, **endpoints)
    await second.command("run")
    pool_hashes = await run_to_end(sub, second)
    assert sub.stats.last_seq > old_last_seq + 1
    assert index.worker_block_hashes(WORKER) == pool_hashes
    assert sub.stats.num_restarts >= 1


async def test_garbage_on_the_socket_is_counted_and_skipped(plane):
    spawn, subscribe = plane
    child = await spawn(seed=6, garbage_every=50)
    index = PrefixIndex(BLOCK_SIZE)
    sub = subscribe(index, child)
    await join(sub, child)
    pool_hashes = await run_to_end(sub, child)
    answer = await child.command("hashes")
    assert index.worker_block_hashes(WORKER) == pool_hashes
    # A message lost at a full ZMQ queue would be neither seen nor counted.
    assert 0 < sub.stats.num_malformed <= answer["num_garbage"]
    assert sub.stats.num_batches == sub.stats.last_seq + 1
    assert sub.stats.num_resyncs == 0
