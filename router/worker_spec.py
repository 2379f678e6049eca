"""What the router knows about a worker before talking to it, from every place it can come from.

Owns `WorkerSpec` (id, base URL, role, model, KV events / replay / load endpoints,
block size, data-parallel rank) and its three sources: the admin API's JSON body, a `--worker` flag
(`URL` or `key=value,...`), and a workers file (TOML `[[workers]]` tables, or YAML or
JSON with a `workers:` list). The registry (`router.registry`) turns specs into live
workers; `kvgate router` and the admin API call the parsers here.

Invariants: a spec that exists is valid: its URL is absolute http(s) without a
trailing slash, its endpoints are ZMQ URLs, its block size positive. Every error is a
`SpecError` naming the field and where it came from. Files and flags are strict
(an unknown key is an error, a typo must not silently drop a worker's events); the
admin body ignores unknown keys so newer workers can register with older routers.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from yarl import URL

ROLES = ("both", "decode", "prefill")
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
_SHORT_KEYS = {"id": "worker_id", "events": "events_endpoint", "replay": "replay_endpoint", "load": "load_endpoint"}

_WorkerId = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=500)]
_BlockSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
_DpRank = Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]


class SpecError(ValueError):
    """A worker description that cannot be used; the message names the field."""


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One worker as registered (the admin API's `POST /admin/workers` body)."""

    worker_id: _WorkerId
    url: _Name
    model: _Name
    role: Literal["both", "decode", "prefill"] = "both"
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    load_endpoint: str | None = None
    block_size: _BlockSize = 16
    # A data-parallel engine rank registers as a worker of its own; its KV events and
    # load reports are keyed (worker_id, dp_rank).
    dp_rank: _DpRank = 0

    def to_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


FIELDS = frozenset(WorkerSpec.__struct_fields__)


def spec_from_dict(data: Any, *, strict: bool = False, where: str = "worker") -> WorkerSpec:
    """A validated spec from a decoded JSON/TOML/YAML object (see the module docstring)."""
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: expected an object, got {type(data).__name__}")
    if strict:
        unknown = sorted(str(key) for key in data if key not in FIELDS)
        if unknown:
            raise SpecError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(FIELDS))})")
    try:
        spec = msgspec.convert(dict(data), WorkerSpec)
    except msgspec.ValidationError as exc:
        raise SpecError(f"{where}: {exc}") from None
    return _checked(spec, where)


def _checked(spec: WorkerSpec, where: str) -> WorkerSpec:
    url = URL(spec.url)
    if url.scheme not in ("http", "https") or not url.host:
        raise SpecError(f"{where}: url must be an absolute http(s) URL, got {spec.url!r}")
    for name in ("events_endpoint", "replay_endpoint", "load_endpoint"):
        endpoint = getattr(spec, name)
        if endpoint is not None and not endpoint.startswith(_ZMQ_SCHEMES):
            raise SpecError(f"{where}: {name} must be a tcp://, ipc:// or inproc:// URL, got {endpoint!r}")
    if spec.replay_endpoint is not None and spec.events_endpoint is None:
        raise SpecError(f"{where}: replay_endpoint needs an events_endpoint")
    normalized = spec.url.rstrip("/")
    return spec if normalized == spec.url else msgspec.structs.replace(spec, url=normalized)


def parse_worker_flag(text: str, position: int, defaults: Mapping[str, Any]) -> WorkerSpec:
    """`--worker URL` or `--worker id=w0,url=http://...,events=tcp://...,model=m,block_size=16`.

    Missing keys come from `defaults` (the router's `--model` and `--block-size`); a
    missing id is `w{position}`.
    """
    where = f"--worker #{position + 1}"
    text = text.strip()
    if "=" not in text.split("://", 1)[0]:
        fields: dict[str, Any] = {"url": text}
    else:
        fields = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise SpecError(f"{where}: expected key=value, got {part!r}")
            fields[_SHORT_KEYS.get(key.strip(), key.strip())] = value.strip()
    for key in ("block_size", "dp_rank"):
        if key in fields:
            try:
                fields[key] = int(fields[key])
            except ValueError:
                raise SpecError(f"{where}: {key} must be an integer, got {fields[key]!r}") from None
    return _with_defaults(fields, position, defaults, where)


def _with_defaults(fields: Mapping[str, Any], position: int, defaults: Mapping[str, Any], where: str) -> WorkerSpec:
    merged = {key: value for key, value in defaults.items() if value is not None}
    merged.setdefault("worker_id", f"w{position}")
    merged.update(fields)
    if "model" not in merged:
        raise SpecError(f"{where}: no model (give model=..., or the router's --model)")
    return spec_from_dict(merged, strict=True, where=where)


def load_workers_file(path: str | Path) -> list[Any]:
    """The `workers` list of a TOML, YAML or JSON file (by extension; TOML otherwise)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: {exc}") from None
    data = _parse_file(path, text)
    if not isinstance(data, Mapping) or "workers" not in data:
        raise SpecError(f"{path}: expected a top-level 'workers' list")
    extra = sorted(str(key) for key in data if key != "workers")
    if extra:
        raise SpecError(f"{path}: unknown top-level key {extra[0]!r} (only 'workers')")
    workers = data["workers"]
    if not isinstance(workers, list):
        raise SpecError(f"{path}: 'workers' must be a list")
    return workers


def _parse_file(path: Path, text: str) -> Any:
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            return _yaml_load(text)
        if suffix == ".json":
            return json.loads(text)
        return tomllib.loads(text)
    except (ValueError, SpecError) as exc:
        raise SpecError(f"{path}: {exc}") from None


def _yaml_load(text: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise SpecError("a YAML workers file needs PyYAML: pip install pyyaml (or use TOML)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"invalid YAML: {exc}") from None


def collect_specs(
    flags: Iterable[str | Mapping[str, Any]],
    workers_file: str | None,
    defaults: Mapping[str, Any],
) -> list[WorkerSpec]:
    """Every statically configured worker, in order; worker ids must be unique."""
    specs: list[WorkerSpec] = []
    for position, flag in enumerate(flags):
        if isinstance(flag, Mapping):  # a [[router.worker]] table in the --config file
            specs.append(_with_defaults(flag, position, defaults, f"worker #{position + 1}"))
        else:
            specs.append(parse_worker_flag(flag, position, defaults))
    if workers_file:
        for position, entry in enumerate(load_workers_file(workers_file)):
            where = f"{workers_file}: workers[{position}]"
            if not isinstance(entry, Mapping):
                raise SpecError(f"{where}: expected a table, got {type(entry).__name__}")
            specs.append(_with_defaults(entry, len(specs), defaults, where))
    seen: set[str] = set()
    for spec in specs:
        if spec.worker_id in seen:
            raise SpecError(f"worker id {spec.worker_id!r} is configured twice")
        seen.add(spec.worker_id)
    return specs
