"""Compute threads keep off a core another process keeps busy (draftsmith/cores.py)."""

import os
import subprocess
import sys
import time

import pytest

from draftsmith.cores import avoid_busy_cores, core_load

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two cores",
)


def test_a_busy_core_is_left_out_and_given_back_when_it_is_free():
    allowed = sorted(os.sched_getaffinity(0))
    busy_core = allowed[-1]
    spin = f"import os; os.sched_setaffinity(0, {{{busy_core}}})\nwhile True: pass"
    hog = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # the interpreter starts spinning
        assert core_load(0.5)[busy_core] > 0.8
        note = avoid_busy_cores()
        assert note is not None and f"{busy_core} (" in note
        assert busy_core not in os.sched_getaffinity(0)
    finally:
        hog.kill()
        hog.wait()
    assert avoid_busy_cores() is None  # nothing busy now: every core again
    assert sorted(os.sched_getaffinity(0)) == allowed
