"""``infermesh up``: runs compose.yaml's services as plain processes (no container engine).

Services start in dependency order; a dependent waits for ``service_healthy`` dependencies,
whose health checks run natively (the same commands the containers run). Output goes to one
log file per service. On Ctrl-C or SIGTERM the services stop in reverse order, each with its
stop signal and grace period (model servers drain), and are killed only after it.

A launcher killed outright (SIGKILL) cannot stop them, so each child carries the Linux
parent-death signal (infermesh.pdeathsig): the kernel sends it its stop signal when the
launcher dies. The run file and lock (infermesh.runfile) let the next launcher refuse to run
beside a live one and report (or, with ``--stop-leftovers``, stop) whatever a previous run
left; every port the services need is checked free before anything starts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import IO

from infermesh.api_keys import API_KEY_FILE, ensure_local_credentials
from infermesh.certs import PKI_DIR
from infermesh.compose import Service, load_services
from infermesh.pdeathsig import guarded
from infermesh.ports import busy_ports, describe_busy, needed_ports
from infermesh.runfile import (
    ProcessId,
    RunRecord,
    acquire_lock,
    describe_leftovers,
    lock_holder,
    read_record,
    remove_record,
    stop_processes,
    write_record,
)
from infermesh.secrets import ADMIN_TOKEN_FILE, OPERATOR_KEY_FILE

POLL_S = 0.2
# A service that exits sooner than STEADY_S after it started is restarted after a pause that
# doubles each time (from 1 s, at most MAX_RESTART_PAUSE_S); one that ran longer, at once.
STEADY_S = 10.0
MAX_RESTART_PAUSE_S = 60.0


class LaunchError(RuntimeError):
    pass


@dataclass
class Running:
    service: Service
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float = field(default_factory=time.monotonic)


def _environment(service: Service) -> dict[str, str]:
    env = {**os.environ, **service.environment, "PYTHONUNBUFFERED": "1"}
    # The venv's console scripts (infermesh-model-server, ...) and python come first, as the
    # image's /opt/infermesh/bin does in containers.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _installed(program: str, root: Path, env: dict[str, str]) -> bool:
    """Whether ``program`` would exec: a path (relative to ``root``) or a name on PATH."""
    if os.sep in program:
        return os.access(root / program, os.X_OK)
    return shutil.which(program, path=env.get("PATH")) is not None


def _spawn(service: Service, root: Path, env: dict[str, str], log: IO[bytes]) -> Popen[bytes]:
    """``service``'s process, which gets its stop signal when the launcher dies, even by
    SIGKILL. The kernel sends it when the *thread* that forked the child ends: only the main
    thread, which lives as long as the launcher, may start one."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the launcher starts services from its main thread only")
    return subprocess.Popen(
        guarded(service.command, service.stop_signal), cwd=root, env=env,
        stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,  # Ctrl-C reaches the launcher only: it stops them in order
    )  # fmt: skip


def _healthy(service: Service, root: Path) -> bool:
    assert service.healthcheck is not None
    check = service.healthcheck
    try:
        result = subprocess.run(
            guarded(check.test, signal.SIGTERM), cwd=root, env=_environment(service),
            capture_output=True, timeout=check.timeout_s, check=False,
        )  # fmt: skip
    except (subprocess.TimeoutExpired, OSError):
        return False
    return result.returncode == 0


