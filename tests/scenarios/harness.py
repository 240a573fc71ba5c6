"""The compose topology run for real (``infermesh up`` on free ports) for scenario tests.

``ComposeMesh`` copies compose.yaml and deploy/topology.yaml into a work directory with every
port moved to a free one, starts the launcher as a process, waits for "mesh is up", and knows
each service's PID from the launcher's log (a restarted service gets a new one). ``stop()``
sends the launcher SIGTERM (it stops the services in reverse order) and kills it only if it
does not exit in time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.envoy_support import free_port
from tests.support import ROOT, wait_for

PORTS = ("8001", "8002", "8003")  # model servers, in compose.yaml and deploy/topology.yaml
PLANES = ("control-plane-1", "control-plane-2")
STARTED = re.compile(r"infermesh: (\S+) started \(pid (\d+)")


@dataclass
class ComposeMesh:
    workdir: Path
    models: Path
    env: dict[str, str] = field(default_factory=dict)
    launcher: subprocess.Popen[bytes] | None = None
    server_ports: dict[str, int] = field(default_factory=dict)  # "model-server-1" -> port
    server_flags: tuple[str, ...] = ()  # added to every model server's command

    @property
    def log(self) -> Path:
        return self.workdir / "up.log"

    @property
    def envoy_port(self) -> int:
        return int(self.env["INFERMESH_ENVOY_PORT"])

    @property
    def admin(self) -> str:
        """control-plane-1's admin HOST:PORT."""
        return self.admins["control-plane-1"]

    @property
    def admins(self) -> dict[str, str]:
        """Each control-plane replica's admin HOST:PORT."""
        ports = (self.env["INFERMESH_ADMIN_PORT"], self.env["INFERMESH_ADMIN2_PORT"])
        return {name: f"127.0.0.1:{port}" for name, port in zip(PLANES, ports, strict=True)}

    def followed_plane(self) -> str | None:
        """The replica whose ADS stream Envoy holds now (None: neither)."""
        for name, admin in self.admins.items():
            try:
                with urllib.request.urlopen(f"http://{admin}/status", timeout=5) as response:
                    nodes = json.loads(response.read())["nodes"]
            except OSError:
                continue
            if any(node["connected"] for node in nodes):
                return name
        return None

    def start(self, timeout: float = 120) -> ComposeMesh:
        compose = (ROOT / "compose.yaml").read_text()
        topology = (ROOT / "deploy" / "topology.yaml").read_text()
        for index, old in enumerate(PORTS, start=1):
            new = str(free_port())
            port = re.compile(rf"(?<!\d){old}(?!\d)")  # not the 8001 inside 18001
            compose, topology = port.sub(new, compose), port.sub(new, topology)
            self.server_ports[f"model-server-{index}"] = int(new)
        if self.server_flags:
            extra = "".join(f', "{flag}"' for flag in self.server_flags)
            compose = compose.replace('"--drain-timeout", "30"', f'"--drain-timeout", "30"{extra}')
        (self.workdir / "deploy").mkdir(parents=True, exist_ok=True)
        (self.workdir / "deploy" / "topology.yaml").write_text(topology)
        (self.workdir / "compose.yaml").write_text(compose)
        (self.workdir / "models").symlink_to(self.models)
        (self.workdir / "otel").symlink_to(ROOT / "otel")
        names = ("ENVOY", "ENVOY_ADMIN", "XDS", "ADMIN", "OTLP", "XDS2", "ADMIN2", "OTLP2",
                 "PROMETHEUS")  # fmt: skip
        self.env = {
            **os.environ,
            **{f"INFERMESH_{name}_PORT": str(free_port()) for name in names},
        }
        command = [
            sys.executable, "-m", "infermesh.cli", "up",
            "--compose", str(self.workdir / "compose.yaml"),
            "--log-dir", str(self.workdir / "logs"),
        ]  # fmt: skip
        with self.log.open("wb") as out:
            self.launcher = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT
            )
        launcher = self.launcher
        wait_for(
            lambda: "mesh is up" in self.log.read_text() or launcher.poll() is not None,
            timeout,
            "the mesh to come up",
        )
        if launcher.poll() is not None:
            raise RuntimeError(f"the launcher exited:\n{self.log.read_text()[-3000:]}")
        return self

    def envoy_healthy(self, cluster: str = "model:classifier") -> int:
        """How many of ``cluster``'s hosts Envoy itself considers healthy right now."""
        url = f"http://127.0.0.1:{self.env['INFERMESH_ENVOY_ADMIN_PORT']}/clusters"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return 0
        return sum(
            1
            for line in text.splitlines()
            if line.startswith(f"{cluster}::") and line.endswith("::health_flags::healthy")
        )

    def metrics_port(self, server: str) -> int:
        """A model server's metrics (and /faults) port: its gRPC port + 1000, the default."""
        return self.server_ports[server] + 1000

    def pids(self) -> dict[str, int]:
        """Each service's newest PID (restarts included)."""
        return {name: int(pid) for name, pid in STARTED.findall(self.log.read_text())}

    def starts(self, service: str) -> int:
        return sum(1 for name, _ in STARTED.findall(self.log.read_text()) if name == service)

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "infermesh.cli", *args], cwd=ROOT, env=self.env,
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        return done.stdout + done.stderr

    def stop(self) -> int | None:
        if self.launcher is None:
            return None
        if self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)
            try:
                return self.launcher.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.launcher.kill()
                self.launcher.wait(timeout=30)
        return self.launcher.returncode

    def __enter__(self) -> ComposeMesh:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
