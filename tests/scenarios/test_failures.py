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
from tests.support import Traffic, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def mesh(demo_repo: Path, tmp_path: Path) -> Iterator[ComposeMesh]:
    with ComposeMesh(tmp_path, demo_repo) as running:
        yield running


def healthy_again(mesh: ComposeMesh, service: str) -> bool:
    return mesh.log.read_text().count(f"infermesh: {service} healthy") >= 2


def test_kill_9_of_a_model_server_under_load(mesh: ComposeMesh) -> None:
    with Traffic(f"127.0.0.1:{mesh.envoy_port}", clients=4, deadline_s=120) as traffic:
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
    with Traffic(f"127.0.0.1:{mesh.envoy_port}", clients=4, deadline_s=120) as traffic:
        traffic.wait_ok(100)
        os.kill(mesh.pids()["control-plane"], signal.SIGKILL)
        traffic.wait_ok(100)  # Envoy serves on its last configuration meanwhile
        wait_for(lambda: healthy_again(mesh, "control-plane"), 60, "the restarted control plane")
        wait_for(
            lambda: "connected" in mesh.cli("status") and "sync=True" in mesh.cli("status"),
            30,
            "Envoy to resync with the new control plane",
        )
        traffic.wait_ok(100)
    status = mesh.cli("status")
    print(
        f"\ncontrol plane killed and restarted under load: {traffic.ok} OK, "
        f"{len(traffic.errors)} failed; status after:\n{status[-600:]}"
    )
    assert not traffic.errors, traffic.errors[:5]
    assert "(sotw, connected)" in status or "(delta, connected)" in status
