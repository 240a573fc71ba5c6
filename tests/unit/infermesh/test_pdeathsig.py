"""The exec wrapper that gives each service the Linux parent-death signal (issue 28): what it
runs, and the signal it leaves set (read back with prctl). The kill -9 of a real launcher is in
tests/integration/test_launcher_kill.py."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from infermesh.pdeathsig import guarded, main, set_parent_death_signal

PR_GET_PDEATHSIG = 2


def test_the_wrapper_sets_the_parent_death_signal_and_execs() -> None:
    assert guarded(["envoy", "-c", "x"], signal.SIGINT, parent=42) == [
        sys.executable, "-m", "infermesh.pdeathsig", "2", "42", "--", "envoy", "-c", "x",
    ]  # fmt: skip
    assert main(["15", "1"]) == 2  # usage
    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.c_int()
    try:
        set_parent_death_signal(signal.SIGTERM)
        assert libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0) == 0
        assert value.value == signal.SIGTERM
    finally:
        set_parent_death_signal(0)  # this test process must not die with its parent
    # A parent that is not ours (gone before the prctl): the command does not start.
    assert main(["15", str(os.getppid() + 1), "--", "true"]) == 1
    set_parent_death_signal(0)
