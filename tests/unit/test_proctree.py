"""The guardian's bookkeeping of process groups (servegate.proctree)."""

from __future__ import annotations

import subprocess
import sys

from servegate import proctree


def test_a_group_found_empty_is_forgotten_so_a_reused_id_is_never_ended():
    # Kept, an empty group's id could go to a stranger (pid reuse on a busy machine), whose processes
    # the guardian would then track and end with the gate.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        tracked: dict = {}
        groups = proctree._follow_groups({sleeper.pid}, tracked)
        assert groups == {sleeper.pid} and sleeper.pid in tracked
    finally:
        sleeper.kill()
        sleeper.wait()
    tracked = {}
    assert proctree._follow_groups(groups, tracked) == set() and tracked == {}

