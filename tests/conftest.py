"""Test-session environment: offline hub, a private Prefect home, no analytics; and the shared
fixtures: one Prefect server, one PostgreSQL cluster per session, a history store URL per backend.

Set before anything imports prefect or transformers (conftest is imported first).
"""

from __future__ import annotations

import itertools
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["GX_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="servegate-prefect-home-"))
os.environ.pop("PREFECT_API_URL", None)

import pytest  # noqa: E402

from pgcluster import PostgresCluster, running_cluster  # noqa: E402

_database_numbers = itertools.count(1)


@pytest.fixture(scope="session")
def prefect_harness():
    """One ephemeral Prefect server for the whole test session (~10 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(autouse=True)
def _cli_logging_left_as_found():
    """A test that runs the CLI in-process (``servegate.cli.main``) gets its logging set up for a
    command (servegate.console.configure_logging: a root handler, PREFECT_LOGGING_* defaults that
    child processes inherit); undo it, so that no later test's subprocess inherits a quiet Prefect
    console and handlers do not pile up."""
    import logging

    from servegate.console import ENV_SET

    saved_env = {name: os.environ.get(name) for name in ENV_SET}
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    yield
    for name, value in saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    for handler in [h for h in root.handlers if h not in saved_handlers]:
        root.removeHandler(handler)
    root.setLevel(saved_level)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresCluster]:
    """One throwaway PostgreSQL cluster for the whole session (~1-2 s to start), stopped at its end.
    Skipped where the server binaries are absent, except under CI=true: setup.sh installs them there."""
    try:
        cluster = running_cluster()
    except LookupError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but no PostgreSQL to test against: {exc}")
        pytest.skip(str(exc))
    try:
        yield cluster
    finally:
        cluster.stop()


class _TestDatabases:
    """The fresh PostgreSQL databases of one test, named after it (numbered: unique), dropped after it
    (the cluster stays small: each database is a copy of template1, ~7 MB)."""

    def __init__(self, cluster: PostgresCluster, test_name: str) -> None:
        self._cluster = cluster
        self._stem = re.sub(r"[^a-z0-9_]+", "_", test_name.lower())[:40].strip("_")
        self._names: list[str] = []

    def new_url(self) -> str:
        name = self._cluster.create_database(f"t{next(_database_numbers)}_{self._stem}")
        self._names.append(name)
        return self._cluster.url(name)

    def drop(self) -> None:
        for name in self._names:
            self._cluster.drop_database(name)


@pytest.fixture()
def pg_url(pg_cluster: PostgresCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """The SQLAlchemy URL of a fresh, empty PostgreSQL database of its own for this test."""
    databases = _TestDatabases(pg_cluster, request.node.name)
    yield databases.new_url()
    databases.drop()


@pytest.fixture(params=["sqlite", "postgresql"])
def new_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """Makes URLs of new, empty history databases, all on one backend: a SQLite file under tmp_path,
    or a database of its own in the session's PostgreSQL cluster."""
    if request.param == "sqlite":
        files = itertools.count(1)
        yield lambda: f"sqlite:///{tmp_path / f'history-{next(files)}.db'}"
        return
    databases = _TestDatabases(request.getfixturevalue("pg_cluster"), request.node.name)
    yield databases.new_url
    databases.drop()


@pytest.fixture()
def store_url(new_store_url: Callable[[], str]) -> str:
    """A new history database's URL, once per backend (the test runs as ``[sqlite]`` and ``[postgresql]``)."""
    return new_store_url()


_SESSION_STARTED: list[float] = []
SLOWEST_SHOWN = 10


def pytest_sessionstart(session: pytest.Session) -> None:
    import time

    _SESSION_STARTED.append(time.monotonic())


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The suite's own cost, last on the screen (CI shows where its time went on every landing): the
    session's wall time and the slowest tests whole (setup + call + teardown), beside the JUnit XML that
    ``addopts`` writes to ``test-results/junit.xml``."""
    import time
    from collections import defaultdict

    per_test: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                per_test[report.nodeid] += report.duration
    wall = time.monotonic() - _SESSION_STARTED[0] if _SESSION_STARTED else float("nan")
    terminalreporter.section("the suite's cost")
    terminalreporter.write_line(f"wall {wall:.0f} s for {len(per_test)} tests "
                                f"({sum(per_test.values()):.0f} s inside tests); the {SLOWEST_SHOWN} slowest:")
    for nodeid, seconds in sorted(per_test.items(), key=lambda kv: -kv[1])[:SLOWEST_SHOWN]:
        terminalreporter.write_line(f"  {seconds:7.1f} s  {nodeid}")
