"""`kvgate router` and `kvgate up` flags: layering into a validated GatewayConfig, errors naming the flag."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from router import cli
from router.router_cmd import gateway_config, static_workers

REPO_ROOT = Path(__file__).parents[3]


def _args(command: str, argv: list[str], config: dict | None = None, env: dict | None = None):
    parser, _ = cli.command_parser(command)
    parser.set_defaults(**cli.layered_defaults(parser, command, config or {}, env or {}))
    return parser.parse_args(argv)


def test_defaults_are_loopback_and_kv():
    args = _args("router", [])
    config = gateway_config(args, static_workers(args))
    assert (args.host, args.port, config.policy, config.workers) == ("127.0.0.1", 8000, "kv", ())
    assert config.health.interval_s == 1.0 and config.health.fail_threshold == 2
    assert config.proxy.max_retries == 2 and config.admin_token is None and config.api_keys == ()
    assert config.forward_token_ids is True


def test_flags_config_file_and_environment_layer(tmp_path):
    workers = tmp_path / "workers.yaml"
    workers.write_text("workers:\n  - worker_id: y\n    url: http://127.0.0.1:9001\n")
    config = {"router": {
        "policy": "round_robin", "policy_config": {"load_weight": 0.25},
        "worker": [{"worker_id": "t", "url": "http://127.0.0.1:9002", "block_size": 32}],
        "workers_file": str(workers), "health_interval": 0.5,
    }}
    env = {"KVGATE_ADMIN_TOKEN": "tok", "KVGATE_API_KEY": "k1,k2", "KVGATE_MODEL": "m"}
    args = _args("router", ["--max-retries", "0", "--health-fail-threshold", "3", "--no-prompt-token-ids"], config, env)
    gateway = gateway_config(args, static_workers(args))
    assert gateway.policy == "round_robin" and gateway.policy_config.load_weight == 0.25
    assert [(w.worker_id, w.model, w.block_size) for w in gateway.workers] == [("t", "m", 32), ("y", "m", 16)]
    assert (gateway.health.interval_s, gateway.health.fail_threshold) == (0.5, 3)
    assert gateway.proxy.max_retries == 0 and gateway.forward_token_ids is False
    assert gateway.admin_token == "tok" and gateway.api_keys == ("k1", "k2")


def test_disaggregation_flags_default_off_and_layer():
    args = _args("router", [])
    disagg = gateway_config(args, static_workers(args)).disagg
    assert (disagg.prefill_queue_url, disagg.max_local_prefill_tokens, disagg.max_prefill_queue_depth,
            disagg.poll_interval_s) == ("", 512, 32, 0.05)
    config = {"router": {"max_prefill_queue_depth": 8}}
    env = {"KVGATE_PREFILL_QUEUE": "redis://127.0.0.1:6379/2", "KVGATE_MAX_LOCAL_PREFILL_TOKENS": "1024"}
    args = _args("router", ["--prefill-queue-poll-interval", "0.2"], config, env)
    disagg = gateway_config(args, static_workers(args)).disagg
    assert (disagg.prefill_queue_url, disagg.max_local_prefill_tokens, disagg.max_prefill_queue_depth,
            disagg.poll_interval_s) == ("redis://127.0.0.1:6379/2", 1024, 8, 0.2)
    up = _args("up", ["--prefill-queue", "http://127.0.0.1:9100", "--max-local-prefill-tokens", "0"],
               env={"KVGATE_PREFILL_QUEUE_TOKEN": "t0k"})
    disagg = gateway_config(up, ()).disagg
    assert (disagg.prefill_queue_url, disagg.max_local_prefill_tokens, disagg.prefill_queue_token) == (
        "http://127.0.0.1:9100", 0, "t0k")
    assert "t0k" not in repr(disagg)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy-config", "{not json"], "--policy-config: not JSON"),
        (["--policy-config", "[1]"], "expected a JSON object"),
        (["--policy-config", json.dumps({"load_weight": -1})], "load_weight"),
        (["--health-interval", "0"], "health interval_s"),
        (["--breaker-failures", "0"], "failure_threshold"),
        (["--max-body-bytes", "10"], "max_body_bytes"),
        (["--max-concurrent-requests", "0"], "max_concurrent_requests"),
        (["--worker", "http://127.0.0.1:1"], "no model"),
        (["--worker", "id=a,url=ftp://x,model=m"], "absolute http"),
        (["--max-local-prefill-tokens", "-1"], "max_local_prefill_tokens"),
        (["--max-prefill-queue-depth", "-5"], "max_prefill_queue_depth"),
        (["--prefill-queue-poll-interval", "0"], "poll_interval_s"),
        (["--prefill-queue", "tcp://127.0.0.1:6379"], "prefill_queue_url"),
    ],
)
def test_bad_values_exit_naming_the_problem(argv, message):
    args = _args("router", argv)
    with pytest.raises(SystemExit, match=message):
        gateway_config(args, static_workers(args))


def test_the_commands_run_as_processes():
    out = subprocess.run([sys.executable, "-m", "router.cli", "--help"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert "router" in out.stdout and "up" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "router.cli", "router", "--port", "0", "--tokenizer", "/nonexistent/tok.json"],
        capture_output=True, text=True, cwd=REPO_ROOT,
    )
    assert bad.returncode != 0 and "no such tokenizer.json" in bad.stderr
    up = subprocess.run([sys.executable, "-m", "router.cli", "up", "--workers", "0"], capture_output=True, text=True,
                        cwd=REPO_ROOT)
    assert up.returncode != 0 and "--workers must be at least 1" in up.stderr