class Launcher:
    def __init__(self, compose: Path, root: Path, log_dir: Path) -> None:
        self.root = root
        self.log_dir = log_dir
        self.services = load_services(compose)
        self.running: list[Running] = []
        self.healthy: set[str] = set()
        self.stopping = threading.Event()

    def start_all(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for service in self.services:
            for dependency, condition in service.depends_on.items():
                if condition == "service_healthy" and dependency not in self.healthy:
                    raise LaunchError(f"{service.name} needs {dependency} healthy; it has no check")
            self._start(service)

    def _start(self, service: Service) -> None:
        log_path = self.log_dir / f"{service.name}.log"
        env = _environment(service)
        if not _installed(service.command[0], self.root, env):
            self._not_installed(service)
            return
        with log_path.open("ab") as log_file:
            proc = _spawn(service, self.root, env, log_file)
        self.running.append(Running(service, proc, log_path))
        self.record()
        print(f"infermesh: {service.name} started (pid {proc.pid}, log {log_path})", flush=True)
        if service.healthcheck is None:
            return
        started = time.monotonic()
        deadline = started + service.healthcheck.deadline_s
        while not _healthy(service, self.root):
            if proc.poll() is not None:
                raise LaunchError(f"{service.name} exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline or self.stopping.is_set():
                raise LaunchError(f"{service.name} not healthy in time; see {log_path}")
            time.sleep(min(service.healthcheck.interval_s, 1.0))
        self.healthy.add(service.name)
        print(f"infermesh: {service.name} healthy after {time.monotonic() - started:.1f}s")

    def _not_installed(self, service: Service) -> None:
        """An optional service (nothing depends on it) is skipped; a needed one is an error."""
        needed_by = [s.name for s in self.services if service.name in s.depends_on]
        if needed_by:
            raise LaunchError(
                f"{service.name}: {service.command[0]} is not installed "
                f"(needed by {', '.join(needed_by)})"
            )
        print(
            f"infermesh: {service.name} skipped: {service.command[0]} is not installed",
            file=sys.stderr,
        )

    def record(self) -> None:
        """The run file: this launcher and each service it runs, for the next launcher."""
        services = {r.service.name: ProcessId.of(r.proc.pid) for r in self.running}
        launcher = ProcessId.of(os.getpid())
        assert launcher is not None  # this very process
        alive = {name: p for name, p in services.items() if p is not None}
        write_record(self.root, RunRecord(launcher, alive))

    def wait(self) -> int:
        """Until a stop is asked (returns 0) or no service is left (returns 1). A service that
        exits is restarted if its policy says so, after a pause that grows while it keeps
        failing quickly (and again if the restart itself fails), waiting for its health check
        again; one whose policy says no stays stopped. Either way the others keep running, as
        under docker compose."""
        pending: dict[str, tuple[float, Service]] = {}  # name -> (restart at, the service)
        pauses: dict[str, float] = {}  # name -> the pause before its last restart
        while not self.stopping.wait(POLL_S):
            for index, running in enumerate(list(self.running)):
                code = running.proc.poll()
                if code is None:
                    continue
                service, name = running.service, running.service.name
                print(f"infermesh: {name} exited with {code}; see {running.log_path}",
                      file=sys.stderr)  # fmt: skip
                self.running.pop(index)
                self.healthy.discard(name)
                if not service.restarts_after(code):
                    print(f"infermesh: {name} not restarted (restart: {service.restart}); "
                          "the others keep running", file=sys.stderr)  # fmt: skip
                    break
                quick = time.monotonic() - running.started < STEADY_S
                pause = min(MAX_RESTART_PAUSE_S, pauses.get(name, 0.5) * 2) if quick else 0.0
                pauses[name] = pause
                pending[name] = (time.monotonic() + pause, service)
                print(f"infermesh: {name} restarting in {pause:g} s ({service.restart})",
                      flush=True)  # fmt: skip
                break  # the list changed: look again from the start
            for name, (due, service) in list(pending.items()):
                if time.monotonic() >= due and not self.stopping.is_set():
                    del pending[name]
                    self._restart(service, pending, pauses)
            if not self.running and not pending:
                print("infermesh: no service is left running", file=sys.stderr)
                return 1
        return 0

    def _restart(
        self,
        service: Service,
        pending: dict[str, tuple[float, Service]],
        pauses: dict[str, float],
    ) -> None:
        name = service.name
        try:
            self._start(service)
        except LaunchError as exc:  # not healthy in time, or exited at once: stop, try again
            for running in [r for r in self.running if r.service is service]:
                if running.proc.poll() is None:
                    running.proc.kill()
                    running.proc.wait(timeout=10)
                self.running.remove(running)
            retry = min(MAX_RESTART_PAUSE_S, max(1.0, pauses[name] * 2))
            pauses[name] = retry
            pending[name] = (time.monotonic() + retry, service)
            print(f"infermesh: {exc}; trying again in {retry:g} s", file=sys.stderr)
        order = {s.name: i for i, s in enumerate(self.services)}
        self.running.sort(key=lambda r: order[r.service.name])  # the stop order: reversed

    def stop_all(self) -> None:
        for running in reversed(self.running):
            proc, service = running.proc, running.service
            if proc.poll() is None:
                proc.send_signal(service.stop_signal)
                try:
                    proc.wait(timeout=service.stop_grace_s)
                except subprocess.TimeoutExpired:
                    print(f"infermesh: {service.name} still running; killing it", file=sys.stderr)
                    proc.kill()
                    proc.wait(timeout=10)
            print(f"infermesh: {service.name} stopped (exit {proc.returncode})", flush=True)


def up(compose: Path, root: Path, log_dir: Path, stop_leftovers: bool = False) -> int:
    lock = acquire_lock(root)
    if lock is None:
        holder = lock_holder(root)
        who = f"PID {holder}" if holder else "its PID is not written yet"
        print(
            f"infermesh: another infermesh up ({who}) is running for {root}; stop it first "
            "(Ctrl-C there, or kill -TERM that PID: it stops its services in order)",
            file=sys.stderr,
        )
        return 1
    with lock:  # held until this launcher ends; the kernel drops it if it is killed
        launcher = Launcher(compose, root, log_dir)
        problem = _clear_the_way(launcher, stop_leftovers)
        if problem is not None:
            print(f"infermesh: {problem}", file=sys.stderr)
            return 1
        return _run(launcher)


def _clear_the_way(launcher: Launcher, stop_leftovers: bool) -> str | None:
    """What stands in the mesh's way (None: nothing): a previous run's services that still
    run (stopped first with ``stop_leftovers``), or a port the services need that is busy."""
    record = read_record(launcher.root)
    leftovers = record.leftovers() if record is not None else {}
    if record is not None and leftovers and not stop_leftovers:
        return describe_leftovers(record.launcher, leftovers)
    if leftovers:
        grace = {s.name: s.stop_grace_s for s in launcher.services}
        deadline = max(grace.get(name, 10.0) for name in leftovers)
        listed = ", ".join(f"{name} (PID {p.pid})" for name, p in leftovers.items())
        print(f"infermesh: stopping the previous run's leftovers: {listed}", flush=True)
        remaining = stop_processes(leftovers.values(), deadline)
        if remaining:
            pids = " ".join(str(p.pid) for p in remaining)
            return f"could not stop PIDs {pids} (not ours to signal?); stop them, then retry"
    remove_record(launcher.root)
    busy = busy_ports(needed_ports(launcher.services))
    return describe_busy(busy) if busy else None


def _run(launcher: Launcher) -> int:
    root = launcher.root
    for path in ensure_local_credentials(root):
        print(f"infermesh: made {path} (mode 0600); keep it: the mesh's services read it")
    launcher.record()

    def on_signal(signum: int, frame: object) -> None:
        launcher.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        launcher.start_all()
        envoy_port = os.environ.get("INFERMESH_ENVOY_PORT", "8080")
        admin_port = os.environ.get("INFERMESH_ADMIN_PORT", "19000")
        print(
            f"infermesh: mesh is up. Envoy listens on 127.0.0.1:{envoy_port} (TLS: trust "
            f"{root / PKI_DIR / 'ca.crt'})\n"
            f"  call it:  {sys.executable} examples/classify.py --url 127.0.0.1:{envoy_port}\n"
            f"  status:   infermesh status   (control plane admin on 127.0.0.1:{admin_port})\n"
            "  models:   infermesh models index   (as an operator, on the servers' own ports)\n"
            f"  credentials: {root / API_KEY_FILE} (your API key: the examples send it; "
            f'curl -u "$(cat {root / API_KEY_FILE})"), {root / OPERATOR_KEY_FILE} (operator '
            f"key), {root / ADMIN_TOKEN_FILE} (admin token)\n"
            f"  mTLS:     every hop inside the mesh; certificates in {root / PKI_DIR} "
            "(`infermesh certs show`), renewed while the mesh runs\n"
            "  Ctrl-C stops the mesh (model servers drain first).",
            flush=True,
        )
        return launcher.wait()
    except LaunchError as exc:
        print(f"infermesh: {exc}", file=sys.stderr)
        return 1
    finally:
        launcher.stop_all()
        remove_record(root)  # every service stopped: nothing is left for the next launcher
