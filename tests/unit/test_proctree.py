"""The guardian's bookkeeping of process groups (servegate.proctree)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

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



def test_pin_tree_pins_every_thread_of_every_process_of_the_tree():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    # A parent with two threads whose child has two threads, all started before pinning.
    code = ("import subprocess, sys, threading, time\n"
            "child = subprocess.Popen([sys.executable, '-c', "
            "'import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
            "time.sleep(60)'])\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "print('up', flush=True); child.wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "up"
        root = psutil.Process(parent.pid)
        for _ in range(100):  # the child's own thread may still be starting
            procs = [root, *root.children(recursive=True)]
            if len(procs) == 2 and all(p.num_threads() == 2 for p in procs):
                break
            time.sleep(0.05)
        proctree.pin_tree(parent.pid, {cpu})
        tids = [t.id for p in [root, *root.children(recursive=True)] for t in p.threads()]
        assert len(tids) == 4
        assert {frozenset(os.sched_getaffinity(t)) for t in tids} == {frozenset({cpu})}
    finally:
        proctree.terminate_tree(parent.pid, timeout_s=5)
        parent.wait(5)
