"""Secrets in the gate config (issue 11, finding 13): every JSON dump of the config — config.json,
the history database's ``runs.config``, Prefect's flow-run parameters — shows them redacted,
while the code that needs the key gets it from ``WorkerSpec.api_key_value()``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servegate.config import REDACTED, GateConfig, WorkerSpec, apply_overrides, load_config, redact_url
from servegate.errors import ConfigError
from servegate.results import RunFolder

KEY = "sk-live-0123456789"
DB_PASSWORD = "hunter2/with:odd"  # "/" and ":" parse (SQLAlchemy); a literal "@" must be %40


def _config(**worker: object) -> GateConfig:
    return GateConfig.model_validate({
        "worker": {"api_key": KEY, "env": {"HF_TOKEN": "hf_secret", "OMP_NUM_THREADS": "2"}, **worker},
        "store": {"url": "postgresql+psycopg://gate:hunter2@db.example:5432/history"},
    })


def test_json_dumps_redact_the_api_key_env_secrets_and_db_password() -> None:
    cfg = _config()
    dumped = cfg.model_dump(mode="json", by_alias=True)  # how the snapshot reaches the DB and Prefect
    text = json.dumps(dumped) + cfg.model_dump_json()
    assert KEY not in text and "hf_secret" not in text and "hunter2" not in text
    assert dumped["worker"]["api_key"] == REDACTED
    assert dumped["worker"]["env"] == {"HF_TOKEN": REDACTED, "OMP_NUM_THREADS": "2"}
    assert dumped["store"]["url"] == "postgresql+psycopg://gate:***@db.example:5432/history"
    assert KEY not in repr(cfg) and KEY not in str(cfg.worker.api_key)


def test_the_key_stays_usable_in_code_and_survives_a_python_round_trip() -> None:
    cfg = _config()
    assert cfg.worker.api_key_value() == KEY
    again = GateConfig.model_validate(cfg.model_dump(by_alias=True))  # python mode keeps the secret
    assert again.worker.api_key_value() == KEY
    assert again.store.url == "postgresql+psycopg://gate:hunter2@db.example:5432/history"  # code reads it as is


def test_config_json_in_the_run_folder_holds_no_secret(tmp_path: Path) -> None:
    cfg = _config(url="http://gate:hunter2@127.0.0.1:9", engine="external")
    folder = RunFolder.create(tmp_path, "smoke")
    text = folder.write_config(cfg).read_text() + (folder.path / "manifest.json").read_text()
    assert KEY not in text and "hunter2" not in text and "hf_secret" not in text
    snapshot = json.loads((folder.path / "config.json").read_text())
    assert snapshot["worker"]["url"] == "http://gate:***@127.0.0.1:9"


def test_a_reloaded_snapshot_refuses_its_placeholder_instead_of_sending_it() -> None:
    snapshot = _config().model_dump(mode="json", by_alias=True)
    reloaded = GateConfig.model_validate(snapshot)  # the snapshot still loads (rerun, history) ...
    with pytest.raises(ConfigError, match="--set worker.api_key=KEY"):
        reloaded.worker.api_key_value()  # ... but its placeholder is never sent as a token
    with pytest.raises(ConfigError, match="placeholder"):
        WorkerSpec(api_key="**********").api_key_value()  # SecretStr's own str()


def test_a_snapshot_takes_its_key_back_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = apply_overrides(_config().model_dump(mode="json", by_alias=True), ["worker.api_key_env=GATE_TEST_KEY"])
    monkeypatch.setenv("GATE_TEST_KEY", KEY)
    worker = GateConfig.model_validate(snapshot).worker  # the placeholder gives way to the variable
    assert worker.api_key is None and worker.api_key_value() == KEY


def test_api_key_env_names_the_variable_read_at_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_config(profile="smoke", overrides=["worker.api_key_env=GATE_TEST_KEY"]).worker
    monkeypatch.delenv("GATE_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"\$GATE_TEST_KEY, which is not set"):
        spec.api_key_value()
    monkeypatch.setenv("GATE_TEST_KEY", KEY)
    assert spec.api_key_value() == KEY
    assert KEY not in spec.model_dump_json() and spec.model_dump(mode="json")["api_key_env"] == "GATE_TEST_KEY"


def test_api_key_env_is_a_name_and_excludes_api_key() -> None:
    with pytest.raises(ConfigError, match="worker.api_key_env.*environment variable name"):
        load_config(profile="smoke", overrides=[f"worker.api_key_env={KEY}"])
    with pytest.raises(ConfigError, match="either api_key or api_key_env"):
        load_config(profile="smoke", overrides=[f"worker.api_key={KEY}", "worker.api_key_env=GATE_TEST_KEY"])


def test_no_key_and_empty_key_mean_no_authentication() -> None:
    assert WorkerSpec().api_key_value() is None
    assert WorkerSpec(api_key="").api_key_value() is None


@pytest.mark.parametrize("url,shown", [
    ("postgresql://gate:hunter2@db:5432/h", "postgresql://gate:***@db:5432/h"),
    (f"postgresql+psycopg://gate:{DB_PASSWORD}@db/h", "postgresql+psycopg://gate:***@db/h"),
    ("mysql://u:p%40ss@db/h?charset=utf8", "mysql://u:***@db/h?charset=utf8"),
    ("https://user:tok@host:8000/v1?x=1", "https://user:***@host:8000/v1?x=1"),
    ("postgresql://gate@db/h", "postgresql://gate@db/h"),
    ("sqlite:////var/lib/servegate/history.db", "sqlite:////var/lib/servegate/history.db"),
    ("/home/ci/history.db", "/home/ci/history.db"),
    (None, None),
])
def test_redact_url(url: str | None, shown: str | None) -> None:
    assert redact_url(url) == shown
