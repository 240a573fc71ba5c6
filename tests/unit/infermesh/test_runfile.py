"""The run file and lock of ``infermesh up`` (issue 28): a process is named by PID and start
time, a killed launcher's services are found as leftovers, and a live launcher is refused. No
process is started here: the test's own process stands for a live one."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from infermesh.launcher import up
from infermesh.runfile import (
    RUN_FILE,
    ProcessId,
    RunRecord,
    acquire_lock,
    describe_leftovers,
    lock_holder,
    parse_stat,
    read_record,
    remove_record,
    stop_processes,
    write_record,
)

STAT_TAIL = "S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 424242 20 21"


def no_such_pid() -> int:
    """A PID no process can have (above the kernel's maximum)."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def this_process() -> ProcessId:
    me = ProcessId.of(os.getpid())
    assert me is not None
    return me


def test_the_start_time_is_field_22_whatever_the_name_holds() -> None:
    assert parse_stat(f"77 (python) {STAT_TAIL}") == 424242
    assert parse_stat(f"77 (a) b) (c d) {STAT_TAIL}") == 424242  # ")" and spaces in the name
    assert parse_stat(f"77 (python) Z{STAT_TAIL[1:]}") is None  # a zombie has ended


def test_a_process_is_its_pid_and_its_start_time() -> None:
    me = this_process()
    assert me.alive() and "python" in me.command()
    assert not ProcessId(me.pid, me.start + 1).alive()  # the PID reused by another process
    assert ProcessId.of(no_such_pid()) is None
    assert not ProcessId(no_such_pid(), 1).alive() and ProcessId(no_such_pid(), 1).command() == ""


def test_the_record_round_trips_and_names_only_live_services(tmp_path: Path) -> None:
    me, gone = this_process(), ProcessId(no_such_pid(), 5)
    record = RunRecord(gone, {"envoy": me, "model-server-1": gone})
    write_record(tmp_path, record)
    assert read_record(tmp_path) == record
    assert [p.name for p in (tmp_path / RUN_FILE).parent.iterdir()] == ["up.json"]  # no temp
    assert record.leftovers() == {"envoy": me}
    remove_record(tmp_path)
    assert read_record(tmp_path) is None
    (tmp_path / RUN_FILE).write_text('{"launcher": {"pid": 1}}')  # torn or foreign: ignored
    assert read_record(tmp_path) is None


def test_the_lock_admits_one_launcher(tmp_path: Path) -> None:
    first = acquire_lock(tmp_path)
    assert first is not None and lock_holder(tmp_path) == os.getpid()
    assert acquire_lock(tmp_path) is None  # flock: a second open file cannot take it
    first.close()  # as the kernel does when the launcher dies, however it dies
    again = acquire_lock(tmp_path)
    assert again is not None
    again.close()


def test_the_report_names_each_leftover_and_what_to_do() -> None:
    me = this_process()
    text = describe_leftovers(ProcessId(4321, 1), {"envoy": me, "prometheus": me})
    assert "previous infermesh up (PID 4321)" in text and "2 still run" in text
    assert f"envoy       PID {me.pid}" in text and "prometheus" in text
    assert "infermesh up --stop-leftovers" in text and f"kill {me.pid} {me.pid}" in text


def test_stopping_what_has_ended_signals_nothing() -> None:
    assert stop_processes([ProcessId(no_such_pid(), 1), ProcessId(os.getpid(), 1)], 0.1) == []


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A port this test's process listens on (it stands for one a leftover holds)."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock


@pytest.fixture
def mesh_dir(tmp_path: Path, listener: socket.socket) -> Path:
    """A compose file whose service wants the listener's port. Nothing may start in these
    tests: its programs are not installed, so a launch that got that far fails at once."""
    port = listener.getsockname()[1]
    (tmp_path / "compose.yaml").write_text(
        "services:\n  certs: {command: [no-such-program-infermesh]}\n"
        f"  envoy: {{command: [no-such-program-infermesh, --port, '{port}'], "
        "depends_on: [certs]}\n"
    )
    return tmp_path


def test_up_refuses_to_run_beside_a_live_launcher(
    mesh_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_record(mesh_dir, RunRecord(ProcessId(4321, 1), {}))  # the run it started from
    held = acquire_lock(mesh_dir)  # the other launcher (this process stands for it)
    assert held is not None
    try:
        assert up(mesh_dir / "compose.yaml", mesh_dir, mesh_dir / "logs") == 1
    finally:
        held.close()
    assert f"another infermesh up (PID {os.getpid()}) is running" in capsys.readouterr().err
    assert not (mesh_dir / "logs").exists()  # nothing was started


def test_up_reports_leftovers_and_starts_nothing(
    mesh_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    me = this_process()  # stands for a service the killed launcher left (it is not stopped)
    write_record(mesh_dir, RunRecord(ProcessId(no_such_pid(), 1), {"envoy": me}))
    assert up(mesh_dir / "compose.yaml", mesh_dir, mesh_dir / "logs") == 1
    err = capsys.readouterr().err
    assert f"envoy  PID {me.pid}" in err and "--stop-leftovers" in err, err
    assert read_record(mesh_dir) is not None  # kept: it still names them
    assert not (mesh_dir / "logs").exists()


def test_up_forgets_a_run_that_left_nothing_and_names_a_busy_port(
    mesh_dir: Path, listener: socket.socket, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = ProcessId(no_such_pid(), 1)
    write_record(mesh_dir, RunRecord(gone, {"envoy": gone}))
    assert up(mesh_dir / "compose.yaml", mesh_dir, mesh_dir / "logs") == 1
    err = capsys.readouterr().err
    port = listener.getsockname()[1]
    assert f"port {port} (envoy --port): held by PID {os.getpid()} (" in err, err
    assert "nothing was started" in err and "previous infermesh up" not in err
    assert read_record(mesh_dir) is None  # the stale run file is gone, not reported
    assert not (mesh_dir / "logs").exists()
