"""The private channel's directory and the shared public port.

The directory is made by ``mkdtemp`` (mode 0700, owned by the server's user) under /dev/shm
when it exists, else the temporary directory; it holds the engine's two Unix sockets and the
front ends' pool files (0600). Only the server's user (and root) can connect to the sockets
or open the pools: no credential is needed on a channel nobody else can reach.

The public port is reserved by the engine with a socket bound with SO_REUSEPORT and never
listening: the kernel gives connections only to listening sockets (the front ends'), the port
stays the server's while a front end restarts, and SO_REUSEPORT lets only sockets of the same
user join the group.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

SHM = Path("/dev/shm")


@dataclass(frozen=True)
class PrivateDirectory:
    path: Path

    @classmethod
    def create(cls) -> PrivateDirectory:
        parent = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else None
        path = Path(tempfile.mkdtemp(prefix="infermesh-engine-", dir=parent))
        info = path.stat()
        if stat.S_IMODE(info.st_mode) != 0o700 or info.st_uid != os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            raise PermissionError(f"{path}: expected mode 0700 owned by uid {os.getuid()}")
        return cls(path)

    @property
    def grpc_socket(self) -> Path:
        return self.path / "grpc.sock"

    @property
    def infer_socket(self) -> Path:
        return self.path / "infer.sock"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """A bound, non-listening SO_REUSEPORT socket on ``host:port`` (0: a free port) and its
    port; OSError (address in use) when another user's or a plain socket holds it."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock, int(sock.getsockname()[1])
