"""compose.private.yaml in real containers on a private bridge network, under steady load
through Envoy's published port: the mesh comes up from nothing, and keeps serving through a
server killed, the control-plane replica Envoy follows killed, and a rolling restart. Each
scenario prints its figures."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.container_support import PLANES, SERVERS, PrivateMesh, docker
from tests.support import wait_for

pytestmark = pytest.mark.containers


@pytest.fixture(scope="module")
def mesh(mesh_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateMesh]:
    with PrivateMesh(tmp_path_factory.mktemp("private-mesh")) as running:
        print(f"\ncompose.private.yaml up (Envoy healthy) in {running.up_s:.1f} s")
        yield running


def all_routed(mesh: PrivateMesh) -> bool:
    return mesh.envoy_healthy() == len(SERVERS)


def back_in_rotation(mesh: PrivateMesh, server: str) -> None:
    """Waits for the server's health check to pass and for Envoy to route to it again."""
    wait_for(lambda: mesh.health(server) == "healthy", 90, f"{server} healthy")
    wait_for(lambda: all_routed(mesh), 60, f"{server} routed again")


def followed_plane(mesh: PrivateMesh) -> str | None:
    """The replica whose ADS stream Envoy holds now (None: neither answers so)."""
    for plane in PLANES:
        try:
            if any(node["connected"] for node in mesh.status(plane)["nodes"]):
                return plane
        except RuntimeError:  # the replica is down or restarting
            continue
    return None


def test_the_mesh_serves_from_its_own_addresses(mesh: PrivateMesh) -> None:
    """Servers found through Docker's DNS at their own addresses, mutual TLS inside, each
    container as the image's user, and only Envoy's listener published (on loopback)."""
    status = mesh.status()
    assert sorted(status["endpoints"]) == sorted(mesh.address(s) for s in SERVERS)
    assert all(e["reachable"] and e["server_ready"] for e in status["endpoints"].values())
    assert not status["warnings"], status["warnings"]
    wait_for(lambda: all_routed(mesh), 30, "Envoy to route to every server")
    with mesh.traffic(clients=4, deadline_s=60) as traffic:
        traffic.wait_ok(200)
    assert not traffic.errors, traffic.errors[:5]
    for service in (*SERVERS, *PLANES, "envoy", "mesh-certs"):
        config = mesh.inspect(service)
        assert config["Config"]["User"] == "10001", service
        published = {
            port: bindings
            for port, bindings in (config["NetworkSettings"]["Ports"] or {}).items()
            if bindings
        }
        if service == "envoy":
            assert published == {
                "8080/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(mesh.envoy_port)}]
            }
        else:
            assert published == {}, (service, published)


def test_a_server_container_holds_no_key_but_its_own(mesh: PrivateMesh) -> None:
    """The model servers parse every client's input, so theirs is the container an attacker
    reaches first: it holds the CA certificate, the operator key its restricted APIs check,
    and its own key, made in it (before, the whole mesh-state volume: the CA's key, Envoy's,
    the operator's and the admin token)."""
    for server in SERVERS:
        held = mesh.exec(server, "sh", "-c", "ls -A /app/.infermesh /app/mesh-public /tmp/pki")
        assert held.split() == [
            "/app/.infermesh:", "/app/mesh-public:", "ca.crt", "operator.key",
            "/tmp/pki:", "server.crt", "server.key",
        ], (server, held)  # fmt: skip


def test_a_certificate_is_issued_for_the_callers_own_address_only(mesh: PrivateMesh) -> None:
    """Any container on the network may ask mesh-certs for a model-server certificate, and
    gets one for the address its request came from: Envoy's container is certified as
    Envoy's address, which Docker's DNS does not list among the servers."""
    printed = mesh.exec(
        "envoy", "infermesh", "certs", "request", "--from", "http://mesh-certs:8443",
        "--port", "8001", "--ca", ".infermesh/pki/ca.crt", "--out", "/tmp/rogue",
    ).strip()  # fmt: skip
    assert printed == f"{mesh.ip('envoy')}:8001"
    assert printed not in mesh.status()["endpoints"]


def test_scaling_the_servers_up_and_down_under_load(mesh: PrivateMesh) -> None:
    """`up --scale model-server=4`: the new replica is certified for its address, found
    through Docker's DNS and routed; back to 3, it drains and leaves."""
    wait_for(lambda: all_routed(mesh), 60, "every server routed")
    with mesh.traffic(clients=4, deadline_s=240) as traffic:
        traffic.wait_ok(100)
        started = time.monotonic()
        mesh.compose("up", "-d", "--no-recreate", "--scale", "model-server=4", timeout=180)
        wait_for(lambda: mesh.envoy_healthy() == 4, 90, "the fourth server routed")
        up_after = time.monotonic() - started
        assert len(mesh.status()["endpoints"]) == 4
        traffic.wait_ok(200)
        started = time.monotonic()
        mesh.compose("up", "-d", "--no-recreate", "--scale", "model-server=3", timeout=180)
        wait_for(lambda: len(mesh.status()["endpoints"]) == 3, 60, "the fourth server gone")
        down_after = time.monotonic() - started
        wait_for(lambda: all_routed(mesh), 60, "three servers routed")
        traffic.wait_ok(100)
    print(
        f"\nscaled to 4 servers under load: the new one routed {up_after:.1f} s after `up "
        f"--scale`; back to 3: gone from the control plane {down_after:.1f} s after; "
        f"{traffic.ok} OK, {len(traffic.errors)} failed"
    )
    assert not traffic.errors, traffic.errors[:5]


