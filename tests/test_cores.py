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


def test_a_run_takes_back_the_left_out_core_once_it_is_free():
    """Training that started beside a busy core gets it (and a thread on it) back between
    steps once that core is free, and keeps off it while it stays busy."""
    import torch

    from draftsmith.train.share_cores import RegainCores

    allowed, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    busy_core = allowed[-1]
    loads = {c: 0.05 for c in allowed}
    loads[busy_core] = 0.97
    try:
        assert avoid_busy_cores(measure=lambda _s: loads) is not None
        torch.set_num_threads(len(allowed) - 1)
        regain = RegainCores(every_s=0.0, measure=lambda: loads)
        regain.on_train_batch_start(None, None, None, 0)  # still busy: nothing changes
        assert sorted(os.sched_getaffinity(0)) == allowed[:-1] and not regain.done
        loads[busy_core] = 0.10
        regain.on_train_batch_start(None, None, None, 1)
        assert sorted(os.sched_getaffinity(0)) == allowed and regain.done
        assert torch.get_num_threads() == len(allowed)
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)
