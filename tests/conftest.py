"""Test-session environment: offline hub, a private Prefect home, no analytics.

Set before anything imports prefect or transformers (conftest is imported first).
"""

from __future__ import annotations

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["GX_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="servegate-prefect-home-"))
os.environ.pop("PREFECT_API_URL", None)

import pytest  # noqa: E402


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
