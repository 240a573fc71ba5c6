"""``python -m infermesh.pdeathsig SIGNAL PARENT_PID -- COMMAND...``: COMMAND, exec'd in this
process (same PID), with the Linux parent-death signal set, so that the kernel sends it SIGNAL
the moment PARENT_PID (the launcher) dies, even by SIGKILL, when nobody is left to stop it.

Why an exec wrapper and not subprocess's ``preexec_fn``: ``preexec_fn`` runs Python between
fork and exec, which can deadlock the child once the parent has a second thread (a lock held
at the fork stays held), and it forces subprocess off its vfork/posix_spawn path. The wrapper
costs one interpreter start per child and stays safe whatever the launcher grows into.

The signal survives exec (Linux clears it only for a set-user-ID or file-capability program;
Envoy, Prometheus and the Python services are neither), so the service itself carries it.
It fires when the *thread* that forked the child ends, not the process: the launcher starts
every child from its main thread, which lives exactly as long as the launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(signum: int) -> None:
    """Ask the kernel for ``signum`` when this process's parent (thread) dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def guarded(command: Sequence[str], signum: int, parent: int | None = None) -> list[str]:
    """``command`` run through this wrapper: it gets ``signum`` when ``parent`` (default:
    this process) dies. Off Linux there is no such signal: ``command`` unchanged."""
    if not sys.platform.startswith("linux"):
        return list(command)
    owner = os.getpid() if parent is None else parent
    wrapper = [sys.executable, "-m", "infermesh.pdeathsig", str(int(signum)), str(owner), "--"]
    return [*wrapper, *command]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4 or args[2] != "--":
        usage = "usage: python -m infermesh.pdeathsig SIGNAL PARENT_PID -- COMMAND..."
        print(usage, file=sys.stderr)
        return 2
    signum, parent, command = signal.Signals(int(args[0])), int(args[1]), args[3:]
    set_parent_death_signal(signum)
    if os.getppid() != parent:
        # The parent died between the fork and the prctl: no signal will ever come, so the
        # command must not start (it would outlive the launcher).
        print(f"infermesh.pdeathsig: parent {parent} is gone; not starting", file=sys.stderr)
        return 1
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"infermesh.pdeathsig: {command[0]}: {exc.strerror}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    raise SystemExit(main())
