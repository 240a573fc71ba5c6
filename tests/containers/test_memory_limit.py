"""The source article's incident 1 in a real container: a model server under `mem_limit`.
Its memory guard reads the cgroup limit inside the container (budget: 90% of it); a real
ballast past the ejection watermark takes it out of rotation, a model that does not fit is
refused, and the kernel's OOM killer never acts (`docker inspect`: OOMKilled false)."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from infermesh import pki
from tests.container_support import SERVERS, PrivateMesh, docker
from tests.support import ROOT, wait_for

pytestmark = pytest.mark.containers
MiB = 1024 * 1024
LIMIT_MIB = 700
SERVER = "model-server-2"


@pytest.fixture(scope="module")
def mesh(mesh_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateMesh]:
    running = PrivateMesh(
        tmp_path_factory.mktemp("memory"),
        extra_files=(ROOT / "tests" / "containers" / "compose.memory.yaml",),
        environment={"INFERMESH_SERVER_MEMORY": f"{LIMIT_MIB}m"},
    )
    with running:
        yield running


def gauge(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def server_memory(mesh: PrivateMesh) -> tuple[float, float]:
    """(used, budget) bytes, as the server's memory guard reads them."""
    host = mesh.address(SERVER).split(":")[0]
    with urllib.request.urlopen(f"http://{host}:9001/metrics", timeout=5) as response:
        text = response.read().decode()
    return gauge(text, "accelerator_memory_used_bytes"), gauge(
        text, "accelerator_memory_total_bytes"
    )


def post_ballast(mesh: PrivateMesh, size: int) -> None:
    host = mesh.address(SERVER).split(":")[0]
    request = urllib.request.Request(
        f"http://{host}:9001/faults", data=f'{{"ballast_bytes": {size}}}'.encode(),
        headers={"content-type": "application/json"}, method="POST",
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def press(
    mesh: PrivateMesh, budget: float, low: float, high: float, ballast: int = 0
) -> tuple[int, float]:
    """A ballast that holds the server's memory between ``low`` and ``high`` of its budget:
    RSS moves by tens of MiB on its own (an unloaded model's memory goes back to the system
    slowly), so the ballast (``ballast`` now) is topped up until the reading settles there.
    (the ballast, the memory used)."""
    for _ in range(8):
        used, _ = server_memory(mesh)
        if low * budget <= used <= high * budget:
            return ballast, used
        ballast = max(0, ballast + int((low + high) / 2 * budget - used))
        post_ballast(mesh, ballast)
        time.sleep(1)  # RSS settling after the ballast moved: a pause, not a wait for a state
    raise AssertionError(f"memory did not settle between {low} and {high} of {budget}")


def operator_stub(mesh: PrivateMesh) -> service_pb2_grpc.GRPCInferenceServiceStub:
    """The server's own port over mutual TLS, as the local operator (model control)."""
    pki_dir = mesh.workdir / "pki"
    who = pki.operator("local")
    files = pki.workload_files(pki_dir, who)
    state = f"{mesh.container('mesh-certs')}:/app/.infermesh/pki"
    for path in (files.cert, files.key):
        docker("cp", f"{state}/{path.name}", str(path))
    credentials = grpc.ssl_channel_credentials(
        (pki_dir / "ca.crt").read_bytes(), files.key.read_bytes(), files.cert.read_bytes()
    )
    name = pki.server_dns_name(mesh.address(SERVER))
    channel = grpc.secure_channel(
        mesh.address(SERVER), credentials, options=[("grpc.ssl_target_name_override", name)]
    )
    return service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_a_server_past_its_watermark_leaves_before_the_oom_killer(mesh: PrivateMesh) -> None:
    _, budget = server_memory(mesh)
    assert budget == pytest.approx(0.9 * LIMIT_MIB * MiB, rel=0.01)  # read from the cgroup
    stub = operator_stub(mesh)
    stub.RepositoryModelUnload(service_pb2.RepositoryModelUnloadRequest(model_name="demo_lm"))

    def lm_ready() -> bool:
        return bool(stub.ModelReady(service_pb2.ModelReadyRequest(name="demo_lm")).ready)

    wait_for(lambda: not lm_ready(), 30, "demo_lm unloaded")
    wait_for(lambda: mesh.envoy_healthy() == len(SERVERS), 60, "every server routed")
    with mesh.traffic(clients=4, deadline_s=180) as traffic:
        traffic.wait_ok(100)
        # Past the 95% watermark, 0.5-3% of the budget left (the model needs 5.5%), and
        # still more than 10% under the container's limit.
        ballast, peak = press(mesh, budget, 0.97, 0.995)
        pressed = time.monotonic()  # the ballast settled (the ejection may already be under way)
        wait_for(lambda: mesh.envoy_healthy() == len(SERVERS) - 1, 30, "the server's ejection")
        ejected_after = time.monotonic() - pressed
        ballast, peak = press(mesh, budget, 0.97, 0.995, ballast)  # again: RSS drifts down
        with pytest.raises(grpc.RpcError) as refused:
            stub.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(model_name="demo_lm"))
        traffic.wait_ok(100)
        post_ballast(mesh, 0)
        wait_for(lambda: mesh.envoy_healthy() == len(SERVERS), 60, "the server back")
        stub.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(model_name="demo_lm"))
        wait_for(lm_ready, 30, "demo_lm loaded again")
        traffic.wait_ok(100)
    state = mesh.inspect(SERVER)
    print(
        f"\n{SERVER} under mem_limit {LIMIT_MIB} MiB (budget {budget / MiB:.0f} MiB): a "
        f"{ballast / MiB:.0f} MiB ballast took it to {peak / MiB:.0f} MiB; ejected "
        f"{ejected_after:.1f} s after it settled; loading demo_lm then: "
        f"{refused.value.code().name} ({refused.value.details()}); "
        f"OOMKilled={state['State']['OOMKilled']}, "
        f"restarts={state['RestartCount']}; {traffic.ok} OK, {len(traffic.errors)} failed"
    )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert "needs about" in refused.value.details()  # the guard's refusal, with its figures
    assert state["State"]["OOMKilled"] is False and state["RestartCount"] == 0
    assert state["State"]["Running"] is True
    assert not traffic.errors, traffic.errors[:5]
