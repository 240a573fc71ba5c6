"""The container tier's harness: a Docker engine, the image, and compose.private.yaml run for
real under a project name of its own.

``DockerEngine`` uses a running engine, or starts ``dockerd`` and later stops exactly that
process. ``PrivateMesh`` brings the compose project up on a /24 no other Docker network or
host route uses and on a free host port for Envoy, and ``down()`` removes exactly its
containers, network and volume (``docker-compose down -v`` of its project). Containers are
found by the project's labels, so the harness works with Compose v2 (`docker compose`) and
Compose 1.29 (`docker-compose`), whose container names differ.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.envoy_support import free_port
from tests.support import ROOT, Traffic, stop_process, wait_for

DOCKER = os.environ.get("INFERMESH_DOCKER", "/usr/bin/docker")
COMPOSE_FILE = ROOT / "compose.private.yaml"
SERVERS = ("model-server-1", "model-server-2", "model-server-3")
PLANES = ("control-plane-1", "control-plane-2")


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    done = subprocess.run(
        [DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        what = f"docker {' '.join(args)}: exit {done.returncode}"
        raise RuntimeError(f"{what}: {done.stderr[-2000:]}")
    return done.stdout


def compose_command() -> list[str]:
    """Compose v2 where the CLI has it, else Compose 1.29 (what Debian ships)."""
    v2 = subprocess.run([DOCKER, "compose", "version"], capture_output=True, check=False)
    if v2.returncode == 0:
        return [DOCKER, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy is None:
        raise RuntimeError("neither `docker compose` nor docker-compose is installed")
    return [legacy]


class DockerEngine:
    """A Docker engine for the session: the running one, or a dockerd started (and stopped)
    here. ``started`` is the PID of the one started here, or None."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.process: subprocess.Popen[bytes] | None = None

    def answers(self) -> bool:
        # The client prints the template (an empty line) even when no daemon answers.
        version = docker("info", "--format", "{{.ServerVersion}}", timeout=20, check=False)
        return version.strip() != ""

    def start(self) -> DockerEngine:
        if self.answers():
            return self
        log = open(self.log_dir / "dockerd.log", "wb")  # noqa: SIM115 (kept for the process)
        self.process = subprocess.Popen(
            ["dockerd", "--pidfile", str(self.log_dir / "dockerd.pid")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        wait_for(self.answers, 60, "dockerd to answer", interval=0.5)
        return self

    @property
    def started(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, signal.SIGTERM, grace_s=60)


@dataclass
class PrivateMesh:
    """compose.private.yaml under project ``project`` (Docker picks its network's subnet),
    Envoy on the host's 127.0.0.1:``envoy_port``. The scaled servers are named
    ``model-server-N`` here, N their replica number."""

    workdir: Path
    project: str = field(default_factory=lambda: f"imt{os.getpid()}x{random.randrange(10**6)}")
    envoy_port: int = field(default_factory=free_port)
    extra_files: tuple[Path, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    compose_file: Path = COMPOSE_FILE
    services: tuple[str, ...] = ()  # those to bring up (with what they depend on); () all

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "INFERMESH_ENVOY_PORT": str(self.envoy_port),
            **self.environment,
        }

    def compose(self, *args: str, timeout: float = 180) -> str:
        paths = (self.compose_file, *self.extra_files)
        files = [arg for path in paths for arg in ("-f", str(path))]
        done = subprocess.run(
            [*compose_command(), "-p", self.project, *files, *args],
            capture_output=True, text=True, timeout=timeout, env=self.env, cwd=ROOT, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"compose {' '.join(args)}: exit {done.returncode}: {done.stderr}")
        return done.stdout

    def up(self, timeout: float = 180) -> PrivateMesh:
        started = time.monotonic()
        self.compose("up", "-d", *self.services, timeout=timeout)
        wait_for(lambda: self.health("envoy") == "healthy", timeout, "Envoy healthy", 0.5)
        self.up_s = time.monotonic() - started
        pki = self.workdir / "pki"
        pki.mkdir(exist_ok=True)
        state = f"{self.container('mesh-certs')}:/app/.infermesh"
        docker("cp", f"{state}/pki/ca.crt", str(pki / "ca.crt"))
        docker("cp", f"{state}/api.key", str(self.workdir / "api.key"))
        return self

    def down(self) -> None:
        """Removes exactly this project's containers, network and volume."""
        self.compose("down", "-v", "--timeout", "10", timeout=300)

    def __enter__(self) -> PrivateMesh:
        try:
            return self.up()
        except BaseException:
            self.dump_logs()
            self.down()
            raise

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.dump_logs()
        self.down()

    def dump_logs(self) -> None:
        try:
            logs = self.compose("logs", "--tail", "40", timeout=60)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            logs = f"(no logs: {exc})"
        print(f"\n--- compose logs of {self.project} ---\n{logs[-8000:]}")

    def container(self, service: str) -> str:
        """The ID of the service's container (running or not); ``model-server-N`` is replica N
        of compose.private.yaml's scaled servers (compose.yaml names its servers so)."""
        project = f"label=com.docker.compose.project={self.project}"

        def find(*filters: str) -> list[str]:
            args = (arg for f in (project, *filters) for arg in ("--filter", f))
            return docker("ps", "-aq", *args).split()

        ids = find(f"label=com.docker.compose.service={service}")
        if not ids and service in SERVERS:
            scaled, _, number = service.rpartition("-")
            ids = find(
                f"label=com.docker.compose.service={scaled}",
                f"label=com.docker.compose.container-number={number}",
            )
        if len(ids) != 1:
            raise RuntimeError(f"{service}: expected one container, found {ids}")
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        result: list[dict[str, Any]] = json.loads(docker("inspect", self.container(service)))
        return result[0]

    def health(self, service: str) -> str:
        state = self.inspect(service)["State"]
        return str(state.get("Health", {}).get("Status", state["Status"]))

    def ip(self, service: str) -> str:
        """The container's address on the mesh network."""
        (network,) = self.inspect(service)["NetworkSettings"]["Networks"].values()
        return str(network["IPAddress"])

    def cut(self, service: str, peers: list[str]) -> Partition:
        """Drops every packet between ``service`` and each of ``peers`` (services), in both
        directions, with iptables in the service container's network namespace (the host's
        iptables, through nsenter): a partition between exactly these containers, which
        `docker network disconnect` cannot make (it cuts a container from every peer)."""
        return Partition(
            self.inspect(service)["State"]["Pid"], [self.ip(peer) for peer in peers]
        ).apply()

    def address(self, service: str) -> str:
        """The server's mesh address now, IP:8001 (Docker picks the IP at each start)."""
        return f"{self.ip(service)}:8001"

    def exec(self, service: str, *command: str, timeout: float = 60) -> str:
        return docker("exec", self.container(service), *command, timeout=timeout)

    def status(self, plane: str = "control-plane-1") -> dict[str, Any]:
        result: dict[str, Any] = json.loads(
            self.exec(plane, "infermesh", "status", "--admin", "127.0.0.1:19000", "--json")
        )
        return result

    def envoy_clusters(self) -> str:
        return self.exec("envoy", "python", "-c", CLUSTERS)

    def explain(self, address: str) -> str:
        """What Envoy and the control planes say of ``address``: for a failed assertion."""
        envoy = [line for line in self.envoy_clusters().splitlines() if f"::{address}::" in line]
        planes = []
        for plane in PLANES:
            logs = subprocess.run(
                [DOCKER, "logs", "--tail", "400", self.container(plane)],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            lines = (logs.stdout + logs.stderr).splitlines()
            planes += [f"{plane}: {line}" for line in lines if address in line]
        return "\n".join(["Envoy:", *envoy, "control planes:", *planes[-30:]])

    def envoy_host_healthy(self, address: str, cluster: str = "model:classifier") -> bool:
        """Envoy's /clusters shows ``address`` healthy in ``cluster``."""
        return f"{cluster}::{address}::health_flags::healthy" in self.envoy_clusters().splitlines()

    def envoy_healthy(self, cluster: str = "model:classifier") -> int:
        """Hosts of ``cluster`` that Envoy's /clusters shows healthy."""
        lines = self.envoy_clusters().splitlines()
        return sum(
            1
            for line in lines
            if line.startswith(f"{cluster}::") and line.endswith("::health_flags::healthy")
        )

    def envoy_requests(self, address: str, cluster: str = "model:classifier") -> int:
        """Requests Envoy has sent ``address`` in ``cluster`` (its /clusters rq_total)."""
        prefix = f"{cluster}::{address}::rq_total::"
        lines = self.envoy_clusters().splitlines()
        return sum(int(line[len(prefix) :]) for line in lines if line.startswith(prefix))

    def traffic(self, clients: int, deadline_s: float) -> Traffic:
        key = (self.workdir / "api.key").read_text().strip()
        from infermesh.api_keys import basic_authorization

        return Traffic(
            f"127.0.0.1:{self.envoy_port}", clients, deadline_s=deadline_s,
            metadata=(("authorization", basic_authorization(key)),),
            root_ca=(self.workdir / "pki" / "ca.crt").read_bytes(),
        )  # fmt: skip


@dataclass
class Partition:
    """iptables DROP rules between one container (``pid``'s network namespace) and ``ips``;
    ``heal()`` deletes exactly those rules."""

    pid: int
    ips: list[str]

    def _rules(self, action: str) -> None:
        for ip in self.ips:
            for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
                subprocess.run(
                    ["nsenter", "-t", str(self.pid), "-n",
                     "iptables", action, chain, flag, ip, "-j", "DROP"],
                    check=True, capture_output=True, timeout=30,
                )  # fmt: skip

    def apply(self) -> Partition:
        self._rules("-I")
        return self

    def heal(self) -> None:
        self._rules("-D")


# Envoy's admin answers on the container's loopback only: read /clusters from inside.
CLUSTERS = (
    "import urllib.request;"
    "print(urllib.request.urlopen('http://127.0.0.1:9901/clusters', timeout=5).read().decode())"
)
