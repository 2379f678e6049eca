"""Worker specs from admin bodies, --worker flags and workers files (TOML, YAML, JSON)."""

import json

import pytest

from router.worker_spec import SpecError, WorkerSpec, collect_specs, parse_worker_flag, spec_from_dict

DEFAULTS = {"model": "m", "block_size": 16}


def test_admin_body_defaults_and_normalisation():
    spec = spec_from_dict({"worker_id": "w1", "url": "http://127.0.0.1:8001/", "model": "llama", "extra": 1})
    assert spec == WorkerSpec(worker_id="w1", url="http://127.0.0.1:8001", model="llama")
    assert spec.role == "both" and spec.block_size == 16 and spec.events_endpoint is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"url": "http://a:1", "model": "m"}, "worker_id"),
        ({"worker_id": "w", "url": "ftp://a:1", "model": "m"}, "absolute http"),
        ({"worker_id": "w", "url": "http://a:1", "model": "m", "role": "boss"}, "role"),
        ({"worker_id": "w", "url": "http://a:1", "model": "m", "block_size": 0}, "block_size"),
        ({"worker_id": "w", "url": "http://a:1", "model": "m", "block_size": "16"}, "block_size"),
        ({"worker_id": "w", "url": "http://a:1", "model": "m", "events_endpoint": "http://x"}, "events_endpoint"),
        ({"worker_id": "w", "url": "http://a:1", "model": "m", "replay_endpoint": "tcp://a:2"}, "needs an events"),
        ({"worker_id": "w w", "url": "http://a:1", "model": "m"}, "worker_id"),
        ([1, 2], "expected an object"),
    ],
)
def test_bad_bodies_name_the_field(body, message):
    with pytest.raises(SpecError, match=message):
        spec_from_dict(body)


def test_strict_sources_refuse_unknown_keys():
    with pytest.raises(SpecError, match="unknown key 'evnets_endpoint'"):
        spec_from_dict({"worker_id": "w", "url": "http://a:1", "model": "m", "evnets_endpoint": "tcp://a:1"}, strict=True)


def test_flag_forms():
    bare = parse_worker_flag("http://127.0.0.1:9000", 3, DEFAULTS)
    assert (bare.worker_id, bare.url, bare.model, bare.block_size) == ("w3", "http://127.0.0.1:9000", "m", 16)
    full = parse_worker_flag(
        "id=a, url=http://h:1, events=tcp://h:2, replay=tcp://h:3, load=tcp://h:4, model=x, role=decode, block_size=32",
        0, DEFAULTS,
    )
    assert full == WorkerSpec(
        worker_id="a", url="http://h:1", model="x", role="decode", events_endpoint="tcp://h:2",
        replay_endpoint="tcp://h:3", load_endpoint="tcp://h:4", block_size=32,
    )
    with pytest.raises(SpecError, match="block_size must be an integer"):
        parse_worker_flag("url=http://h:1,block_size=big", 0, DEFAULTS)
    with pytest.raises(SpecError, match="no model"):
        parse_worker_flag("http://h:1", 0, {"model": None, "block_size": 16})
    with pytest.raises(SpecError, match="expected key=value"):
        parse_worker_flag("url=http://h:1,oops", 0, DEFAULTS)


TOML = """
[[workers]]
worker_id = "t0"
url = "http://127.0.0.1:8001"
events_endpoint = "tcp://127.0.0.1:5557"

[[workers]]
worker_id = "t1"
url = "http://127.0.0.1:8002"
model = "other"
block_size = 32
"""

YAML = """
workers:
  - worker_id: y0
    url: http://127.0.0.1:8003
    role: decode
"""


def test_files_in_every_format(tmp_path):
    toml = tmp_path / "w.toml"
    toml.write_text(TOML)
    yaml = tmp_path / "w.yaml"
    yaml.write_text(YAML)
    jsn = tmp_path / "w.json"
    jsn.write_text(json.dumps({"workers": [{"worker_id": "j0", "url": "http://127.0.0.1:8004"}]}))
    specs = collect_specs(["http://127.0.0.1:9000"], str(toml), DEFAULTS)
    assert [(s.worker_id, s.model, s.block_size) for s in specs] == [("w0", "m", 16), ("t0", "m", 16), ("t1", "other", 32)]
    assert specs[1].events_endpoint == "tcp://127.0.0.1:5557"
    (y0,) = collect_specs([], str(yaml), DEFAULTS)
    assert (y0.worker_id, y0.role, y0.model) == ("y0", "decode", "m")
    (j0,) = collect_specs([], str(jsn), DEFAULTS)
    assert j0.url == "http://127.0.0.1:8004"


def test_config_file_tables_and_duplicates(tmp_path):
    specs = collect_specs([{"worker_id": "c0", "url": "http://h:1"}], None, DEFAULTS)
    assert specs[0].worker_id == "c0" and specs[0].model == "m"
    with pytest.raises(SpecError, match="configured twice"):
        collect_specs(["id=a,url=http://h:1", "id=a,url=http://h:2"], None, DEFAULTS)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.toml", "[[workers]\n", "a.toml"),
        ("b.yaml", "workers: [\n", "invalid YAML"),
        ("c.toml", "[[servers]]\nurl='x'\n", "top-level 'workers'"),
        ("d.json", json.dumps({"workers": {}}), "must be a list"),
        ("e.json", json.dumps({"workers": [], "extra": 1}), "unknown top-level key 'extra'"),
        ("f.json", json.dumps({"workers": ["http://h:1"]}), r"workers\[0\]: expected a table"),
        ("g.json", json.dumps({"workers": [{"url": "http://h:1", "typo": 1}]}), "unknown key 'typo'"),
    ],
)
def test_bad_files_name_the_file_and_problem(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SpecError, match=message):
        collect_specs([], str(path), DEFAULTS)


def test_missing_file():
    with pytest.raises(SpecError, match="No such file"):
        collect_specs([], "/nonexistent/workers.toml", DEFAULTS)
