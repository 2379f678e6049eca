"""The `kvgate` command line: one entry point, one subcommand per process kind.

Every flag can also come from a config file (`--config PATH`, TOML or JSON) and from
a `KVGATE_<FLAG>` environment variable (dashes become underscores). Precedence, low
to high: built-in default, config file, environment, command line. A config file
may hold top-level keys (for every command) and a table per command (`[router]`);
an unknown key is an error naming it.

Subcommands live in their own modules, imported only when run, so `kvgate --help`
stays fast and the router never imports the worker's dependencies (torch).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# name -> (module, one-line help). A module provides `add_arguments(parser)` and
# `run(args) -> int`. NOTE: no flag may be argparse-`required`: argparse would demand it
# on the command line even when the config file or the environment sets it; `run`
# checks required values instead.
COMMANDS: dict[str, tuple[str, str]] = {
    "events": ("router.events_cmd", "follow workers' KV events into a prefix index and print it"),
    "worker": ("worker.worker_cmd", "run a worker: the reference torch engine or the simulated one (sim)"),
    "router": ("router.router_cmd", "run the gateway: OpenAI API, KV-aware routing, admin API, metrics"),
    "up": ("router.up_cmd", "run a router and N local workers in one command"),
    "sidecar": ("worker.sidecar_cmd", "run beside a vLLM or SGLang engine: register it, relay its KV events, report its load"),
}

ENV_PREFIX = "KVGATE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A config file or environment value that cannot be applied; names the field."""


def load_config_file(path: str) -> dict[str, Any]:
    data = Path(path).read_bytes()
    try:
        if path.endswith(".json"):
            return json.loads(data)
        return tomllib.loads(data.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}


def _from_text(action: argparse.Action, name: str, text: str) -> Any:
    """An environment value in the form argparse would have produced."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        lowered = text.strip().lower()
        if lowered not in _TRUE | _FALSE:
            raise ConfigError(f"{name}: expected a boolean, got {text!r}")
        return lowered in _TRUE
    if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
        return [_convert(action, name, part.strip()) for part in text.split(",") if part.strip()]
    return _convert(action, name, text)


def _convert(action: argparse.Action, name: str, value: Any) -> Any:
    if action.type is None or not isinstance(value, str):
        return value
    try:
        return action.type(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {exc}") from None


def layered_defaults(
    parser: argparse.ArgumentParser,
    command: str,
    config: Mapping[str, Any],
    environ: Mapping[str, str],
) -> dict[str, Any]:
    """Defaults for `parser` from the config file and the environment."""
    actions = _actions(parser)
    defaults: dict[str, Any] = {}
    section = config.get(command, {})
    flat = {k: v for k, v in config.items() if not isinstance(v, dict)}
    for key, value in {**flat, **section}.items():
        dest = key.replace("-", "_")
        if dest not in actions:
            if key in section:
                raise ConfigError(f"config [{command}]: unknown key {key!r}")
            continue  # a top-level key meant for another command
        defaults[dest] = _convert(actions[dest], key, value)
    for dest, action in actions.items():
        name = ENV_PREFIX + dest.upper()
        if name in environ:
            defaults[dest] = _from_text(action, name, environ[name])
    return defaults


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="KV-aware router and load balancer for LLM fleets.")
    parser.add_argument("--config", help="TOML or JSON file of flag values (env: KVGATE_CONFIG)")
    subparsers = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (_, help_text) in COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def command_parser(name: str) -> tuple[argparse.ArgumentParser, Any]:
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"kvgate {name}", description=COMMANDS[name][1])
    parser.add_argument("--config", help="TOML or JSON file of flag values (env: KVGATE_CONFIG)")
    module.add_arguments(parser)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    top = build_parser()
    known, rest = top.parse_known_args(argv)
    if known.command is None:
        top.print_help()
        return 0 if not rest else 2
    parser, module = command_parser(known.command)
    sub_argv = argv[argv.index(known.command) + 1 :]
    config_only = argparse.ArgumentParser(add_help=False)
    config_only.add_argument("--config")
    config_path = config_only.parse_known_args(sub_argv)[0].config or known.config or os.environ.get("KVGATE_CONFIG")
    try:
        config = load_config_file(config_path) if config_path else {}
        parser.set_defaults(**layered_defaults(parser, known.command, config, os.environ))
    except (ConfigError, OSError) as exc:
        parser.error(str(exc))
    args = parser.parse_args(sub_argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
