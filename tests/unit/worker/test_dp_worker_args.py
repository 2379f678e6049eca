"""worker.dp_worker and worker.torch_cmd: each DP rank's addresses and id, and the
parallelism flags' validation (the message names the flag)."""

from __future__ import annotations

import argparse
import re

import pytest

from worker import torch_cmd, worker_cmd
from worker.dp_worker import rank_args, rank_endpoint


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker_cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("endpoint", "rank", "want"),
    [
        ("tcp://127.0.0.1:5557", 0, "tcp://127.0.0.1:5557"),
        ("tcp://127.0.0.1:5557", 1, "tcp://127.0.0.1:5567"),
        ("tcp://127.0.0.1:5559", 3, "tcp://127.0.0.1:5589"),
        ("tcp://127.0.0.1:0", 2, "tcp://127.0.0.1:0"),
        ("tcp://127.0.0.1:*", 2, "tcp://127.0.0.1:*"),
        ("ipc:///tmp/kv", 1, "ipc:///tmp/kv-dp1"),
        ("inproc://kv", 0, "inproc://kv-dp0"),
        ("", 1, ""),
    ],
)
def test_rank_endpoints(endpoint: str, rank: int, want: str) -> None:
    assert rank_endpoint(endpoint, rank) == want


def test_rank_args_offset_ports_and_suffix_the_worker_id() -> None:
    args = parse("--engine", "torch", "--dp", "2", "--enable-expert-parallel", "--port", "9000",
                 "--advertise-url", "http://gpu-node:9000")
    mine = rank_args(args, 1, "moe")
    assert (mine.worker_id, mine.port, mine.advertise_url) == ("moe-dp1", 9001, "http://gpu-node:9001")
    assert (mine.events_endpoint, mine.replay_endpoint, mine.load_endpoint) == (
        "tcp://127.0.0.1:5567", "tcp://127.0.0.1:5568", "tcp://127.0.0.1:5569",
    )
    assert (args.worker_id, args.port) == (None, 9000)  # the launcher's flags are left alone
    assert rank_args(parse("--port", "0"), 3, "w").port == 0


def test_which_flags_hand_over_to_the_dp_launcher() -> None:
    assert not torch_cmd.wants_parallel(parse("--engine", "torch"))
    assert not torch_cmd.wants_parallel(parse("--engine", "sim", "--dp", "2"))
    assert torch_cmd.wants_parallel(parse("--engine", "torch", "--dp", "2", "--enable-expert-parallel"))
    assert torch_cmd.wants_parallel(parse("--engine", "torch", "--enable-expert-parallel"))


@pytest.mark.parametrize(
    ("argv", "num_ranks", "message"),
    [
        (["--dp", "2"], 2, "--dp > 1 needs --enable-expert-parallel"),
        (["--enable-dbo"], 1, "--enable-dbo needs --enable-expert-parallel"),
        (["--enable-expert-parallel", "--num-experts", "2"], 4, "--num-experts must be >= the DP size (4), got 2"),
        (["--enable-expert-parallel", "--dp-liveness-timeout", "0.5"], 2, "--dp-liveness-timeout must exceed it"),
        (["--enable-expert-parallel", "--dbo-decode-token-threshold", "1"], 2,
         "--dbo-decode-token-threshold must be >= 2"),
        (["--enable-expert-parallel"], 0, "--dp must be >= 1, got 0"),
    ],
)
def test_bad_parallel_flags_are_named(argv: list[str], num_ranks: int, message: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        torch_cmd.check_parallel_args(parse("--engine", "torch", *argv), num_ranks)


def test_good_parallel_flags_pass() -> None:
    args = parse("--engine", "torch", "--dp", "2", "--enable-expert-parallel", "--enable-dbo")
    torch_cmd.check_parallel_args(args, 2)
    config = torch_cmd.dbo_config(args)
    assert (config.enable_dbo, config.dbo_decode_token_threshold, config.dbo_prefill_token_threshold) == (True, 32, 512)
