"""What ``infermesh up`` leaves behind for the next one: a run file and a lock.

The run file (``.infermesh/up.json``) names the launcher and each service it started by PID
*and* start time (``/proc/PID/stat`` field 22, ticks since boot): a PID is reused once its
process is gone, the pair is not. A launcher that ends normally removes the file; one killed
with SIGKILL cannot, so the next ``infermesh up`` reads it, and any service it names that
still runs is a leftover: reported, or with ``--stop-leftovers`` stopped (SIGTERM, a deadline,
then SIGKILL), exactly those PIDs and no other.

The lock (``.infermesh/up.lock``, flock, holding the holder's PID) is held while a launcher
lives; the kernel drops it when the launcher dies however it dies, so "another ``infermesh
up`` is running" needs no PID guesswork and two launchers started at once cannot both pass.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from collections.abc import Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO

RUN_FILE = Path(".infermesh") / "up.json"
LOCK_FILE = Path(".infermesh") / "up.lock"
POLL_S = 0.05


@dataclass(frozen=True)
class ProcessId:
    """One process, for good: its PID and the time it started."""

    pid: int
    start: int  # /proc/PID/stat field 22 (clock ticks after boot)

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        """``pid`` as it is now (None: no such live process)."""
        start = start_time(pid)
        return None if start is None else cls(pid, start)

    def alive(self) -> bool:
        """Whether this very process still runs (a zombie has ended: it only awaits a wait)."""
        return start_time(self.pid) == self.start

    def command(self) -> str:
        """Its command line, for a person ("" once it is gone)."""
        try:
            raw = Path(f"/proc/{self.pid}/cmdline").read_bytes()
        except OSError:
            return ""
        return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat``; None when there is no such process or it is a zombie."""
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


def parse_stat(stat: str) -> int | None:
    """The start time in a ``/proc/PID/stat`` line; None for a zombie (or a dead task)."""
    # Field 2 (the name) is in parentheses and may hold spaces or ")": split after the last.
    fields = stat[stat.rindex(")") + 2 :].split()
    state, start = fields[0], fields[19]  # fields 3 and 22
    return None if state in ("Z", "X") else int(start)


@dataclass
class RunRecord:
    launcher: ProcessId
    services: dict[str, ProcessId]

    def to_json(self) -> str:
        def entry(p: ProcessId) -> dict[str, int]:
            return {"pid": p.pid, "start": p.start}

        services = {name: entry(p) for name, p in self.services.items()}
        return json.dumps({"launcher": entry(self.launcher), "services": services}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunRecord:
        data = json.loads(text)

        def proc(entry: Mapping[str, object]) -> ProcessId:
            return ProcessId(int(str(entry["pid"])), int(str(entry["start"])))

        services = {str(name): proc(e) for name, e in data.get("services", {}).items()}
        return cls(proc(data["launcher"]), services)

    def leftovers(self) -> dict[str, ProcessId]:
        """The services of this run that still run."""
        return {name: p for name, p in self.services.items() if p.alive()}


def read_record(root: Path) -> RunRecord | None:
    """The run file under ``root`` (None: none, or unreadable: nothing to go on)."""
    try:
        return RunRecord.from_json((root / RUN_FILE).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_record(root: Path, record: RunRecord) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    path = root / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(record.to_json())
    os.replace(temporary, path)


def remove_record(root: Path) -> None:
    (root / RUN_FILE).unlink(missing_ok=True)


def acquire_lock(root: Path) -> IO[bytes] | None:
    """The launcher lock under ``root``, held until the returned file is closed or this
    process dies (None: another process holds it). The file is not inherited by children;
    it names this process (``lock_holder``)."""
    path = root / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+b")  # close-on-exec, as every file Python opens
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n".encode())
    handle.flush()
    return handle


def lock_holder(root: Path) -> int | None:
    """The PID the lock names (None: not written yet, or no lock file)."""
    try:
        text = (root / LOCK_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def describe_leftovers(launcher: ProcessId, leftovers: Mapping[str, ProcessId]) -> str:
    """What the person should know: which services, their PIDs, and what to do."""
    width = max(len(name) for name in leftovers)
    lines = [
        f"a previous infermesh up (PID {launcher.pid}) ended without stopping its services; "
        f"{len(leftovers)} still run:"
    ]
    for name, proc in leftovers.items():
        lines.append(f"  {name:{width}}  PID {proc.pid:<7} {proc.command()[:100]}")
    pids = " ".join(str(p.pid) for p in leftovers.values())
    lines.append(
        "Stop them with `infermesh up --stop-leftovers` (SIGTERM, then SIGKILL after the "
        f"services' stop grace period), or `kill {pids}`, then start again."
    )
    return "\n".join(lines)


def stop_processes(
    procs: Iterable[ProcessId], grace_s: float, kill_wait_s: float = 10
) -> list[ProcessId]:
    """SIGTERM each of ``procs`` (exactly those processes), wait up to ``grace_s`` for all to
    end, SIGKILL those that did not, wait ``kill_wait_s`` more. Returns the ones that still
    run (none, unless they are not ours to kill)."""
    targets = [p for p in procs if p.alive()]
    _signal(targets, signal.SIGTERM)
    rest = _wait_gone(targets, grace_s)
    _signal(rest, signal.SIGKILL)
    return _wait_gone(rest, kill_wait_s)


def _signal(procs: Iterable[ProcessId], signum: int) -> None:
    for proc in procs:
        if proc.alive():  # checked just before: the PID is still this process
            # Gone since, or not ours to signal: then it stays in the answer.
            with suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signum)


def _wait_gone(procs: list[ProcessId], timeout_s: float) -> list[ProcessId]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in procs if p.alive()]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(POLL_S)
