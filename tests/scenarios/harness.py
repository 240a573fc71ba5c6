"""The compose topology run for real (``infermesh up`` on free ports) for scenario tests.

``ComposeMesh`` copies compose.yaml and deploy/topology.yaml into a work directory with every
port moved to a free one, starts the launcher as a process, waits for "mesh is up", and knows
each service's PID from the launcher's log (a restarted service gets a new one). ``stop()``
sends the launcher SIGTERM (it stops the services in reverse order) and kills it only if it
does not exit in time. ``prepare`` and ``launch`` are ``start``'s two halves: a test may
launch again in the same directory, on the same ports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from infermesh.api_keys import client_headers, ensure_local_credentials
from infermesh.secrets import ADMIN_TOKEN_FILE
from tests.envoy_support import free_port
from tests.support import ROOT, Traffic, post_json, stop_process, wait_for

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
    plane_flags: tuple[str, ...] = ()  # added to every control-plane replica's command
    sla_p99_ms: dict[str, int] = field(default_factory=dict)  # a model's SLA in the topology

    @property
    def log(self) -> Path:
        return self.workdir / "up.log"

    @property
    def envoy_port(self) -> int:
        return int(self.env["INFERMESH_ENVOY_PORT"])

    @property
    def root_ca(self) -> bytes:
        """The mesh CA, which signs the edge's certificate (compose's mesh-certs keeps it)."""
        return (self.workdir / ".infermesh" / "pki" / "ca.crt").read_bytes()

    def edge_channel(self, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A gRPC channel to Envoy's listener over TLS (edge TLS is on in compose)."""
        credentials = grpc.ssl_channel_credentials(self.root_ca)
        return grpc.secure_channel(f"127.0.0.1:{self.envoy_port}", credentials, options=options)

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
        self.prepare()
        return self.launch(timeout=timeout)

    def prepare(self) -> None:
        """The work directory (compose.yaml and the topology on free ports, the credentials)
        and the launcher's environment, once; ``launch`` may then run the launcher again."""
        compose = (ROOT / "compose.yaml").read_text()
        topology = (ROOT / "deploy" / "topology.yaml").read_text()
        names = ("ENVOY", "ENVOY_ADMIN", "XDS", "ADMIN", "OTLP", "XDS2", "ADMIN2", "OTLP2",
                 "PROMETHEUS")  # fmt: skip
        server_ports, ports = mesh_ports(len(PORTS), len(names))
        for index, old in enumerate(PORTS, start=1):
            new = str(server_ports.pop())
            port = re.compile(rf"(?<!\d){old}(?!\d)")  # not the 8001 inside 18001
            compose, topology = port.sub(new, compose), port.sub(new, topology)
            self.server_ports[f"model-server-{index}"] = int(new)
        for model, sla in self.sla_p99_ms.items():
            topology, found = re.subn(
                rf"(- name: {model}\n\s+sla_p99_ms: )\d+", rf"\g<1>{sla}", topology
            )
            assert found == 1, f"no sla_p99_ms for {model} in deploy/topology.yaml"
        if self.plane_flags:
            extra = "".join(f', "{flag}"' for flag in self.plane_flags)
            compose = re.sub(r'("--otlp-port", "\$\{INFERMESH_OTLP2?_PORT:-\d+\}")', rf"\1{extra}",
                             compose)  # fmt: skip
        if self.server_flags:
            extra = "".join(f', "{flag}"' for flag in self.server_flags)
            compose = compose.replace('"--drain-timeout", "30"', f'"--drain-timeout", "30"{extra}')
        (self.workdir / "deploy").mkdir(parents=True, exist_ok=True)
        (self.workdir / "deploy" / "topology.yaml").write_text(topology)
        (self.workdir / "compose.yaml").write_text(compose)
        (self.workdir / "models").symlink_to(self.models)
        (self.workdir / "otel").symlink_to(ROOT / "otel")
        ensure_local_credentials(self.workdir)  # what `infermesh up` would make there
        self.env = {
            **os.environ,
            **{f"INFERMESH_{name}_PORT": str(ports.pop()) for name in names},
            # The CLI's admin token (it would read ./.infermesh/admin.token otherwise)
            "INFERMESH_ADMIN_TOKEN": (self.workdir / ADMIN_TOKEN_FILE).read_text().strip(),
        }

    def launch(self, *flags: str, timeout: float = 120) -> ComposeMesh:
        """Starts ``infermesh up`` (with ``flags``) in the prepared directory, its output in
        ``log`` (replaced), and waits for "mesh is up"; raises if the launcher exits first."""
        command = [
            sys.executable, "-m", "infermesh.cli", "up",
            "--compose", str(self.workdir / "compose.yaml"),
            "--log-dir", str(self.workdir / "logs"), *flags,
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

    @property
    def api_metadata(self) -> tuple[tuple[str, str], ...]:
        """The local API key (``infermesh up`` made it) as gRPC metadata: Envoy needs it."""
        return tuple(client_headers(self.workdir).items())

    def traffic(self, clients: int, deadline_s: float, **options: Any) -> Traffic:
        """Steady load through Envoy, with the local API key."""
        url = f"127.0.0.1:{self.envoy_port}"
        metadata = (*self.api_metadata, *options.pop("metadata", ()))
        return Traffic(
            url, clients, deadline_s=deadline_s, metadata=metadata, root_ca=self.root_ca, **options
        )

    def envoy_clusters(self) -> str:
        """Envoy's admin /clusters text ("" when the admin does not answer)."""
        url = f"http://127.0.0.1:{self.env['INFERMESH_ENVOY_ADMIN_PORT']}/clusters"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return str(response.read().decode())
        except OSError:
            return ""

    def envoy_healthy(self, cluster: str = "model:classifier") -> int:
        """How many of ``cluster``'s hosts Envoy itself considers healthy right now."""
        return sum(
            1
            for line in self.envoy_clusters().splitlines()
            if line.startswith(f"{cluster}::") and line.endswith("::health_flags::healthy")
        )

    def envoy_hosts(self, cluster: str = "model:classifier") -> dict[str, dict[str, Any]]:
        """Per model-server host, across Envoy's clusters of ``cluster`` (the model's and its
        versions'): requests sent there (``rq_total``) and whether any of those clusters would
        route to it now (``healthy``). Empty when Envoy's admin does not answer."""
        hosts: dict[str, dict[str, Any]] = {}
        for line in self.envoy_clusters().splitlines():
            parts = line.split("::")
            if len(parts) != 4 or not (parts[0] == cluster or parts[0].startswith(f"{cluster}:")):
                continue
            _, address, stat, value = parts
            seen = hosts.setdefault(address, {"rq_total": 0, "healthy": False})
            if stat == "rq_total":
                seen["rq_total"] += int(value)
            elif stat == "health_flags" and value == "healthy":
                seen["healthy"] = True
        return hosts

    def admin_get(self, path: str, followed: bool = False) -> Any:
        """GET ``path`` from control-plane-1's admin API, as JSON; ``followed``: from the
        replica Envoy follows (its decisions are the ones Envoy carried out)."""
        admin = self.admins[self.followed_plane() or PLANES[0]] if followed else self.admin
        with urllib.request.urlopen(f"http://{admin}{path}", timeout=10) as response:
            return json.loads(response.read())

    def decisions(self) -> list[str]:
        """The routing decisions of the replica Envoy follows (the ones it carried out)."""
        return [d["decision"] for d in self.admin_get("/decisions", followed=True)["decisions"]]

    def post_faults(self, server: str, body: dict[str, object]) -> None:
        """POST /faults to a model server (needs --enable-fault-injection)."""
        post_json(f"http://127.0.0.1:{self.metrics_port(server)}/faults", body, timeout=30)

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
        stop_process(self.launcher, signal.SIGTERM, 120, kill_wait_s=30)
        return self.launcher.returncode

    def __enter__(self) -> ComposeMesh:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


SERVER_PORT_OFFSETS = (1000, 2000)  # a model server's metrics and REST ports by default


def mesh_ports(servers: int, others: int) -> tuple[list[int], list[int]]:
    """Free loopback ports, all different: ``servers`` gRPC ports P whose P + 1000 (metrics)
    and P + 2000 (REST) are free too, and ``others``. Every socket stays bound until all are
    chosen (one free_port() after another can return the same port twice, and a REST port
    taken by a control plane's admin once made a replica fail to start)."""
    held: list[socket.socket] = []
    used: set[int] = set()

    def hold(port: int) -> int | None:
        if port in used or port > 65535:
            return None
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            return None
        held.append(sock)
        used.add(int(sock.getsockname()[1]))
        return int(sock.getsockname()[1])

    try:
        chosen: list[int] = []
        rest: list[int] = []
        while len(chosen) < servers:
            port = hold(free_port())
            if port is not None and all(hold(port + k) for k in SERVER_PORT_OFFSETS):
                chosen.append(port)  # else what it held stays out of every choice
        while len(rest) < others:
            port = hold(free_port())
            if port is not None:
                rest.append(port)
        return chosen, rest
    finally:
        for sock in held:
            sock.close()
