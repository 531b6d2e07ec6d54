import math
from pathlib import Path

import pytest

from servegate.config import MEMORY_PROFILES, GateConfig, available_profiles, load_config
from servegate.errors import ConfigError


def test_every_shipped_profile_loads():
    assert {"smoke", "cpu-nightly", "sglang-h100", "vllm-h100"} <= set(available_profiles())
    for name in available_profiles():
        cfg = load_config(profile=name)
        assert cfg.validate_.expectation_profile == name
        assert cfg.worker.memory_profile in MEMORY_PROFILES


@pytest.mark.parametrize("bad", ["0", "-1", "inf", "nan"])
def test_flush_timeout_rejected_at_load_time(bad):
    with pytest.raises(ConfigError) as err:
        load_config(profile="smoke", overrides=[f"flush.timeout_s={bad}"])
    text = str(err.value)
    assert "flush.timeout_s" in text and "finite number > 0" in text


def test_overrides_parse_yaml_values():
    cfg = load_config(profile="smoke", overrides=["one_batch.batch_sizes=[2, 3]", "serving.request_rate=inf",
                                                  "occupancy.enabled=false"])
    assert cfg.one_batch.batch_sizes == [2, 3]
    assert math.isinf(cfg.serving.request_rate)
    assert cfg.occupancy.enabled is False


def test_unknown_field_names_field_and_value(tmp_path: Path):
    p = tmp_path / "gate.toml"
    p.write_text('[worker]\nengine = "tgi"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path=p)
    assert "worker.engine" in str(err.value) and "'tgi'" in str(err.value)
    assert "embedded" in str(err.value)  # the allowed values are listed


def test_yaml_config_and_unknown_profile(tmp_path: Path):
    p = tmp_path / "gate.yaml"
    p.write_text("name: mine\nworker:\n  engine: external\n  url: http://127.0.0.1:9\n")
    cfg = load_config(path=p)
    assert cfg.name == "mine" and cfg.worker.url == "http://127.0.0.1:9"
    with pytest.raises(ConfigError, match="unknown profile 'nope'"):
        load_config(profile="nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(path=tmp_path / "missing.toml")


def test_external_needs_url_and_memory_overlay():
    with pytest.raises(Exception, match="url"):
        GateConfig.model_validate({"worker": {"engine": "external"}})
    cfg = GateConfig.model_validate({"worker": {"memory_profile": "cpu-small", "memory": {"max_total_tokens": 999}}})
    budget = cfg.worker.budget()
    assert budget.max_total_tokens == 999
    assert budget.max_running_requests == MEMORY_PROFILES["cpu-small"].max_running_requests
