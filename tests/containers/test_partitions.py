"""Network partitions between the containers of compose.private.yaml, under steady load
through Envoy: each cut is made with iptables in one container's network namespace (exactly
the pairs named), each heal deletes those rules, and each scenario prints how long the mesh
took to notice and to converge again."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.container_support import PLANES, SERVERS, PrivateMesh
from tests.support import wait_for

pytestmark = pytest.mark.containers


@pytest.fixture(scope="module")
def mesh(mesh_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateMesh]:
    with PrivateMesh(tmp_path_factory.mktemp("partitions")) as running:
        yield running


def routed(mesh: PrivateMesh) -> int:
    return mesh.envoy_healthy()


def endpoint(mesh: PrivateMesh, server: str, plane: str = "control-plane-1") -> dict[str, object]:
    result: dict[str, object] = mesh.status(plane)["endpoints"][mesh.address(server)]
    return result


def connected(mesh: PrivateMesh) -> bool:
    """Envoy holds an ADS stream to one of the replicas, in sync."""
    for plane in PLANES:
        for node in mesh.status(plane)["nodes"]:
            if node["connected"] and all(t["in_sync"] for t in node["types"].values()):
                return True
    return False


def test_a_server_cut_off_from_the_control_planes_keeps_serving(mesh: PrivateMesh) -> None:
    """Probes and telemetry to both replicas fail; Envoy still reaches the server and its
    checks pass, so the server stays in rotation and /status says why."""
    server = "model-server-1"
    address = mesh.address(server)

    def held(plane: str) -> bool:
        return bool(endpoint(mesh, server, plane)["held_on_envoys_word"])

    def reached(plane: str) -> bool:
        seen = endpoint(mesh, server, plane)
        return bool(seen["reachable"]) and not seen["held_on_envoys_word"]

    wait_for(lambda: routed(mesh) == len(SERVERS), 60, "every server routed")
    with mesh.traffic(clients=4, deadline_s=240) as traffic:
        traffic.wait_ok(100)
        cut = mesh.cut(server, list(PLANES))
        cut_at = time.monotonic()
        try:
            wait_for(lambda: all(held(p) for p in PLANES), 30, "both replicas to hold it")
            held_after = time.monotonic() - cut_at
            sent = mesh.envoy_requests(address)
            traffic.wait_ok(300)
            status = mesh.status()
            # The cut server itself is in Envoy's rotation (the others' momentary health under
            # load is not this test's subject: counting all three failed on a busy CI host
            # while the held server was healthy and served)
            assert mesh.envoy_host_healthy(address), mesh.explain(address)
            assert mesh.envoy_requests(address) > sent  # still served
            assert not status["endpoints"][address]["reachable"]
            assert any(address in w and "Envoy's health checks pass" in w
                       for w in status["warnings"]), status["warnings"]  # fmt: skip
        finally:
            cut.heal()
        healed_at = time.monotonic()
        wait_for(lambda: all(reached(p) for p in PLANES), 30, "both replicas to reach it")
        converged_after = time.monotonic() - healed_at
        traffic.wait_ok(100)
    print(
        f"\n{server} cut off from both control planes under load: held on Envoy's word "
        f"after {held_after:.1f} s and served throughout; healed, reached again after "
        f"{converged_after:.1f} s; {traffic.ok} OK, {len(traffic.errors)} failed"
    )
    assert not traffic.errors, traffic.errors[:5]


def test_envoy_cut_off_from_both_replicas_serves_on_its_last_configuration(
    mesh: PrivateMesh,
) -> None:
    wait_for(lambda: connected(mesh), 60, "Envoy in sync with a replica")
    with mesh.traffic(clients=4, deadline_s=240) as traffic:
        traffic.wait_ok(100)
        cut = mesh.cut("envoy", list(PLANES))
        try:
            wait_for(lambda: not connected(mesh), 60, "the replicas to lose Envoy")
            lost_at = time.monotonic()
            ok_before = traffic.ok
            traffic.wait_ok(2000, timeout=90)  # served with no control plane at all
            served_s = time.monotonic() - lost_at
            served = traffic.ok - ok_before
        finally:
            cut.heal()
        healed_at = time.monotonic()
        wait_for(lambda: connected(mesh), 90, "Envoy back in sync with a replica")
        converged_after = time.monotonic() - healed_at
        traffic.wait_ok(100)
    print(
        f"\nEnvoy cut off from both control planes under load: {served} calls served in "
        f"{served_s:.1f} s on its last configuration; healed, in sync again after "
        f"{converged_after:.1f} s; {traffic.ok} OK, {len(traffic.errors)} failed"
    )
    assert not traffic.errors, traffic.errors[:5]


def test_a_server_cut_off_from_envoy_is_taken_out(mesh: PrivateMesh) -> None:
    """Envoy's health checks (and outlier detection) take the server out; the control planes
    still reach it, so they keep it in its clusters, and Envoy keeps it out until it passes."""
    server = "model-server-2"
    wait_for(lambda: routed(mesh) == len(SERVERS), 60, "every server routed")
    with mesh.traffic(clients=4, deadline_s=240) as traffic:
        traffic.wait_ok(100)
        cut = mesh.cut(server, ["envoy"])
        cut_at = time.monotonic()
        try:
            wait_for(lambda: routed(mesh) == len(SERVERS) - 1, 60, "Envoy to take it out")
            out_after = time.monotonic() - cut_at
            failed_by_then = len(traffic.errors)
            traffic.wait_ok(200)
            assert endpoint(mesh, server)["reachable"]  # the control plane still reaches it
        finally:
            cut.heal()
        healed_at = time.monotonic()
        wait_for(lambda: routed(mesh) == len(SERVERS), 60, "the server back in rotation")
        converged_after = time.monotonic() - healed_at
        traffic.wait_ok(100)
    failed = len(traffic.errors)
    print(
        f"\n{server} cut off from Envoy under load: out of rotation after {out_after:.1f} s; "
        f"healed, back after {converged_after:.1f} s; {traffic.ok} OK, {failed} failed "
        f"({failed_by_then} before it was out; {sorted({c.name for c, _ in traffic.errors})})"
    )
    # Calls already sent on the cut connection get no answer; Envoy's per-try timeout and
    # retries move them elsewhere, but a call whose retries are spent fails.
    assert failed <= 10, traffic.errors[:5]
