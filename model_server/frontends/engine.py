"""``--frontends N`` (N > 1), the engine's side: the model server itself (models, batcher,
generation engine, metrics, statistics, REST, drain) with its gRPC service on a private Unix
socket, the ModelInfer channel beside it, and N front ends on the public port.

What keeps its meaning across the processes: one /metrics and one statistics view (the
engine's: every request from every front end passes its one request path); health is the
engine's, asked through a front end, so a caller sees SERVING only when both are up; the
drain is the engine's (front ends forward its NOT_SERVING and UNAVAILABLE), and its last step
stops the front ends before the engine's sockets close; the memory guard counts the front
ends' resident memory with the engine's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

from prometheus_client import Counter, Gauge

from model_server.core.memory import MemoryReading, MemorySource
from model_server.frontends.channel import EngineChannel
from model_server.frontends.pool import DEFAULT_POOL_BYTES
from model_server.frontends.private import PrivateDirectory, reserve_port
from model_server.frontends.supervisor import Supervisor, frontend_command
from model_server.server import ModelServer, ServerSettings

log = logging.getLogger("model_server.frontends")
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class FrontendSettings:
    count: int
    pool_bytes: int = DEFAULT_POOL_BYTES
    restricted_api: tuple[str, ...] = ()  # the --restricted-api values, as given
    log_level: str = "INFO"
    event_loop: str = "auto"  # the front ends run on the engine's choice


def resident_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0  # gone between listing and reading


def private_bytes(pid: int) -> int:
    """``pid``'s private anonymous resident memory (RssAnon): what it holds that no other
    process maps. A front end's pool pages are shared memory the engine maps too, and its
    libraries are page cache: both are in its RSS and would count twice."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, IndexError, ValueError):
        pass  # gone between listing and reading
    return 0


def frontend_rpc_limit(limit: int, count: int) -> int:
    """Each of ``count`` front ends' share of ``--max-concurrent-rpcs`` (0: no limit), so that
    together they admit about the limit, not ``count`` times it."""
    return 0 if limit == 0 else -(-limit // count)


class FamilyMemory:
    """A CPU host's reading with the front ends' private memory added to the engine's."""

    def __init__(self, inner: MemorySource, pids: Callable[[], list[int]]) -> None:
        self.inner = inner
        self.pids = pids

    def read(self) -> MemoryReading:
        reading = self.inner.read()
        if reading.source != "process":
            return reading  # device memory: front ends hold none
        extra = sum(private_bytes(pid) for pid in self.pids())
        return replace(reading, used_bytes=reading.used_bytes + extra)

    @property
    def device_class(self) -> str:
        return self.inner.device_class


class FrontendEngine:
    def __init__(self, settings: ServerSettings, frontends: FrontendSettings) -> None:
        self.frontends = frontends
        self.private = PrivateDirectory.create()
        try:
            self.reservation, self.port = reserve_port(settings.host, settings.port)
        except OSError:
            self.private.remove()
            raise
        self.public = settings
        engine_settings = replace(
            settings,
            listen_address=f"unix:{self.private.grpc_socket}",
            advertise_address=settings.advertise_address or f"{settings.host}:{self.port}",
        )
        self.server = server = ModelServer(engine_settings)
        self.supervisor = Supervisor(frontends.count, self._command, self._restarted)
        server.memory = FamilyMemory(server.memory, self.supervisor.pids)
        server.repository.guard.source = server.memory
        registry = server.metrics.registry
        self.restarts = Counter(
            "frontend_restarts", "Front ends restarted by the engine after they exited",
            registry=registry,
        )  # fmt: skip
        running = Gauge("frontends_running", "Front-end processes running", registry=registry)
        running.set_function(lambda: len(self.supervisor.running()))
        self.requests = Counter(
            "frontend_requests", "ModelInfer requests the engine took from each front end",
            ["frontend"], registry=registry,
        )  # fmt: skip
        self.channel: EngineChannel | None = None
        server.before_stop.append(self.stop_frontends)

    def _command(self, index: int) -> list[str]:
        s, f = self.public, self.frontends
        arguments = [
            "--index", str(index), "--directory", str(self.private.path),
            "--host", s.host, "--port", str(self.port), "--pool-bytes", str(f.pool_bytes),
            "--max-request-bytes", str(s.max_request_bytes),
            "--max-concurrent-rpcs", str(frontend_rpc_limit(s.max_concurrent_rpcs, f.count)),
            "--log-level", f.log_level,
            "--event-loop", f.event_loop, "--gc-threshold", str(s.gc_threshold),
        ]  # fmt: skip
        for spec in f.restricted_api:
            arguments += ["--restricted-api", spec]
        return frontend_command(arguments)

    def _restarted(self, index: int) -> None:
        self.restarts.inc()

    async def start(self) -> None:
        server = self.server
        await server.start()
        assert server.service is not None
        self.channel = EngineChannel(
            server.service, self.private.path, self.supervisor.on_ready, self.requests
        )
        await self.channel.start(self.private.infer_socket)
        await self.supervisor.start(START_TIMEOUT_S)
        s = self.public
        log.info(
            "model server listening: grpc=%s:%d metrics=%s http=%s advertise=%s frontends=%d "
            "(pids %s) engine pid %d, private directory %s",
            s.host,
            self.port,
            f"{s.host}:{server.metrics_port}" if server.metrics_port >= 0 else "off",
            f"{s.host}:{server.http_port}" if server.http_port >= 0 else "off",
            server.advertised,
            self.frontends.count,
            ",".join(str(pid) for pid in self.supervisor.pids()),
            os.getpid(),
            self.private.path,
        )

    async def stop_frontends(self) -> None:
        """The drain's last step, before the engine's own sockets close."""
        await self.supervisor.stop()
        if self.channel is not None:
            await self.channel.close()

    def close(self) -> None:
        """After the server stopped: the directory and the port go."""
        self.private.remove()
        self.reservation.close()
