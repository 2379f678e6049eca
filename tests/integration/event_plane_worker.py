"""A stand-in worker for `test_event_plane.py`: a real BlockPool publishing real KV events.

Run as `python event_plane_worker.py CONFIG_JSON` with the repository on PYTHONPATH.
It binds a `KVEventPublisher` (a subclass that can drop chosen live sends and inject
garbage messages), prints `{"endpoint": ..., "replay_endpoint": ...}`, then obeys one
command per stdin line, answering each with one JSON line on stdout:

- `run`: drives the pool through `num_steps` random allocate/commit/append/free steps
  over requests sharing a few prefixes, publishing `take_events()` after every step;
  then frees every request. Answers `{"last_seq": ..., "num_dropped": ..., "num_garbage": ...}`.
- `nudge`: one step that surely emits events (a fresh one-block request), published
  without chaos. Answers `{"last_seq": ...}`.
- `hashes`: answers `{"hashes": sorted(pool.cached_block_hashes())}`.
- `exit` (or end of input): closes the publisher, which drains its queue, and exits.

Config keys: endpoint, replay_endpoint, seed, num_steps, num_blocks, block_size,
buffer_size, drop_seqs (list), garbage_every (0: never).
"""

from __future__ import annotations

import json
import random
import sys

from indexer.events import KVEvent, decode_seq, encode_seq
from worker.block_pool import BlockPool, NoFreeBlocks
from worker.kv_publisher import KVEventPublisher

NUM_PREFIXES = 4
VOCAB = 8  # a small vocabulary makes suffixes collide, so blocks get shared and reused


class ChaosPublisher(KVEventPublisher):
    """Drops the live send of chosen seqs; sends garbage after every `garbage_every`-th."""

    def __init__(self, *args, drop_seqs=(), garbage_every: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clean_seqs: set[int] = set()  # nudges: never dropped, never followed by garbage
        self.drop_seqs = set(drop_seqs)
        self.garbage_every = garbage_every
        self.num_garbage = 0

    def _send_live(self, frames: list[bytes]) -> None:
        seq = decode_seq(frames[1])
        if seq in self.clean_seqs:
            return super()._send_live(frames)
        if seq in self.drop_seqs:
            return
        super()._send_live(frames)
        if self.garbage_every and seq % self.garbage_every == 0:
            topic, _, payload = frames
            super()._send_live([topic, encode_seq(seq + 1), b"\xc1 not msgpack"])
            super()._send_live([topic, b"bad seq", payload])
            super()._send_live([topic, encode_seq(seq + 1)])
            self.num_garbage += 3


class Workload:
    """Random requests over a pool; every step hands its events to `publish`."""

    def __init__(self, pool: BlockPool, rng: random.Random, publish) -> None:
        self.pool = pool
        self.rng = rng
        self.publish = publish
        self.block_size = pool.block_size
        self.prefixes = [
            [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6) * self.block_size)] for _ in range(NUM_PREFIXES)
        ]
        self.active: dict[str, list[int]] = {}  # request id -> its full token ids
        self.num_requests = 0

    def step(self) -> None:
        roll = self.rng.random()
        if roll < 0.3 or not self.active:
            self.start_request()
        elif roll < 0.65:
            self.compute(self.rng.choice(list(self.active)))
        elif roll < 0.85:
            self.extend(self.rng.choice(list(self.active)))
        elif roll < 0.99:
            self.finish(self.rng.choice(list(self.active)))
        elif not self.active:
            self.pool.reset_prefix_cache()
        self.flush()

    def start_request(self) -> None:
        prefix = self.rng.choice(self.prefixes)
        suffix = [self.rng.randrange(VOCAB) for _ in range(self.rng.randrange(1, 3 * self.block_size))]
        request_id = f"r{self.num_requests}"
        self.num_requests += 1
        try:
            self.pool.allocate(request_id, prefix + suffix)
        except NoFreeBlocks:
            return
        self.active[request_id] = prefix + suffix

    def compute(self, request_id: str) -> None:
        """A chunk of prefill (or a decode step): some more tokens get their KV."""
        done = self.pool.num_computed_tokens(request_id)
        total = self.pool.num_tokens(request_id)
        if done < total:
            self.pool.commit(request_id, self.rng.randint(done + 1, total))

    def extend(self, request_id: str) -> None:
        """Samples tokens for a request whose KV is complete."""
        if self.pool.num_computed_tokens(request_id) < self.pool.num_tokens(request_id):
            return self.compute(request_id)
        new_tokens = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 3))]
        try:
            self.pool.append(request_id, new_tokens)
        except NoFreeBlocks:
            return self.finish(request_id)  # as if preempted
        self.active[request_id].extend(new_tokens)

    def finish(self, request_id: str) -> None:
        self.pool.free(request_id)
        del self.active[request_id]

    def finish_all(self) -> None:
        for request_id in list(self.active):
            self.finish(request_id)
        self.flush()

    def nudge(self) -> None:
        """A fresh request of one full block and one token: one BlockStored at least."""
        request_id = f"nudge{self.num_requests}"
        self.num_requests += 1
        token_ids = [VOCAB + self.num_requests] * (self.block_size + 1)
        self.pool.allocate(request_id, token_ids)
        self.pool.commit(request_id, len(token_ids))
        self.pool.free(request_id)
        self.flush()

    def flush(self) -> None:
        events: list[KVEvent] = self.pool.take_events()
        self.publish(events)


def main() -> None:
    config = json.loads(sys.argv[1])
    pub = ChaosPublisher(
        config["endpoint"],
        config["replay_endpoint"],
        buffer_size=config["buffer_size"],
        drop_seqs=config["drop_seqs"],
        garbage_every=config["garbage_every"],
    ).start()
    num_batches = 0
    clean = False

    def publish(events: list[KVEvent]) -> None:
        nonlocal num_batches
        if events:
            if clean:
                pub.clean_seqs.add(num_batches)
            pub.publish(events)
            num_batches += 1

    pool = BlockPool(config["num_blocks"], config["block_size"])
    workload = Workload(pool, random.Random(config["seed"]), publish)
    answer({"endpoint": pub.bound_endpoint, "replay_endpoint": pub.bound_replay_endpoint})
    try:
        for line in sys.stdin:
            command = line.strip()
            if command == "run":
                for _ in range(config["num_steps"]):
                    workload.step()
                workload.finish_all()
                answer({"last_seq": num_batches - 1, "num_dropped": pub.num_dropped})
            elif command == "nudge":
                clean = True
                workload.nudge()
                clean = False
                answer({"last_seq": num_batches - 1})
            elif command == "hashes":
                answer({"hashes": sorted(pool.cached_block_hashes()), "num_garbage": pub.num_garbage})
            elif command == "exit":
                break
            else:
                raise SystemExit(f"unknown command {command!r}")
    finally:
        pub.close()


def answer(message: dict) -> None:
    print(json.dumps(message), flush=True)


if __name__ == "__main__":
    main()
