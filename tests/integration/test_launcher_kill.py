"""``infermesh up`` killed outright (issue 28): a SIGKILL of the launcher once the mesh is up
takes every process of the mesh with it (the parent-death signal), so the next launch on the
same ports starts cleanly; a previous run's leftovers are reported, and stopped with
``--stop-leftovers``; a busy port stops the launch before anything starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from subprocess import PIPE, CompletedProcess

import pytest

from infermesh.runfile import ProcessId, RunRecord, read_record, write_record
from tests.scenarios.harness import ComposeMesh
from tests.support import descendants, stop_process, wait_for

pytestmark = pytest.mark.integration

EXIT_DEADLINE_S = 60  # a model server drains on its SIGTERM (2 s idle); a hung one shows here


def mesh_processes(launcher: int) -> dict[ProcessId, str]:
    """Every process below the launcher now (services, Envoy, their children): name by id."""
    found = {}
    for pid in descendants(launcher):
        proc = ProcessId.of(pid)
        if proc is not None:
            found[proc] = Path(f"/proc/{pid}/comm").read_text().strip()
    return found


def kill_exactly(procs: Iterable[ProcessId]) -> None:
    """SIGKILL those of ``procs`` (processes this test's mesh started) that still run."""
    for proc in procs:
        if proc.alive():
            os.kill(proc.pid, signal.SIGKILL)


def test_a_killed_launcher_takes_every_process_of_the_mesh_with_it(
    demo_repo: Path, tmp_path: Path
) -> None:
    mesh = ComposeMesh(tmp_path, demo_repo)
    tree: dict[ProcessId, str] = {}
    try:
        mesh.start()
        launcher = mesh.launcher
        assert launcher is not None
        services = mesh.pids()
        tree = mesh_processes(launcher.pid)
        assert set(services.values()) <= {p.pid for p in tree}
        envoy = ProcessId.of(services["envoy"])
        assert envoy is not None and tree[envoy] == "envoy"  # the bootstrap exec'd Envoy
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        killed = time.monotonic()
        wait_for(
            lambda: not [p for p in tree if p.alive()],
            EXIT_DEADLINE_S,
            f"every process of the mesh to exit: {sorted(tree.values())}",
        )
        print(f"\n{len(tree)} processes exited {time.monotonic() - killed:.1f} s after the kill")
        # The run file outlived the launcher (it could not remove it) and names what it ran;
        # none of it runs, so the next launch forgets it and starts on the same ports.
        record = read_record(tmp_path)
        assert record is not None and record.launcher.pid == launcher.pid
        assert {name: p.pid for name, p in record.services.items()} == services
        mesh.launch()
        assert "still run" not in mesh.log.read_text()
        assert mesh.stop() == 0
        assert read_record(tmp_path) is None  # a launcher that stops cleanly leaves none
    finally:
        mesh.stop()
        kill_exactly(tree)  # only on failure: what the killed launcher left


def run_up(command: list[str], cwd: Path, timeout: float = 60) -> CompletedProcess[str]:
    """An ``infermesh up`` that must end by itself. One that does not (it started the mesh
    instead) is killed with every process it started, and fails the test."""
    with subprocess.Popen(command, cwd=cwd, stdout=PIPE, stderr=PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            started = mesh_processes(proc.pid)
            proc.kill()
            kill_exactly(started)
            out, err = proc.communicate()
            pytest.fail(f"infermesh up did not end in {timeout} s:\n{out}{err}")
    return CompletedProcess(command, proc.returncode, out, err)


def sleeper_compose(directory: Path) -> Path:
    compose = directory / "compose.yaml"
    service = '{command: [python, -c, "import time; time.sleep(300)"], stop_grace_period: 1s}'
    compose.write_text(f"services:\n  a: {service}\n  b: {service}\n")
    return compose


def ignores_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))


def test_leftovers_are_reported_then_stopped_with_the_flag(tmp_path: Path) -> None:
    compose = sleeper_compose(tmp_path)
    up = [sys.executable, "-m", "infermesh.cli", "up", "--compose", str(compose),
          "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    sleep = "import signal, time; signal.signal(signal.SIGTERM, signal.{}); time.sleep(300)"
    # What a killed launcher left: service a, and service b which ignores SIGTERM.
    a = subprocess.Popen([sys.executable, "-c", sleep.format("SIG_DFL")])
    b = subprocess.Popen([sys.executable, "-c", sleep.format("SIG_IGN")])
    launcher: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: ignores_sigterm(b.pid), 30, "b to ignore SIGTERM")
        left = {name: ProcessId.of(p.pid) for name, p in (("a", a), ("b", b))}
        gone = ProcessId(int(Path("/proc/sys/kernel/pid_max").read_text()) + 1, 1)
        write_record(tmp_path, RunRecord(gone, {k: v for k, v in left.items() if v}))

        reported = run_up(up, tmp_path)
        assert reported.returncode == 1, reported.stdout + reported.stderr
        assert f"a  PID {a.pid}" in reported.stderr and f"b  PID {b.pid}" in reported.stderr
        assert "infermesh up --stop-leftovers" in reported.stderr
        assert "started" not in reported.stdout and a.poll() is None and b.poll() is None

        log = tmp_path / "up.log"
        with log.open("wb") as out:
            launcher = subprocess.Popen([*up, "--stop-leftovers"], cwd=tmp_path, stdout=out,
                                        stderr=subprocess.STDOUT)  # fmt: skip
        running = launcher
        wait_for(lambda: "mesh is up" in log.read_text() or running.poll() is not None, 60,
                 "the mesh to come up")  # fmt: skip
        assert running.poll() is None, log.read_text()
        assert a.wait(timeout=5) == -signal.SIGTERM and b.wait(timeout=5) == -signal.SIGKILL
        record = read_record(tmp_path)
        assert record is not None and record.launcher.pid == running.pid
        assert sorted(record.services) == ["a", "b"]

        refused = run_up(up, tmp_path)
        assert refused.returncode == 1
        assert f"another infermesh up (PID {running.pid}) is running" in refused.stderr
        stop_process(running, signal.SIGTERM, 30)
        assert running.returncode == 0, log.read_text()
        assert read_record(tmp_path) is None
        assert not [p for p in record.services.values() if p.alive()]
    finally:
        if launcher is not None:
            stop_process(launcher, signal.SIGTERM, 30)
        for proc in (a, b):
            stop_process(proc, signal.SIGKILL, 10)


def test_a_busy_port_stops_the_launch_before_anything_starts(
    demo_repo: Path, tmp_path: Path
) -> None:
    mesh = ComposeMesh(tmp_path, demo_repo)
    mesh.prepare()
    try:
        busy = socket.create_server(("127.0.0.1", mesh.envoy_port))
        with busy, pytest.raises(RuntimeError, match="the launcher exited"):
            mesh.launch(timeout=60)
        assert mesh.launcher is not None and mesh.launcher.returncode == 1
        log = mesh.log.read_text()
        expected = f"port {mesh.envoy_port} (control-plane-1 --listener-port): held by PID "
        assert f"{expected}{os.getpid()} (" in log, log
        assert "started (pid" not in log and "mesh is up" not in log
    finally:
        mesh.stop()
