"""``infermesh up``: runs compose.yaml's services as plain processes (no container engine).

Services start in dependency order; a dependent waits for ``service_healthy`` dependencies,
whose health checks run natively (the same commands the containers run). Output goes to one
log file per service. On Ctrl-C or SIGTERM the services stop in reverse order, each with its
stop signal and grace period (model servers drain), and are killed only after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from infermesh.api_keys import API_KEY_FILE, ensure_local_credentials
from infermesh.certs import PKI_DIR
from infermesh.compose import Service, load_services
from infermesh.secrets import ADMIN_TOKEN_FILE, OPERATOR_KEY_FILE

POLL_S = 0.2


class LaunchError(RuntimeError):
    pass


@dataclass
class Running:
    service: Service
    proc: subprocess.Popen[bytes]
    log_path: Path


def _environment(service: Service) -> dict[str, str]:
    env = {**os.environ, **service.environment, "PYTHONUNBUFFERED": "1"}
    # The venv's console scripts (infermesh-model-server, ...) and python come first, as the
    # image's /opt/infermesh/bin does in containers.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _healthy(service: Service, root: Path) -> bool:
    assert service.healthcheck is not None
    check = service.healthcheck
    try:
        result = subprocess.run(
            check.test, cwd=root, env=_environment(service), capture_output=True,
            timeout=check.timeout_s, check=False,
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
        try:
            with log_path.open("ab") as log_file:
                proc = subprocess.Popen(
                    service.command, cwd=self.root, env=_environment(service),
                    stdout=log_file, stderr=subprocess.STDOUT,
                    start_new_session=True,  # Ctrl-C reaches the launcher only: it stops in order
                )  # fmt: skip
        except FileNotFoundError:
            needed_by = [s.name for s in self.services if service.name in s.depends_on]
            if needed_by:
                raise LaunchError(
                    f"{service.name}: {service.command[0]} is not installed "
                    f"(needed by {', '.join(needed_by)})"
                ) from None
            print(
                f"infermesh: {service.name} skipped: {service.command[0]} is not installed",
                file=sys.stderr,
            )
            return
        self.running.append(Running(service, proc, log_path))
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

    def wait(self) -> int:
        """Until a stop is asked (returns 0) or a service exits on its own and its restart
        policy does not bring it back (returns 1). A restarted service waits for its health
        check again; the others keep running meanwhile."""
        while not self.stopping.wait(POLL_S):
            for index, running in enumerate(list(self.running)):
                code = running.proc.poll()
                if code is None:
                    continue
                name = running.service.name
                print(
                    f"infermesh: {name} exited with {code}; see {running.log_path}",
                    file=sys.stderr,
                )
                if not running.service.restarts_after(code):
                    return 1
                self.running.pop(index)
                self.healthy.discard(name)
                print(f"infermesh: {name} restarting ({running.service.restart})", flush=True)
                try:
                    self._start(running.service)
                except LaunchError as exc:
                    print(f"infermesh: {exc}", file=sys.stderr)
                    return 1
                if self.running and self.running[-1].service is running.service:
                    self.running.insert(index, self.running.pop())  # keep the stop order
                break  # the list changed: look again from the start
        return 0

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


def up(compose: Path, root: Path, log_dir: Path) -> int:
    for path in ensure_local_credentials(root):
        print(f"infermesh: made {path} (mode 0600); keep it: the mesh's services read it")
    launcher = Launcher(compose, root, log_dir)

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
