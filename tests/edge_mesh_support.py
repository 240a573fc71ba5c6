"""A real edge for tests: two model servers (explicit model control, no restriction of their
own: the worst case, anything that reached them would be obeyed), the control plane and Envoy
over xDS, with the listener options a test module gives."""

from __future__ import annotations

import contextlib
import http.client
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from model_server.demo_lm import MODEL_NAME as LM
from model_server.demo_lm import build_demo_lm
from tests.envoy_support import Envoy, free_port, free_port_pair
from tests.mesh_support import NO_AUTH, ControlPlaneThread, start_plane_and_envoy, write_topology
from tests.support import EXPLICIT, ServerProcess, metric_value, start_server

OFFSET = 2000


@dataclass
class EdgeMesh:
    servers: list[ServerProcess]
    plane: ControlPlaneThread
    envoy: Envoy
    port: int

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def control_calls(self) -> float:
        """Loads and unloads the servers' services received, all of them (not the index:
        the control plane's placement poller calls it all the time)."""
        total = 0.0
        for server in self.servers:
            text = server.metrics()
            for call in ("load", "unload"):
                total += metric_value(text, "model_control_requests_total", call=call)
        return total

    def served_for(self, tenant: str, model: str = "classifier") -> float:
        """Requests the servers answered OK for ``tenant`` (their own counters)."""
        return sum(
            metric_value(s.metrics(), "inference_tenant_requests_total", model=model,
                         tenant=tenant, code="OK")
            for s in self.servers
        )  # fmt: skip

    def all_ready(self) -> bool:
        return all(s.client().is_model_ready("classifier") for s in self.servers)

    def listener_stat(self, name: str) -> int:
        """One of the public listener's counters (``http.infermesh.NAME``)."""
        return self.envoy.counter(f"http.infermesh.{name}")


@contextlib.contextmanager
def edge_mesh(
    demo_repo: Path,
    workdir: Path,
    listener: dict[str, Any],
    top: dict[str, Any] | None = None,
    copies: tuple[str, ...] = (),
    lm: bool = False,
) -> Iterator[EdgeMesh]:
    """``top``: more topology sections (``tenants``); ``copies``: more models on the servers
    and in the topology, each a copy of the classifier under that name; ``lm``: the demo LM
    too (generative, a 30 s idle timeout)."""
    repo = workdir / "models"
    shutil.copytree(demo_repo / "classifier", repo / "classifier")
    more = [{"name": n, "sla_p99_ms": 100, "capacity_qps": 1000} for n in copies]
    if lm:
        build_demo_lm(repo)
        more.append({"name": LM, "sla_p99_ms": 2000, "capacity_qps": 50, "generative": True,
                     "timeout_s": 30})  # fmt: skip
    for name in copies:
        shutil.copytree(demo_repo / "classifier", repo / name)
        config = repo / name / "config.pbtxt"
        config.write_text(config.read_text().replace('name: "classifier"', f'name: "{name}"'))
    with contextlib.ExitStack() as stops:
        servers = []
        for index in (1, 2):
            port = free_port_pair(OFFSET)
            server = start_server(
                repo, workdir / f"s{index}", *EXPLICIT, "--port", str(port),
                "--http-port", str(port + OFFSET), "--enable-fault-injection",
            )  # fmt: skip
            stops.callback(server.stop)
            servers.append(server)
        listener_port = free_port()
        options = {
            "host": "127.0.0.1", "port": listener_port, "health_check_interval_s": 0.5,
            "auth": NO_AUTH,
        }  # fmt: skip
        topology = write_topology(
            workdir / "topology.yaml", listener_port, [s.url for s in servers],
            top={"listener": {**options, **listener}, **(top or {})},
            more_models=more,
        )  # fmt: skip
        plane, envoy = start_plane_and_envoy(
            stops, workdir, topology, listener_port, len(servers) * (3 + len(more))
        )  # each server in servers, rest:servers and each model's cluster
        yield EdgeMesh(servers, plane, envoy, listener_port)


def image_input(module: Any = grpcclient) -> Any:
    x = module.InferInput("input", [1, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
    return x


def rest(
    mesh: EdgeMesh,
    method: str,
    path: str,
    body: bytes = b"",
    headers: Mapping[str, str] | None = None,
    **more: str,
) -> Any:
    connection = http.client.HTTPConnection("127.0.0.1", mesh.port, timeout=30)
    try:
        connection.request(method, path, body=body, headers={**(headers or {}), **more})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()
