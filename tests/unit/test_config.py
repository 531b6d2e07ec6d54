import math
import os
from pathlib import Path

import pytest
from pydantic import BaseModel

from servegate.budgets import MEMORY_PROFILES
from servegate.config import PROFILES_DIR, GateConfig, available_profiles, load_config
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
    assert budget.max_running_requests == MEMORY_PROFILES["cpu-small"].for_engine("embedded").max_running_requests


# ---- profile names (issue 11, finding 15a) --------------------------------------------------
def test_profile_is_a_shipped_name_not_a_path(tmp_path: Path):
    """`--profile ../../x` read a TOML from outside the profiles folder (PROFILES_DIR / "<name>.toml")."""
    outside = tmp_path / "evil.toml"
    outside.write_text('name = "evil"\n')
    for name in (os.path.relpath(tmp_path / "evil", PROFILES_DIR), str(tmp_path / "evil")):
        with pytest.raises(ConfigError) as err:
            load_config(profile=name)
        assert f"unknown profile {name!r}" in str(err.value)
        assert str(available_profiles()) in str(err.value)  # the valid choices are listed


@pytest.mark.parametrize("name", ["../smoke", "../../expectations/smoke", "/etc/passwd", "a/b", ".."])
def test_expectation_profile_is_a_plain_name(name: str):
    with pytest.raises(ConfigError) as err:
        load_config(profile="smoke", overrides=[f"validate.expectation_profile={name}"])
    assert "validate.expectation_profile" in str(err.value) and "expectations_dir" in str(err.value)


# ---- durations (issue 11, finding 10) --------------------------------------------------------
DURATIONS = {
    "worker.ready_timeout_s": "seconds", "warmup.request_timeout_s": "seconds", "flush.timeout_s": "seconds",
    "flush.request_timeout_s": "seconds", "one_batch.request_timeout_s": "seconds",
    "serving.request_timeout_s": "seconds", "capacity.request_timeout_s": "seconds", "serving.slo_ttft_ms": "milliseconds",
    "serving.slo_tpot_ms": "milliseconds", "serving.slo_e2e_ms": "milliseconds",
    "serving.max_dispatch_lag_p99_ms": "milliseconds", "occupancy.scrape_interval_s": "seconds",
    "occupancy.request_timeout_s": "seconds", "quality.request_timeout_s": "seconds", "compare.days": "days",
    "max_wall_s": "seconds", "stage_max_s": "seconds", "paired.max_measure_s": "seconds",
    "paired.request_timeout_s": "seconds", "host.sample_s": "seconds",
}


def _duration_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    found = []
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name)
        sub = field.annotation if isinstance(field.annotation, type) else None
        if sub is not None and issubclass(sub, BaseModel):
            found += _duration_fields(sub, path + ".")
        elif name.endswith(("_s", "_ms")) or name in ("days",):
            found.append(path)
    return found


def test_every_duration_field_is_checked():
    """A new timeout must be a Seconds/Milliseconds/Days field, listed here and so tested below."""
    assert sorted(_duration_fields(GateConfig)) == sorted(DURATIONS)


@pytest.mark.parametrize("field", sorted(DURATIONS))
@pytest.mark.parametrize("bad,shown", [("0", "0"), ("-5", "-5"), ("inf", "inf"), ("nan", "nan"), ("true", "True")])
def test_every_duration_rejects_zero_negative_nan_inf(field: str, bad: str, shown: str):
    with pytest.raises(ConfigError) as err:
        load_config(profile="smoke", overrides=[f"{field}={bad}"])
    text = str(err.value)
    assert f"{field} = {shown}" in text, text  # the field and the value
    allowed = f"finite number > 0 ({DURATIONS[field]})" if bad != "true" else "must be a number"
    assert allowed in text, text  # what is allowed


def test_durations_accept_finite_positive_values_and_none_where_optional():
    cfg = load_config(profile="smoke", overrides=[f"{f}=0.5" for f in DURATIONS])
    assert cfg.flush.request_timeout_s == 0.5 and cfg.compare.days == 0.5 and cfg.serving.slo_e2e_ms == 0.5
    cfg = load_config(profile="smoke", overrides=["flush.request_timeout_s=null", "serving.slo_ttft_ms=null",
                                                  "compare.days=null"])
    assert (cfg.flush.request_timeout_s, cfg.serving.slo_ttft_ms, cfg.compare.days) == (None, None, None)
