"""Mutual TLS on Kubernetes, where cert-manager's csi-driver names a model server's pod in its
certificate (``spiffe://TD/model-server/pod/NS/POD``) because it cannot know the pod's IP.

A fake Kubernetes API (tests.unit.control_plane.discovery.test_endpointslices) serves EndpointSlices
whose endpoints carry a ``targetRef``; everything else is real: certificates, TLS model
servers started with ``--tls-pod``, the control plane, Envoy, OTLP over mutual TLS (in the
control plane's process and in telemetry shards). Traffic reaches the pods through Envoy
checked by their pods' names; their telemetry is taken for the addresses the slices give
them and no other; when a slice says another pod holds an address, the process there gets no
traffic."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from control_plane.xds.bootstrap import XdsTls
from infermesh import pki
from tests.envoy_support import Envoy, free_port
from tests.kube_support import READY, FakeKubeApi
from tests.mesh_support import ControlPlaneThread, start_plane_and_envoy, write_topology
from tests.otlp_support import Telemetry
from tests.support import ServerProcess, Traffic, infermesh, metric_value, start_server, wait_for

pytestmark = pytest.mark.integration
NAMESPACE = "test"
NODE = "envoy-sotw"  # tests.mesh_support's Envoy node id


def pod_slice(name: str, port: int, pod: str) -> dict[str, Any]:
    """An EndpointSlice of one ready endpoint, 127.0.0.1:``port``, that is pod ``pod``."""
    target = {"kind": "Pod", "name": pod, "namespace": NAMESPACE}
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": "model-server"}},
        "addressType": "IPv4",
        "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": READY, "targetRef": target}],
    }  # fmt: skip


@dataclass
class PodMesh:
    api: FakeKubeApi
    pki_dir: Path
    ports: dict[str, int]  # pod -> its server's port
    servers: dict[str, ServerProcess]
    plane: ControlPlaneThread
    envoy: Envoy | None


def _start_pod(
    pki_dir: Path, repo: Path, logs: Path, pod: str, port: int, otlp: int
) -> ServerProcess:
    who = pki.model_server_pod(NAMESPACE, pod)
    return start_server(
        repo, logs, "--port", str(port), "--tls-pod", f"{NAMESPACE}/{pod}",
        "--tls-cert", str(pki_dir / f"{who.file_stem}.crt"),
        "--tls-key", str(pki_dir / f"{who.file_stem}.key"), "--tls-ca", str(pki_dir / "ca.crt"),
        "--otlp-endpoint", f"127.0.0.1:{otlp}", "--telemetry-interval", "0.2",
        wait_ready=False,
    )  # fmt: skip


@contextlib.contextmanager
def pod_mesh(
    demo_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int, envoy: bool
) -> Iterator[PodMesh]:
    pki_dir, logs = tmp_path / "pki", tmp_path / "logs"
    authority = pki.init_authority(pki_dir)
    pods = ("pod-a", "pod-b", "pod-c")  # pod-c has a certificate and no process
    for who in (pki.envoy(NODE), pki.control_plane(), pki.operator("platform"),
                *(pki.model_server_pod(NAMESPACE, p) for p in pods)):  # fmt: skip
        pki.issue(authority, who, pki_dir)
    ports = {pod: free_port() for pod in pods[:2]}
    otlp, listener = free_port(), free_port()
    top = {
        "listener": {"upstream_tls": {"pki_dir": str(pki_dir)}},
        "xds": {"host": "127.0.0.1", "port": 18000, "tls": True},
        "telemetry": {"port": otlp, "tls": True, "shards": shards},
        "endpoints": [{"kubernetes": {"service": "model-server", "namespace": NAMESPACE,
                                      "port": "grpc"}}],
    }  # fmt: skip
    topology = write_topology(tmp_path / "topology.yaml", listener, [], top=top)
    with FakeKubeApi() as api, contextlib.ExitStack() as stops:
        monkeypatch.setenv("INFERMESH_KUBERNETES_API", api.url)
        token = tmp_path / "token"
        token.write_text(api.token)
        monkeypatch.setenv("INFERMESH_KUBERNETES_TOKEN_FILE", str(token))
        for pod, port in ports.items():
            api.apply(pod_slice(pod, port, pod))
        servers = {
            p: _start_pod(pki_dir, demo_repo, logs, p, port, otlp) for p, port in ports.items()
        }
        for server in servers.values():
            stops.callback(server.stop)
        proxy = None
        if envoy:
            xds = XdsTls(str(pki_dir), authority.trust_domain)
            plane, proxy = start_plane_and_envoy(
                stops, tmp_path, topology, listener, healthy=6, otlp_port=otlp, xds_tls=xds
            )
        else:
            plane = ControlPlaneThread(topology, otlp_port=otlp)
            stops.callback(plane.stop)
        yield PodMesh(api, pki_dir, ports, servers, plane, proxy)


def _served(server: ServerProcess) -> float:
    return metric_value(server.metrics(), "inference_requests_total", code="OK")


def test_pods_are_reached_and_checked_by_their_pods_names(
    demo_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pod_mesh(demo_repo, tmp_path, monkeypatch, shards=0, envoy=True) as mesh:
        assert mesh.envoy is not None
        with Traffic(f"127.0.0.1:{mesh.envoy.port}", clients=2) as traffic:
            wait_for(
                lambda: all(_served(s) > 0 for s in mesh.servers.values()),
                40,
                "both pods to serve through Envoy over mutual TLS",
            )
            # Their telemetry is taken, each for the address its slice gives it.
            wait_for(
                lambda: (
                    {f"127.0.0.1:{p}" for p in mesh.ports.values()}
                    <= set(mesh.plane.admin_get("/telemetry")["endpoints"])
                ),
                30,
                "both pods' telemetry over mutual TLS",
            )
            # The slice now says pod-c is at pod-a's address; the process there presents
            # pod-a's certificate, so Envoy refuses it and pod-b takes all the traffic.
            mesh.api.apply(pod_slice("pod-a", mesh.ports["pod-a"], "pod-c"))
            a, b = mesh.servers["pod-a"], mesh.servers["pod-b"]

            def only_b() -> bool:
                before_a, before_b = _served(a), _served(b)
                traffic.wait_ok(20)
                return _served(a) == before_a and _served(b) > before_b

            wait_for(only_b, 30, "Envoy to refuse pod-a's certificate for pod-c")
        assert not [e for e in traffic.errors if "UNAVAILABLE" not in e], traffic.errors[:3]
        # Telemetry for that address is now pod-c's to send: pod-a's reports are refused.
        text = lambda: mesh.plane.admin_get("/metrics")  # noqa: E731
        wait_for(
            lambda: (
                metric_value(text(), "telemetry_reports_rejected_total", reason="other_identity")
                > 0
            ),
            15,
            "pod-a's reports refused for pod-c's address",
        )


@pytest.mark.parametrize("shards", [0, 2], ids=["in-process", "2-shards"])
def test_a_pods_reports_are_taken_for_its_own_address_only(
    demo_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    with pod_mesh(demo_repo, tmp_path, monkeypatch, shards=shards, envoy=False) as mesh:
        a_address = f"127.0.0.1:{mesh.ports['pod-a']}"
        b_address = f"127.0.0.1:{mesh.ports['pod-b']}"
        telemetry = Telemetry(mesh.pki_dir, mesh.plane, mesh.servers["pod-a"], b_address)
        wait_for(
            lambda: a_address in mesh.plane.admin_get("/telemetry")["endpoints"],
            30,
            "pod-a's own reports",
        )
        # pod-a's process reports server_draining=0 every 0.2 s and would overwrite what this
        # test sends; SIGKILL stops it without a draining report of its own.
        mesh.servers["pod-a"].signal(signal.SIGKILL)
        mesh.servers["pod-a"].wait_exit(10)
        pod_a, pod_b = (pki.model_server_pod(NAMESPACE, p) for p in ("pod-a", "pod-b"))
        assert telemetry.export(pod_b, a_address) == grpc.StatusCode.PERMISSION_DENIED
        wait_for(lambda: telemetry.rejected("other_identity") >= 1, 10, "the refusal counted")
        assert telemetry.draining(a_address) in (0, 0.0, None)  # the forgery was not stored
        # pod-a's own certificate may report for its address (and what it says is stored).
        assert telemetry.export(pod_a, a_address) == grpc.StatusCode.OK
        wait_for(lambda: telemetry.draining(a_address) == 1, 10, "pod-a's own report stored")


def test_the_operator_reaches_pods_by_their_names(
    demo_repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``infermesh models`` checks each server's certificate against its pod's name: taken
    from the control plane's /status, or given with --pod for one --server."""
    with pod_mesh(demo_repo, tmp_path, monkeypatch, shards=0, envoy=False) as mesh:
        a = f"127.0.0.1:{mesh.ports['pod-a']}"
        as_operator = ("--pki", str(mesh.pki_dir), "--operator", "platform")
        wait_for(
            lambda: len(mesh.plane.admin_get("/status")["upstream_tls"]["pods"]) == 2,
            30,
            "both pods in /status",
        )
        admin = f"127.0.0.1:{mesh.plane.plane.admin_port}"
        done = infermesh(tmp_path, "models", "index", "--admin", admin, *as_operator)
        assert done.returncode == 0 and done.stdout.count("classifier v1  READY") == 2, done
        done = infermesh(tmp_path, "models", "index", "--server", a, "--pod", "test/pod-a",
                         *as_operator)  # fmt: skip
        assert done.returncode == 0 and "classifier v1  READY" in done.stdout, done
        # Without the pod, the address's name is expected and the pod's certificate fails it.
        done = infermesh(tmp_path, "models", "index", "--server", a, *as_operator)
        assert done.returncode == 1 and "UNAVAILABLE" in done.stderr, done
