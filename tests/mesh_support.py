"""A real control plane in a thread of the test process, next to real Envoy and servers.

The control plane runs its own event loop in a background thread, so synchronous tests drive
it the way an operator would (its admin HTTP) and can still reach inside when a test needs to
(set a deliberately invalid snapshot).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from control_plane.app.server import ControlPlane, ControlPlaneSettings
from control_plane.xds.bootstrap import (
    OTLP_CLUSTER,
    TOKEN_LIMITER_CLUSTER,
    XDS_CLUSTER,
    XdsTls,
    render_bootstrap,
    write_sds_files,
)
from tests.envoy_support import Envoy, free_port, start_envoy
from tests.support import ROOT, ServerProcess, post_json, start_server, wait_for

T = TypeVar("T")
# Tests of routing, not of identity, serve anyone (tests/integration/test_edge_tenants.py
# tests identity).
NO_AUTH = {"mode": "off"}


class ControlPlaneThread:
    def __init__(
        self, topology: Path, xds_port: int = 0, admin_port: int = 0, otlp_port: int = 0
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        settings = ControlPlaneSettings(topology, xds_port, admin_port, otlp_port=otlp_port)
        self.plane: ControlPlane = self.call(self._create(settings))
        self.call(self.plane.start())

    @staticmethod
    async def _create(settings: ControlPlaneSettings) -> ControlPlane:
        return ControlPlane(settings)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def admin_get(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.plane.admin_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read().decode()
        return json.loads(body) if path != "/metrics" else body

    def admin_post(self, path: str, body: dict[str, Any]) -> Any:
        return post_json(f"http://127.0.0.1:{self.plane.admin_port}{path}", body, timeout=5)

    def stop(self) -> None:
        try:
            self.call(self.plane.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def write_topology(
    path: Path,
    listener_port: int,
    endpoints: list[str],
    *,
    top: dict[str, Any] | None = None,
    more_models: Sequence[dict[str, Any]] = (),
    **model: Any,
) -> Path:
    """The classifier (``model`` overrides its fields), ``more_models`` after it, and ``top``
    sections (e.g. ``telemetry``) over the defaults; ``top["listener"]``'s keys over the
    default listener's (authentication off unless it says ``auth``)."""
    data: dict[str, Any] = {
        "xds": {"host": "127.0.0.1", "port": 18000},
        "admin": {"host": "127.0.0.1", "port": 19000},
        "placement": {"poll_interval_s": 0.2, "timeout_s": 1.0},
        "models": [
            {"name": "classifier", "sla_p99_ms": 100, "capacity_qps": 1000, **model},
            *more_models,
        ],
        "endpoints": [{"address": e} for e in endpoints],
        **(top or {}),
    }
    default_listener = {
        "host": "127.0.0.1", "port": listener_port, "health_check_interval_s": 0.5,
        "auth": NO_AUTH,
    }  # fmt: skip
    data["listener"] = {**default_listener, **(top or {}).get("listener", {})}
    path.write_text(yaml.safe_dump(data))
    return path


def start_ads_envoy(
    workdir: Path,
    xds_port: int | Sequence[int | str],  # several: control-plane replicas
    listener_port: int,
    delta: bool,
    otlp_port: int | None = None,
    xds_tls: XdsTls | None = None,
) -> Envoy:
    admin_port = free_port()
    node_id = f"envoy-{'delta' if delta else 'sotw'}"
    if xds_tls is not None:
        write_sds_files(Path(xds_tls.pki_dir), node_id)
    config = render_bootstrap(
        node_id=node_id,
        node_cluster="infermesh",
        xds_host="127.0.0.1",
        xds_port=xds_port,
        admin_port=admin_port,
        delta=delta,
        otlp_port=otlp_port,
        xds_tls=xds_tls,
    )
    return start_envoy(config, workdir, admin_port, listener_port)


def start_reporting_servers(
    stops: contextlib.ExitStack,
    repo: Path,
    workdir: Path,
    otlp_port: int,
    *flags: str,
    count: int = 3,
) -> list[ServerProcess]:
    """``count`` classifier servers that report telemetry to ``otlp_port`` every 0.2 s and
    take injected faults, stopped by ``stops``."""
    servers = []
    for i in range(1, count + 1):
        server = start_server(
            repo, workdir / f"s{i}", "--models", "classifier",
            "--otlp-endpoint", f"127.0.0.1:{otlp_port}", "--telemetry-interval", "0.2",
            "--enable-fault-injection", *flags,
        )  # fmt: skip
        stops.callback(server.stop)
        servers.append(server)
    return servers


def start_plane_and_envoy(
    stops: contextlib.ExitStack,
    workdir: Path,
    topology: Path,
    listener_port: int,
    healthy: int,
    otlp_port: int = 0,
    envoy_stats: bool = False,
    xds_tls: XdsTls | None = None,
) -> tuple[ControlPlaneThread, Envoy]:
    """The control plane (in a thread) and Envoy over SotW ADS, stopped by ``stops``; returns
    once Envoy's /clusters lists ``healthy`` healthy hosts in the clusters the control plane
    pushed (each server counts once per cluster that lists it: ``servers``, ``rest:servers``,
    ``model:NAME``; the bootstrap's static clusters read healthy at once and do not count).
    ``envoy_stats``: Envoy sends its stats to the control plane's OTLP receiver."""
    plane = ControlPlaneThread(topology, otlp_port=otlp_port)
    stops.callback(plane.stop)
    sink = plane.plane.otlp_port if envoy_stats else None
    envoy = start_ads_envoy(
        workdir, plane.plane.xds_port, listener_port, False, otlp_port=sink, xds_tls=xds_tls
    )
    stops.callback(envoy.stop)
    seen: dict[str, int] = {}

    def enough() -> bool:
        seen.clear()
        seen.update(pushed_healthy_hosts(envoy))
        return sum(seen.values()) >= healthy

    try:
        wait_for(enough, 30, f"{healthy} healthy hosts in the pushed clusters")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; healthy per cluster: {seen}") from None
    return plane, envoy


def pushed_healthy_hosts(envoy: Envoy) -> dict[str, int]:
    """Healthy hosts per cluster in Envoy's /clusters, leaving out the bootstrap's static
    clusters (xDS, OTLP, token limiter)."""
    static = (XDS_CLUSTER, OTLP_CLUSTER, TOKEN_LIMITER_CLUSTER)
    counts: dict[str, int] = {}
    for line in envoy.admin("/clusters").splitlines():
        if not line.endswith("::health_flags::healthy"):
            continue
        cluster = line.split("::", 1)[0]
        if not cluster.startswith(static):
            counts[cluster] = counts.get(cluster, 0) + 1
    return counts


def start_control_plane(topology: Path, log: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """The control plane on free xDS, admin and OTLP ports, its output in ``log``."""
    command = [
        sys.executable, "-m", "control_plane", "--topology", str(topology),
        "--xds-port", "0", "--admin-port", "0", "--otlp-port", "0",
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT), log
