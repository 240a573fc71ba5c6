"""Scenarios against the compose topology run natively: a server killed with SIGKILL, and the
control plane lost, both under steady load through Envoy. Each prints what clients saw."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.scenarios.harness import ComposeMesh
from tests.support import wait_for

pytestmark = pytest.mark.integration
MiB = 1024 * 1024


@pytest.fixture
def mesh(demo_repo: Path, tmp_path: Path) -> Iterator[ComposeMesh]:
    with ComposeMesh(tmp_path, demo_repo) as running:
        yield running


def healthy_again(mesh: ComposeMesh, service: str) -> bool:
    return mesh.log.read_text().count(f"infermesh: {service} healthy") >= 2


def test_kill_9_of_a_model_server_under_load(mesh: ComposeMesh) -> None:
    with mesh.traffic(clients=4, deadline_s=120) as traffic:
        traffic.wait_ok(100)
        victim = mesh.pids()["model-server-2"]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: healthy_again(mesh, "model-server-2"), 60, "the restarted server")
        back_after = time.monotonic() - killed_at
        traffic.wait_ok(200)
    assert mesh.pids()["model-server-2"] != victim and mesh.starts("model-server-2") == 2
    failed = len(traffic.errors)
    print(
        f"\nkill -9 of model-server-2 under load: {traffic.ok} OK, {failed} failed "
        f"({sorted({c.name for c, _ in traffic.errors})}); restarted and healthy after "
        f"{back_after:.1f} s"
    )
    assert failed <= 5, traffic.errors[:5]  # Envoy retries reset and refused calls elsewhere


def test_control_plane_lost_and_restarted_under_load(mesh: ComposeMesh) -> None:
    """kill -9 of the replica Envoy follows: Envoy moves its ADS stream to the other replica
    and keeps serving; the killed one restarts, and both see the mesh again."""
    wait_for(lambda: mesh.followed_plane() is not None, 30, "Envoy to follow a replica")
    with mesh.traffic(clients=4, deadline_s=120) as traffic:
        traffic.wait_ok(100)
        followed = mesh.followed_plane()
        assert followed is not None
        other = next(name for name in mesh.admins if name != followed)
        os.kill(mesh.pids()[followed], signal.SIGKILL)
        killed_at = time.monotonic()
        traffic.wait_ok(100)  # Envoy serves on its last configuration meanwhile
        wait_for(lambda: mesh.followed_plane() == other, 30, f"Envoy to follow {other}")
        failover_s = time.monotonic() - killed_at
        wait_for(lambda: healthy_again(mesh, followed), 60, f"the restarted {followed}")
        wait_for(
            lambda: "(sotw, connected)" in mesh.cli("status") and "sync=True" in mesh.cli("status"),
            30,
            "Envoy in sync with a replica",
        )
        traffic.wait_ok(100)
    status = mesh.cli("status")
    print(
        f"\ncontrol plane {followed} killed under load: Envoy followed {other} after "
        f"{failover_s:.1f} s; {traffic.ok} OK, {len(traffic.errors)} failed; status after:\n"
        f"{status[-600:]}"
    )
    assert not traffic.errors, traffic.errors[:5]
    assert mesh.starts(followed) == 2 and "== control plane" in status


def test_memory_pressure_ejects_a_server_before_it_runs_out(
    demo_repo: Path, tmp_path: Path
) -> None:
    """A real ballast past the 95% watermark of the server's budget (the source article's
    incident 1): Envoy stops sending it traffic, it serves again once the memory is back,
    and no request fails."""
    flags = ("--enable-fault-injection", "--memory-budget", "600MiB")
    with ComposeMesh(tmp_path, demo_repo, server_flags=flags) as mesh:
        servers = len(mesh.server_ports)
        wait_for(lambda: mesh.envoy_healthy() == servers, 30, "every server routed")
        with mesh.traffic(clients=4, deadline_s=120) as traffic:
            traffic.wait_ok(100)
            mesh.post_faults("model-server-2", {"ballast_bytes": 560 * MiB})
            pressed = time.monotonic()
            wait_for(lambda: mesh.envoy_healthy() == servers - 1, 20, "the server's ejection")
            ejected_after = time.monotonic() - pressed
            traffic.wait_ok(100)
            mesh.post_faults("model-server-2", {"ballast_bytes": 0})
            wait_for(lambda: mesh.envoy_healthy() == servers, 60, "the server back in rotation")
            traffic.wait_ok(100)
        address = f"127.0.0.1:{mesh.server_ports['model-server-2']}"

        def returned() -> bool:
            return any(d.startswith(f"{address} returned") for d in mesh.decisions())

        wait_for(returned, 30, "the return among the decisions")
        seen = mesh.decisions()
    print(
        f"\nmemory pressure on model-server-2 under load: ejected {ejected_after:.1f} s after "
        f"the ballast, back after; {traffic.ok} OK, {len(traffic.errors)} failed"
    )
    assert any(d.startswith(f"{address} ejected") and "memory" in d for d in seen), seen
    assert not traffic.errors, traffic.errors[:5]
