"""Compute threads keep off a core another process keeps busy (draftsmith/core/cores.py).

The decision is tested on loads the test sets itself; the measurement on a load the test
makes itself (a process spinning on one core), waited for as a condition: other processes
on the machine change neither outcome."""

import os
import subprocess
import sys
import time

import pytest

from draftsmith.core.cores import BUSY, avoid_busy_cores, core_load

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two cores",
)


def test_a_busy_core_is_left_out_and_given_back_when_it_is_free():
    allowed = sorted(os.sched_getaffinity(0))
    busy_core = allowed[-1]
    loads = {c: 0.05 for c in allowed}
    try:
        loads[busy_core] = 0.97
        note = avoid_busy_cores(measure=lambda _s: loads)
        assert note is not None and f"{busy_core} (97%)" in note
        assert sorted(os.sched_getaffinity(0)) == allowed[:-1]
        loads[busy_core] = 0.05  # free again: every core comes back
        assert avoid_busy_cores(measure=lambda _s: loads) is None
        assert sorted(os.sched_getaffinity(0)) == allowed
        every = {c: 0.99 for c in allowed}  # all busy: nothing to gain by moving
        assert avoid_busy_cores(measure=lambda _s: every) is None
        assert sorted(os.sched_getaffinity(0)) == allowed
    finally:
        os.sched_setaffinity(0, allowed)


def test_core_load_sees_a_process_spinning_on_one_core():
    core = sorted(os.sched_getaffinity(0))[-1]
    spin = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    hog = subprocess.Popen([sys.executable, "-c", spin])
    try:
        deadline, seen = time.monotonic() + 20.0, 0.0
        while time.monotonic() < deadline:  # until the interpreter has started spinning
            seen = core_load(0.3).get(core, 0.0)
            if seen >= BUSY:
                break
        assert seen >= BUSY, f"core {core} measured {seen:.0%} busy with a process spinning on it"
    finally:
        hog.kill()
        hog.wait()
