"""The worker's memory high-water mark (servegate.launch.MemoryHighWater) on a real process tree."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from servegate.launch import MIB, TREE_REFRESH_SAMPLES, MemoryHighWater
from servegate.proctree import end_session

pytestmark = pytest.mark.timeout(60)

HOLD_MIB = 120
# A parent and its child each hold HOLD_MIB of touched memory (b"x" * n writes every page), say so,
# and wait; on a line from the test the child exits and the parent frees its block.
TREE = textwrap.dedent(f"""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c",
        "import sys; block = b'x' * ({HOLD_MIB} * 1024 * 1024); print('held', flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    block = b"x" * ({HOLD_MIB} * 1024 * 1024)
    print("held", flush=True)
    sys.stdin.readline()
    child.stdin.close(); child.wait(timeout=30)
    del block
    print("freed", flush=True)
    sys.stdin.readline()
""")


def test_high_water_mark_sums_the_whole_tree_and_keeps_its_peak():
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    memory = MemoryHighWater(proc.pid, interval_s=0.1).start()
    try:
        assert proc.stdout.readline().strip() == "held"
        for _ in range(3 * TREE_REFRESH_SAMPLES):  # the child is found by the next look-up of the tree
            memory.sample()
        both = memory.peak_bytes
        assert both >= 2 * HOLD_MIB * MIB, both / MIB  # parent + child, not the parent alone
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "freed"
        after = max(memory.sample() for _ in range(5))
        assert after < both - HOLD_MIB * MIB, (after / MIB, both / MIB)  # the child and the block are gone
        assert memory.peak_bytes >= both and memory.peak_mib >= 2 * HOLD_MIB  # the high-water mark stays
        assert memory.samples >= 10
    finally:
        memory.stop()
        end_session(proc, 10)
    assert not memory._thread.is_alive()


def test_no_sample_is_nan_never_zero():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    memory = MemoryHighWater(proc.pid).start()  # gone before the first sample
    memory.stop()
    assert memory.samples == 0 and memory.peak_mib != memory.peak_mib  # NaN
