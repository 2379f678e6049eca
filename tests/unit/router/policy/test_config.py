import math

import pytest

from router.policy import PolicyConfig, PolicyConfigError, load_config


def test_defaults_make_kv_match_rate_minus_load():
    config = load_config(None)
    assert config == PolicyConfig()
    assert (config.prefix_weight, config.load_weight) == (1.0, 1.0)
    assert (config.kv_usage_weight, config.queue_weight) == (0.0, 0.0)


def test_a_mapping_is_validated_and_converted():
    config = load_config({"load_weight": 2, "seed": 7, "busy_max_waiting": 3})
    assert config.load_weight == 2.0 and isinstance(config.load_weight, float)
    assert config.seed == 7
    assert config.busy_max_waiting == 3


def test_a_config_passes_through_unchanged():
    config = PolicyConfig(load_weight=0.5)
    assert load_config(config) is config


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"load_weight": -1}, "load_weight"),
        ({"prefix_weight": "high"}, "prefix_weight"),
        ({"busy_max_kv_usage": 1.5}, "busy_max_kv_usage"),
        ({"busy_max_waiting": -2}, "busy_max_waiting"),
        ({"busy_max_waiting": 1.5}, "busy_max_waiting"),
        ({"seed": "x"}, "seed"),
        ({"seed": True}, "seed"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ({"approx_tree_max_blocks": 0}, "approx_tree_max_blocks"),
        ({"share_tolerance": 0.0}, "share_tolerance"),
        ({"load_weight": math.inf}, "load_weight"),
        ({"temperature": math.nan}, "temperature"),
        ({"wieght": 1.0}, "wieght"),
        ({"load_prefill_share": 0, "load_requests_share": 0, "load_kv_share": 0}, "load_prefill_share"),
    ],
)
def test_bad_settings_name_their_field(changes, field):
    with pytest.raises(PolicyConfigError) as caught:
        load_config(changes)
    assert caught.value.field == field
    assert f"`{field}`" in str(caught.value)


def test_a_non_mapping_is_refused():
    with pytest.raises(PolicyConfigError) as caught:
        load_config([("load_weight", 1.0)])  # type: ignore[arg-type]
    assert caught.value.field == "$"


def test_updated_applies_changes_and_validates_them():
    config = PolicyConfig(load_weight=0.5)
    changed = config.updated({"prefix_weight": 2.0})
    assert (changed.prefix_weight, changed.load_weight) == (2.0, 0.5)
    assert config.prefix_weight == 1.0  # immutable: the original is untouched
    with pytest.raises(PolicyConfigError) as caught:
        config.updated({"temperature": -1})
    assert caught.value.field == "temperature"


def test_to_dict_round_trips():
    config = PolicyConfig(seed=3, cache_threshold=0.5)
    assert load_config(config.to_dict()) == config
