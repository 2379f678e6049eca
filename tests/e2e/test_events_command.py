"""`kvgate events` as a real process, following a real publisher fed by a real block pool."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from indexer.tokenizer import ByteTokenizer, prompt_ids
from worker.block_pool import BlockPool
from worker.kv_publisher import KVEventPublisher

REPO_ROOT = Path(__file__).parents[2]
BLOCK_SIZE = 4
PROMPT = "The quick brown fox jumps over the lazy dog, twice over."


def _kvgate(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVGATE_BLOCK_SIZE": str(BLOCK_SIZE)}
    return subprocess.Popen(
        [sys.executable, "-m", "router.cli", "events", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT,
    )


def _commit(pool: BlockPool, publisher: KVEventPublisher, request_id: str, tokens) -> None:
    pool.allocate(request_id, tokens)
    pool.commit(request_id, len(tokens))
    publisher.publish(pool.take_events())


def test_follows_a_publisher_and_matches_a_prompt():
    tokens = prompt_ids(ByteTokenizer(), PROMPT)
    pool = BlockPool(64, BLOCK_SIZE)
    with KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as publisher:
        _commit(pool, publisher, "first", tokens)
        proc = _kvgate(
            "--events", publisher.bound_endpoint, "--replay", publisher.bound_replay_endpoint,
            "--worker-id", "engine-a", "--prompt", PROMPT, "--interval", "0.1", "--duration", "20", "--json",
        )
        try:
            # Keep publishing until the command has caught up: it joins late (ZMQ's slow
            # joiner) and must recover the first batch through replay.
            num_requests, snap = 1, None
            deadline = time.monotonic() + 15
            for line in proc.stdout:
                snap = json.loads(line)
                sub = snap["subscribers"]["engine-a"]
                if sub["last_seq"] == num_requests - 1:
                    break
                assert time.monotonic() < deadline, f"kvgate events never caught up: {snap}"
                _commit(pool, publisher, f"more-{num_requests}", list(range(300, 300 + 4 * num_requests)))
                num_requests += 1
        finally:
            proc.terminate()
            _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr
    worker = snap["workers"]["engine-a/0"]
    assert worker["num_blocks"] == len(pool.cached_block_hashes())
    assert worker["matched_blocks"] == len(tokens) // BLOCK_SIZE  # every full block is cached
    assert snap["subscribers"]["engine-a"]["num_malformed"] == 0
    assert snap["index"]["num_unknown_parent"] == 0


def test_help_and_bad_flags():
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "events", "--help"],
        capture_output=True, text=True, cwd=REPO_ROOT, check=True,
    )
    assert "--events" in out.stdout and "--replay" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "router.cli", "events", "--events", "tcp://127.0.0.1:1", "--block-size", "zero"],
        capture_output=True, text=True, cwd=REPO_ROOT,
    )
    assert bad.returncode == 2 and "--block-size" in bad.stderr
