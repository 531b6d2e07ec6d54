"""Bad ground under the gate: a config that is not text, a full disk, a read-only output folder.

Each is "could not decide" (exit 2) with a one-line reason that says what to do, never the
regression code 1 after a traceback, and no process or half-made run folder left behind.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultutil import REPO, SLOW_TINY, db_state, gate_env, survivors

pytestmark = [pytest.mark.gate, pytest.mark.timeout(300)]


def _servegate(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servegate", *args], cwd=REPO, env=gate_env(tmp_path),
                          capture_output=True, text=True, timeout=240)


def _reason(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("servegate:")]
    assert lines, f"no one-line reason on stderr:\n{proc.stderr[-3000:]}"
    return lines[-1]


@contextlib.contextmanager
def _tmpfs(path: Path, size: str, *options: str) -> Iterator[Path]:
    path.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path)],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {exc}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def test_binary_config_file_is_bad_input(tmp_path: Path) -> None:
    config = tmp_path / "gate.toml"
    config.write_bytes(bytes(range(256)) * 4)
    proc = _servegate(tmp_path, "run", "--config", str(config))
    assert proc.returncode == 2, proc.stderr[-3000:]
    reason = _reason(proc)
    assert str(config) in reason and "internal error" not in reason, reason


def test_full_disk_is_could_not_decide_and_leaves_no_empty_run_folder(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "full", "256k") as full:
        with contextlib.suppress(OSError), open(full / "filler", "wb") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        proc = _servegate(tmp_path, "run", "--profile", "smoke", "--output-dir", str(full / "runs"), *SLOW_TINY)
        assert proc.returncode == 2, proc.stderr[-3000:]
        reason = _reason(proc)
        assert "no space left on device" in reason and "free disk space" in reason, reason
        runs = full / "runs"
        left = [p.name for p in runs.iterdir()] if runs.is_dir() else []
        assert left == [], f"half-made run folders: {left}"
    assert not survivors(tmp_path, within_s=20)
    assert db_state(tmp_path).runs == 0


def test_read_only_output_folder_is_bad_input(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "ro", "1m", "ro") as ro:
        proc = _servegate(tmp_path, "run", "--profile", "smoke", "--output-dir", str(ro / "runs"), *SLOW_TINY)
    assert proc.returncode == 2, proc.stderr[-3000:]
    reason = _reason(proc)
    assert "output_dir" in reason and "internal error" not in reason, reason
    assert not survivors(tmp_path, within_s=20)


def test_a_suite_naming_a_column_no_stage_writes_fails_before_anything_starts(tmp_path: Path) -> None:
    # It used to be found after every measurement (an hour on a GPU nightly), as "not evaluated".
    suites = tmp_path / "expectations"
    suites.mkdir()
    doc = json.loads((REPO / "expectations" / "smoke.json").read_text())
    doc["suites"]["serving_summary"]["expectations"][0]["kwargs"]["column"] = "p90_ttft_msec"
    (suites / "smoke.json").write_text(json.dumps(doc))
    proc = _servegate(tmp_path, "run", "--profile", "smoke", "--output-dir", str(tmp_path / "runs"), *SLOW_TINY,
                      "--set", f"validate.expectations_dir={suites}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    reason = _reason(proc)
    assert "p90_ttft_msec" in reason and "never writes" in reason, reason
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert not (tmp_path / "history.db").exists()
    assert not survivors(tmp_path, within_s=10)
