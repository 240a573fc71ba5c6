"""Assembles the model server: gRPC services, health, metrics, startup loading, polling, drain.

Why it is one module of this length: it is the composition root, the one place that knows in
which order the parts (each in its own package) start and stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from tritonclient.grpc import service_pb2_grpc

from infermesh import event_loop, pki
from model_server.core import collector
from model_server.core.faults import FaultInjector
from model_server.core.memory import (
    MemoryGuard,
    MemorySource,
    NvmlMemory,
    ProcessMemory,
    default_memory_budget,
    format_bytes,
)
from model_server.core.runtime import DeviceChoice, choose_device
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.metrics import ServerMetrics
from model_server.observability.telemetry import OtlpExporter
from model_server.observability.tracing import Tracing
from model_server.protocol.admin_http import AdminServer, start_admin_server
from model_server.protocol.rest import RestServer
from model_server.protocol.service import InferenceService
from model_server.protocol.shared_memory_tensors import SystemSharedMemory
from model_server.scheduling.gate import ServingGate
from model_server.security.access import RestrictedApiInterceptor, Restriction, restriction_table
from model_server.security.peers import RELOAD_CHECK_S, MeshAccessInterceptor, ServerTls, TlsFiles

log = logging.getLogger("model_server")

HEALTH_SERVICES = ("", "inference.GRPCInferenceService")
MEMORY_SAMPLE_INTERVAL_S = 1.0
DRAIN_QUIET_S = 0.2  # no arrivals for this long before the listener closes
GRPC_HEADROOM_BYTES = 16 * 1024 * 1024  # tensors are checked in code; gRPC's cap sits above


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8001
    metrics_port: int | None = None  # None: port + 1000 (0 when port is 0); -1 disables
    http_port: int | None = None  # KServe v2 REST; None: port + 2000 (0 when port is 0); -1 off
    model_repository: Path = Path("models")
    models: tuple[str, ...] | None = None  # None: every model in the repository
    device: str = "auto"
    memory_budget: int | None = None
    drain_delay: float = 2.0
    drain_timeout: float = 30.0
    advertise_address: str | None = None
    max_request_bytes: int = 64 * 1024 * 1024
    # RPCs in the server at once, past which gRPC answers RESOURCE_EXHAUSTED before any Python
    # runs (0: no limit). Admission control where the queue cannot see the backlog: under
    # overload calls pile up in gRPC and the event loop before they reach the batcher.
    max_concurrent_rpcs: int = 0
    # Triton's --model-control-mode: none (load at start, refuse loads/unloads), explicit
    # (loads/unloads through the API), poll (load at start, reload what changes on disk).
    model_control_mode: str = "none"
    repository_poll_interval: float = 15.0  # seconds between scans in poll mode
    # --restricted-api: which API groups need which credential header (model_server.security.access)
    restrictions: tuple[Restriction, ...] = ()
    # HOST:PORT of each OTLP/gRPC metrics receiver (one per control-plane replica)
    otlp_endpoints: tuple[str, ...] = ()
    trace_endpoint: str | None = None  # HOST:PORT of an OTLP/gRPC trace receiver
    telemetry_interval: float = 1.0
    enable_fault_injection: bool = False
    labels: tuple[tuple[str, str], ...] = ()  # routing labels (--label); device_class is auto
    tls: TlsFiles | None = None  # mutual TLS on gRPC and REST (security.peers); None: off
    tls_pod: str = ""  # NAMESPACE/POD: on Kubernetes the certificate names the pod
    # gRPC on this address instead of host:port ("unix:PATH": the engine of --frontends N)
    listen_address: str | None = None
    # --gc-threshold (core.collector; the CLI tunes the process with it): above 0, what is
    # alive once the models load, and after each load or unload, is frozen out of later
    # garbage collections, here and in the front ends. 0 by default, so a server built in a
    # test process does not freeze that process's objects.
    gc_threshold: int = 0

    def resolved_metrics_port(self) -> int:
        if self.metrics_port is not None:
            return self.metrics_port
        return 0 if self.port == 0 else self.port + 1000

    def resolved_http_port(self) -> int:
        if self.http_port is not None:
            return self.http_port
        return 0 if self.port == 0 else self.port + 2000


def memory_source(device: DeviceChoice, budget: int | None) -> MemorySource:
    if device.kind == "cuda":
        return NvmlMemory(device.index)
    return ProcessMemory(budget or default_memory_budget())


class ModelServer:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = ServerMetrics()
        self.device = choose_device(settings.device)
        self.memory = memory_source(self.device, settings.memory_budget)
        labels = {"device_class": self.memory.device_class, **dict(settings.labels)}
        for name, value in sorted(labels.items()):
            self.metrics.label.labels(name, value).set(1)
        self.repository = ModelRepository(
            settings.model_repository.resolve(),
            self.device,
            MemoryGuard(self.memory),
            self.metrics,
        )
        self.required: set[str] = set(settings.models or ())
        self.startup_done = False
        self.draining = False
        self.gate = ServingGate(ready=self.is_ready)
        self.metrics.in_flight.set_function(lambda: self.gate.in_flight)  # read at scrape time
        self.health = HealthServicer()
        self.grpc_server: grpc.aio.Server | None = None
        self.port = 0
        self.metrics_port = -1
        self.http_port = -1
        self._rest: RestServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.tracing: Tracing | None = None
        self._http: AdminServer | None = None
        self.faults = FaultInjector(settings.enable_fault_injection)
        self.exporters: list[OtlpExporter] = []
        self.tls = self._server_tls(settings)
        self.shared_memory = SystemSharedMemory.of(restriction_table(settings.restrictions))
        self.service: InferenceService | None = None  # set by start()
        self.before_stop: list[Callable[[], Awaitable[None]]] = []  # e.g. the front ends' stop

    def _server_tls(self, settings: ServerSettings) -> ServerTls | None:
        """The checked certificate (raises pki.CertificateError, naming the file, when the
        server must not start). Its identity must be the advertised address's (on Kubernetes
        its pod's: ``--tls-pod``)."""
        if settings.tls is None:
            return None
        if settings.port == 0 and not settings.tls_pod and not settings.advertise_address:
            raise pki.CertificateError(
                f"{settings.tls.cert}: a certificate names its server's address; give --port "
                "a fixed port (or --advertise-address), not 0"
            )
        address = settings.advertise_address or f"{settings.host}:{settings.port}"
        expect = pki.server_workload(address, settings.tls_pod).spiffe_id
        tls = ServerTls(settings.tls, expect, self.metrics.certificate_reload_failures.inc)
        self.metrics.certificate_expiry.set_function(lambda: tls.current.not_after.timestamp())
        return tls

    def is_ready(self) -> bool:
        return (
            self.startup_done
            and not self.draining
            and all(self.repository.is_ready(name) for name in self.required)
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def refresh_health(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.is_ready()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in HEALTH_SERVICES:
            await self.health.set(service, status)

    def on_repository_change(self, name: str, loaded: bool) -> None:
        """A model was loaded or unloaded through the API: it is (no longer) required."""
        if loaded and self.repository.is_ready(name):
            self.required.add(name)
        elif not loaded:
            self.required.discard(name)
        self._settle_collector()  # an unloaded model's cycles are freed, a new one frozen
        self._spawn(self.refresh_health())

    def _settle_collector(self) -> None:
        if self.settings.gc_threshold > 0:
            collector.settle()

    async def start(self) -> None:
        s = self.settings
        limit = s.max_request_bytes + GRPC_HEADROOM_BYTES
        restricted = restriction_table(s.restrictions)
        interceptors: list[grpc.aio.ServerInterceptor] | None = None
        if self.tls is not None:  # every call's peer checked (and the restricted groups)
            interceptors = [MeshAccessInterceptor(self.tls.trust_domain, restricted)]
        elif restricted:  # no interceptor without restrictions: every call would pay for it
            interceptors = [RestrictedApiInterceptor(restricted)]
        self.grpc_server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=s.max_concurrent_rpcs or None,
        )
        service = InferenceService(
            self.repository,
            self.metrics,
            self.gate,
            s.max_request_bytes,
            self.on_repository_change,
            self.faults,
            model_control=s.model_control_mode,
            shared_memory=self.shared_memory,
        )
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(service, self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        await self.refresh_health()  # NOT_SERVING until the models are READY
        self.service = service
        address = s.listen_address or f"{s.host}:{s.port}"
        self.port = (
            self.grpc_server.add_secure_port(address, self.tls.grpc_credentials())
            if self.tls is not None
            else self.grpc_server.add_insecure_port(address)
        )
        # Spans name the endpoint by its advertised address, known once the port is bound.
        self.tracing = service.tracing = Tracing(s.trace_endpoint, self.advertised)
        await self.grpc_server.start()
        if s.resolved_metrics_port() >= 0:
            self._http = start_admin_server(
                s.host,
                s.resolved_metrics_port(),
                self.metrics.registry,
                self.faults,
                self.refresh_memory,
                self.is_ready,  # a read of flags and dicts from the HTTP thread
            )
            self.metrics_port = self._http.server_address[1]
        if s.resolved_http_port() >= 0:
            self._rest = RestServer(
                service, s.max_request_bytes, s.max_concurrent_rpcs, restricted, self.tls
            )
            self.http_port = await self._rest.start(s.host, s.resolved_http_port())
        reading = self.memory.read()
        if s.enable_fault_injection:
            log.warning("fault injection enabled: POST /faults on the metrics port")
        log.info(
            "model control mode %s; restricted API groups: %s; event loop %s",
            s.model_control_mode,
            ", ".join(f"{g} (header {r.header!r})" for g, r in sorted(restricted.items()))
            or "none",
            event_loop.running_loop_name(),
        )
        log.info(
            "%s: grpc=%s metrics=%s http=%s advertise=%s device=%s memory=%s (%s of %s)",
            "engine listening" if s.listen_address else "model server listening",
            s.listen_address or f"{s.host}:{self.port}",
            f"{s.host}:{self.metrics_port}" if self.metrics_port >= 0 else "off",
            f"{s.host}:{self.http_port}" if self.http_port >= 0 else "off",
            self.advertised,
            self.device.label,
            reading.source,
            format_bytes(reading.used_bytes),
            format_bytes(reading.total_bytes),
        )
        self._spawn(self._load_at_start())
        self._spawn(self._sample_memory())
        if self.tls is not None:
            self._spawn(self._watch_certificates(self.tls))
        for endpoint in s.otlp_endpoints:
            exporter = OtlpExporter(
                endpoint,
                s.telemetry_interval,
                self.metrics.registry,
                self.advertised,
                self.refresh_memory,
                self.tls,
            )
            self.exporters.append(exporter)
            self._spawn(exporter.run())

    async def _watch_certificates(self, tls: ServerTls) -> None:
        """Renewed files are taken into use within a second or two, handshakes or not (the
        REST port's context is reloaded here; gRPC also asks on every handshake). On the loop
        itself, not a thread, since the loop's handshakes use that context: three stat()s a
        second, and a millisecond or two to parse a renewed certificate once a day."""
        while True:
            await asyncio.sleep(RELOAD_CHECK_S)
            tls.reload_if_changed()

    @property
    def advertised(self) -> str:
        return self.settings.advertise_address or f"{self.settings.host}:{self.port}"

    def refresh_memory(self) -> None:
        """Sets the memory gauges from a fresh reading (sampler, scrape and export)."""
        reading = self.memory.read()
        self.metrics.memory_used.labels(reading.device, reading.source).set(reading.used_bytes)
        self.metrics.memory_total.labels(reading.device, reading.source).set(reading.total_bytes)

    async def _load_at_start(self) -> None:
        names = self.settings.models
        if names is None:
            names = tuple(self.repository.names_on_disk())
            self.required = set(names)
        for name in names:
            try:
                await self.repository.load(name)
            except Exception as exc:  # the others still load; the reason is in the index
                log.error("model %r did not load: %s", name, exc)
        self.startup_done = True
        self._settle_collector()
        await self.refresh_health()
        log.info("startup loading done: ready=%s (%s)", self.is_ready(), ", ".join(names) or "none")
        if self.settings.model_control_mode == "poll":
            self._spawn(self._poll_repository())

    async def _poll_repository(self) -> None:
        known = {
            name: await asyncio.to_thread(self.repository.model_fingerprint, name)
            for name in self.repository.names_on_disk()
        }
        while not self.draining:
            await asyncio.sleep(self.settings.repository_poll_interval)
            on_disk = set(await asyncio.to_thread(self.repository.names_on_disk))
            for name in sorted(on_disk | set(known)):
                if self.draining:
                    return
                if name not in on_disk:
                    known.pop(name, None)
                    if name in self.repository.loaded_names():
                        log.info("poll: model %r left the repository; unloading", name)
                        await self.repository.unload(name)
                        self.on_repository_change(name, False)
                    continue
                fingerprint = await asyncio.to_thread(self.repository.model_fingerprint, name)
                if known.get(name) == fingerprint:
                    continue
                known[name] = fingerprint
                wanted = self.settings.models is None or name in self.repository.loaded_names()
                if wanted:
                    log.info("poll: model %r changed on disk; reloading", name)
                    with contextlib.suppress(Exception):  # the reason is in the index and log
                        await self.repository.load(name)
                    self.on_repository_change(name, True)

    async def _sample_memory(self) -> None:
        while True:
            await asyncio.to_thread(self.refresh_memory)
            await asyncio.sleep(MEMORY_SAMPLE_INTERVAL_S)

    async def drain(self) -> int:
        """NOT_SERVING at once, accept for the drain delay, refuse new work, finish, stop."""
        s = self.settings
        started = time.monotonic()
        self.draining = True
        self.metrics.draining.set(1)
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING, watchers told
        log.info(
            "drain 1/3: health NOT_SERVING; still accepting for %.1fs (%d in flight)",
            s.drain_delay,
            self.gate.in_flight,
        )
        await asyncio.sleep(min(s.drain_delay, s.drain_timeout))  # let balancers see it first
        self.gate.refusing = True
        remaining = max(0.0, s.drain_timeout - (time.monotonic() - started))
        log.info(
            "drain 2/3: refusing new requests; finishing %d in flight (%.1fs left)",
            self.gate.in_flight,
            remaining,
        )
        exit_code = 0
        try:
            await asyncio.wait_for(self.gate.idle.wait(), timeout=remaining)
        except TimeoutError:
            log.error(
                "drain: --drain-timeout reached with %d requests in flight", self.gate.in_flight
            )
            exit_code = 1
        # Direct clients may still be sending: stop once arrivals pause, so no request is
        # caught half-received by the shutdown (it would see CANCELLED instead of UNAVAILABLE).
        while time.monotonic() - self.gate.last_arrival < DRAIN_QUIET_S:
            if time.monotonic() - started >= s.drain_timeout:
                log.warning("drain: clients still sending at --drain-timeout; stopping anyway")
                break
            await asyncio.sleep(DRAIN_QUIET_S / 4)
        log.info("drain 3/3: stopping after %.2fs", time.monotonic() - started)
        await self.stop(grace=0.5)
        # The final counts, drain included, to every receiver at once.
        await asyncio.gather(*(e.flush_and_close() for e in self.exporters))
        answered = self.metrics.requests_by_code()
        log.info(
            "requests answered since start: %s",
            ", ".join(f"{code}={n}" for code, n in sorted(answered.items())) or "none",
        )
        return exit_code

    async def stop(self, grace: float | None = None) -> None:
        for hook in self.before_stop:
            await hook()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace)
        self.shared_memory.registry.close()  # every region unmapped
        if self._rest is not None:
            await self._rest.stop()
            self._rest = None
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # flush the last spans
        for task in list(self._tasks):
            task.cancel()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
