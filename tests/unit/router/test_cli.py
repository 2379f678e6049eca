import argparse
import json
import subprocess
import sys

import pytest

from router import cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--endpoint", action="append", default=[])
    parser.add_argument("--name", default="x")
    return parser


def test_precedence_default_file_env_cli():
    parser = _parser()
    config = {"block_size": 32, "name": "from-file", "events": {"verbose": True}}
    env = {"KVGATE_NAME": "from-env", "KVGATE_ENDPOINT": "tcp://a:1, tcp://b:2"}
    parser.set_defaults(**cli.layered_defaults(parser, "events", config, env))
    args = parser.parse_args(["--name", "from-cli"])
    assert args.block_size == 32
    assert args.verbose is True
    assert args.endpoint == ["tcp://a:1", "tcp://b:2"]
    assert args.name == "from-cli"
    assert parser.parse_args([]).name == "from-env"


def test_top_level_keys_for_other_commands_are_ignored_but_section_keys_are_checked():
    parser = _parser()
    assert cli.layered_defaults(parser, "events", {"router_port": 1}, {}) == {}
    with pytest.raises(cli.ConfigError, match="unknown key 'nope'"):
        cli.layered_defaults(parser, "events", {"events": {"nope": 1}}, {})


@pytest.mark.parametrize(
    ("env", "message"),
    [({"KVGATE_BLOCK_SIZE": "big"}, "KVGATE_BLOCK_SIZE"), ({"KVGATE_VERBOSE": "maybe"}, "expected a boolean")],
)
def test_bad_environment_values_name_the_variable(env, message):
    with pytest.raises(cli.ConfigError, match=message):
        cli.layered_defaults(_parser(), "events", {}, env)


def test_config_file_parse_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("block_size = [")
    with pytest.raises(cli.ConfigError, match="bad.toml"):
        cli.load_config_file(str(bad))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"block_size": 8}))
    assert cli.load_config_file(str(good)) == {"block_size": 8}


def test_console_script_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "router.cli", "--help"], capture_output=True, text=True, check=True)
    assert "usage: kvgate" in out.stdout
    for name in cli.COMMANDS:
        assert name in out.stdout


def test_values_from_a_config_file_reach_the_command(tmp_path):
    config = tmp_path / "kvgate.toml"
    config.write_text('[events]\nevents = ["tcp://127.0.0.1:1"]\nblock_size = 0\n')
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "events", "--config", str(config)], capture_output=True, text=True
    )
    # The endpoint came from the file (no "give at least one --events"); so did block_size.
    assert out.returncode != 0 and "--block-size and --interval must be positive" in out.stderr