def test_kill_9_of_a_server_under_load(mesh: PrivateMesh) -> None:
    """`docker kill -s KILL`: Docker counts it as a manual stop, so the restart policy leaves
    the container down. The mesh serves on the other two; `start` brings it back."""
    victim = "model-server-2"
    wait_for(lambda: all_routed(mesh), 60, "every server routed")
    with mesh.traffic(clients=4, deadline_s=180) as traffic:
        traffic.wait_ok(100)
        docker("kill", "-s", "KILL", mesh.container(victim))
        killed_at = time.monotonic()
        wait_for(lambda: mesh.envoy_healthy() == len(SERVERS) - 1, 60, "the server out")
        out_after = time.monotonic() - killed_at
        traffic.wait_ok(100)
        failed_while_down = len(traffic.errors)
        docker("start", mesh.container(victim))
        started_at = time.monotonic()
        back_in_rotation(mesh, victim)
        back_after = time.monotonic() - started_at
        traffic.wait_ok(200)
    failed = len(traffic.errors)
    print(
        f"\ndocker kill -s KILL {victim} under load: out of Envoy's rotation after "
        f"{out_after:.1f} s; started again, healthy and routed after {back_after:.1f} s; "
        f"{traffic.ok} OK, {failed} failed ({failed_while_down} up to the kill's ejection; "
        f"{sorted({c.name for c, _ in traffic.errors})})"
    )
    # Calls in flight on the killed server's connections: Envoy retries resets and refusals
    # elsewhere, as natively (tests/scenarios/test_failures.py has the same bound).
    assert failed <= 5, traffic.errors[:5]
    assert mesh.inspect(victim)["State"]["OOMKilled"] is False


def test_a_crashed_server_is_restarted_by_its_policy(mesh: PrivateMesh) -> None:
    """A crash (SIGKILL of the server's process from outside Docker, as the kernel's OOM
    killer or a fault would): `restart: unless-stopped` starts it again."""
    victim = "model-server-3"
    wait_for(lambda: all_routed(mesh), 60, "every server routed")
    restarts = mesh.inspect(victim)["RestartCount"]
    with mesh.traffic(clients=4, deadline_s=180) as traffic:
        traffic.wait_ok(100)
        os.kill(mesh.inspect(victim)["State"]["Pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: mesh.inspect(victim)["RestartCount"] > restarts, 60, "the restart")
        back_in_rotation(mesh, victim)
        back_after = time.monotonic() - killed_at
        traffic.wait_ok(200)
    failed = len(traffic.errors)
    print(
        f"\n{victim}'s process killed (SIGKILL from the host) under load: restarted by its "
        f"policy, healthy and routed again after {back_after:.1f} s; {traffic.ok} OK, "
        f"{failed} failed ({sorted({c.name for c, _ in traffic.errors})})"
    )
    assert failed <= 5, traffic.errors[:5]


def test_kill_9_of_the_followed_control_plane_under_load(mesh: PrivateMesh) -> None:
    followed = wait_for(lambda: followed_plane(mesh), 30, "Envoy to follow a replica")
    other = next(plane for plane in PLANES if plane != followed)
    with mesh.traffic(clients=4, deadline_s=180) as traffic:
        traffic.wait_ok(100)
        docker("kill", "-s", "KILL", mesh.container(followed))
        killed_at = time.monotonic()
        traffic.wait_ok(100)  # Envoy serves on its last configuration meanwhile
        wait_for(lambda: followed_plane(mesh) == other, 60, f"Envoy to follow {other}")
        failover_s = time.monotonic() - killed_at
        docker("start", mesh.container(followed))
        wait_for(lambda: mesh.health(followed) == "healthy", 90, f"the restarted {followed}")
        traffic.wait_ok(100)
    print(
        f"\ndocker kill -s KILL {followed} (the replica Envoy followed) under load: Envoy "
        f"followed {other} after {failover_s:.1f} s; {traffic.ok} OK, "
        f"{len(traffic.errors)} failed"
    )
    assert not traffic.errors, traffic.errors[:5]


def test_rolling_restart_of_the_servers_under_load(mesh: PrivateMesh) -> None:
    """`restart` of one server after another: SIGTERM, the drain within the stop grace
    period, a new process; no call fails."""
    wait_for(lambda: all_routed(mesh), 60, "every server routed")
    took: list[tuple[str, float, float]] = []  # (server, restarted at, back after s)
    with mesh.traffic(clients=4, deadline_s=300) as traffic:
        traffic.wait_ok(100)
        for server in SERVERS:
            started = time.monotonic()
            docker("restart", "-t", "40", mesh.container(server), timeout=120)
            back_in_rotation(mesh, server)
            took.append((server, started, time.monotonic() - started))
            traffic.wait_ok(50)
    print(
        f"\nrolling restart of {len(SERVERS)} servers under load: "
        f"{', '.join(f'{t:.1f}' for _, _, t in took)} s each; {traffic.ok} OK, "
        f"{len(traffic.errors)} failed"
    )
    # A failure says when it came, against each restart, and what Envoy counted per server.
    when = [
        f"{error[1]!r} at " + ", ".join(f"{at - started:+.1f} s from {name}'s restart"
                                         for name, started, _ in took)
        for error, at in zip(traffic.errors, traffic.failed_at, strict=True)
    ]  # fmt: skip
    counted = [
        line for line in mesh.envoy_clusters().splitlines()
        if any(f"::{c}::" in line for c in ("rq_timeout", "rq_error", "cx_connect_fail"))
    ]  # fmt: skip
    assert not traffic.errors, "\n".join(when[:5] + counted)
