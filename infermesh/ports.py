"""The ports a compose file's services listen on, whether they are free, and who holds one.

``infermesh up`` checks every port before it starts anything: a busy one is a clear error
naming the port, the service that wants it and the process that holds it, never a
half-started mesh. The ports come from the services' command lines: the port flags the mesh's
programs take, Prometheus' ``--web.listen-address``, and a model server's metrics and REST
ports, which default to its gRPC port + 1000 and + 2000 (model_server/server.py). A port named
by several services (Envoy's bootstrap names the control planes' xDS ports) is checked once.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from infermesh.compose import Service

PORT_FLAGS = (
    "--port", "--metrics-port", "--http-port", "--xds-port", "--admin-port", "--otlp-port",
    "--listener-port", "--web.listen-address",
)  # fmt: skip
# A model server's ports that default to an offset from --port (model_server/server.py).
DERIVED = {"infermesh-model-server": (("--metrics-port", 1000), ("--http-port", 2000))}
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


@dataclass(frozen=True)
class BusyPort:
    port: int
    wanted_by: str  # "control-plane-1 --listener-port"
    holder: str  # "PID 123 (envoy)", or why it is unknown


def flag_values(command: Sequence[str], flag: str) -> list[str]:
    """Every value of ``flag`` in ``command`` (``--flag V`` and ``--flag=V``)."""
    values = []
    for index, arg in enumerate(command):
        if arg == flag and index + 1 < len(command):
            values.append(command[index + 1])
        elif arg.startswith(f"{flag}="):
            values.append(arg.split("=", 1)[1])
    return values


def parse_ports(value: str) -> list[int]:
    """``8001``, ``18000,18001``, ``127.0.0.1:9090``: the ports (0 and -1, "pick one" and
    "off", are none)."""
    ports = []
    for item in value.split(","):
        text = item.strip().rsplit(":", 1)[-1]
        if text.isdigit() and 0 < int(text) < 65536:
            ports.append(int(text))
    return ports


def service_ports(service: Service) -> list[tuple[int, str]]:
    """(port, flag) for each port ``service``'s command names or implies."""
    command = service.command
    found = [(p, flag) for flag in PORT_FLAGS for v in flag_values(command, flag)
             for p in parse_ports(v)]  # fmt: skip
    base = [p for v in flag_values(command, "--port") for p in parse_ports(v)]
    for flag, offset in DERIVED.get(Path(command[0]).name, ()):
        if base and not flag_values(command, flag):
            found.append((base[0] + offset, f"{flag} (default: --port + {offset})"))
    return found


def needed_ports(services: Iterable[Service]) -> dict[int, str]:
    """Port -> the first service (in start order) that names it, with the flag."""
    needed: dict[int, str] = {}
    for service in services:
        for port, flag in service_ports(service):
            needed.setdefault(port, f"{service.name} {flag}")
    return needed


def in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could not bind ``host:port`` now (SO_REUSEADDR, as servers set it: a
    connection in TIME_WAIT does not count, a listener on it or on the wildcard does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE  # another error (EACCES) is not "in use"
    return False


def busy_ports(needed: dict[int, str]) -> list[BusyPort]:
    return [BusyPort(port, what, holder(port)) for port, what in needed.items() if in_use(port)]


def holder(port: int) -> str:
    """Who listens on ``port``: "PID 123 (envoy)", or why that is not known."""
    inodes = _listening_inodes(port)
    pids = sorted(_pids_holding(inodes)) if inodes else []
    if not pids:
        return "a process this user cannot see" if inodes else "unknown (not a TCP listener)"
    return ", ".join(f"PID {pid} ({_name(pid)})" for pid in pids)


def describe_busy(busy: Sequence[BusyPort]) -> str:
    lines = ["the mesh cannot start: ports it needs are in use (nothing was started):"]
    lines += [f"  port {b.port} ({b.wanted_by}): held by {b.holder}" for b in busy]
    lines.append(
        "Stop what holds them (a previous mesh: `infermesh up --stop-leftovers` if it was "
        "ours), or move the mesh's ports (INFERMESH_*_PORT, compose.yaml)."
    )
    return "\n".join(lines)


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def _pids_holding(inodes: set[str]) -> set[int]:
    wanted = {f"socket:[{inode}]" for inode in inodes}
    pids: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    pids.add(int(entry.name))
                    break
            except OSError:
                continue
    return pids


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
