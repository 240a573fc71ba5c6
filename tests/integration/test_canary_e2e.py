"""SLO-gated canaries for real: v1 and v2 on their own servers behind Envoy, judged by OTLP."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.envoy_support import Envoy, free_port
from tests.mesh_support import ControlPlaneThread, start_plane_and_envoy, write_topology
from tests.support import ServerProcess, Traffic, post_faults, start_server, wait_for

pytestmark = pytest.mark.integration
FAST: dict[str, Any] = {"steps": [10, 50, 100], "dwell_s": 1.5, "min_requests": 5}

Mesh = tuple[ServerProcess, ServerProcess, ControlPlaneThread, Envoy, int]


def one_version(demo_repo: Path, target: Path, version: str) -> Path:
    """A copy of the demo repository holding only ``version`` of the classifier."""
    shutil.copytree(demo_repo, target)
    for entry in (target / "classifier").iterdir():
        if entry.is_dir() and entry.name != version:
            shutil.rmtree(entry)
    return target


@pytest.fixture(scope="module")
def mesh(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    workdir = tmp_path_factory.mktemp("canary")
    otlp, listener = free_port(), free_port()
    with contextlib.ExitStack() as stops:
        servers = []
        for version in ("1", "2"):
            repo = one_version(demo_repo, workdir / f"repo-v{version}", version)
            server = start_server(
                repo, workdir / f"s{version}", "--models", "classifier",
                "--otlp-endpoint", f"127.0.0.1:{otlp}", "--telemetry-interval", "0.2",
                "--enable-fault-injection",
            )  # fmt: skip
            stops.callback(server.stop)
            servers.append(server)
        # A generous SLA: this machine is shared, and only injected errors should roll back.
        urls = [s.url for s in servers]
        path = write_topology(
            workdir / "t.yaml", listener, urls, top={"telemetry": {"window_s": 3}}, sla_p99_ms=1000
        )
        plane, envoy = start_plane_and_envoy(stops, workdir, path, listener, 4, otlp_port=otlp)
        yield servers[0], servers[1], plane, envoy, listener


def canary(plane: ControlPlaneThread, status: str) -> dict[str, Any] | None:
    """The classifier's canary run once it has ``status``."""
    run = plane.admin_get("/canaries")["canaries"].get("classifier", {})
    return dict(run) if run.get("status") == status else None


def cli(plane: ControlPlaneThread, *args: str) -> str:
    admin = f"127.0.0.1:{plane.plane.admin_port}"
    command = [sys.executable, "-m", "infermesh.cli", *args, "--admin", admin]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def versions_served(listener: int, calls: int) -> dict[str, int]:
    with Traffic(f"127.0.0.1:{listener}", clients=2) as traffic:
        traffic.wait_ok(calls)
    return traffic.versions


def reset(plane: ControlPlaneThread, *servers: ServerProcess) -> None:
    for server in servers:
        post_faults(server, {"reset": True})
    plane.admin_post("/models/classifier/split", {})


def test_a_canary_with_injected_errors_rolls_back_by_itself(mesh: Mesh) -> None:
    v1, v2, plane, _, listener = mesh
    reset(plane, v1, v2)
    post_faults(v2, {"error_rate": 0.5})
    with Traffic(f"127.0.0.1:{listener}", clients=4) as traffic:
        traffic.wait_ok(20)
        started = plane.admin_post("/models/classifier/canary", {"version": "2", **FAST})
        assert (started["status"], started["percent"], started["stable"]) == ("running", 10, "1")
        run = wait_for(lambda: canary(plane, "rolled_back"), 20, "a rollback")
    assert [h["percent"] for h in run["history"]] == [10, 0]  # never went past the first step
    assert run["reason"].startswith("rolled back at 10%: error rate")
    decisions = [d["decision"] for d in plane.admin_get("/decisions")["decisions"]]
    assert any(
        d.startswith("canary: rolled back") and d.endswith("(v1=100 v2=0)") for d in decisions
    )
    assert plane.admin_get("/status")["version_splits"]["classifier"] == {"1": 100, "2": 0}
    wait_for(lambda: versions_served(listener, 40).keys() == {"1"}, 15, "every request on v1")
    metrics = plane.admin_get("/metrics")
    assert 'canary_transitions_total{model="classifier",outcome="rolled_back"} 1.0' in metrics


def test_a_healthy_canary_reaches_100_percent(mesh: Mesh) -> None:
    v1, v2, plane, _, listener = mesh
    reset(plane, v1, v2)
    with Traffic(f"127.0.0.1:{listener}", clients=4) as traffic:
        flags = ["--steps", "10,50,100", "--dwell-s", "1.5", "--min-requests", "5"]
        flags += ["--p99-margin", "20"]  # a P99 of ~100 requests on a busy host is noise
        assert '"status": "running"' in cli(plane, "canary", "classifier", "2", *flags)
        try:
            run = wait_for(lambda: canary(plane, "promoted"), 45, "promotion")
        except TimeoutError:
            print("canaries:", plane.admin_get("/canaries"), plane.admin_get("/decisions"))
            raise
        assert not traffic.errors
    assert [h["percent"] for h in run["history"]] == [10, 50, 100, 100]
    gaps = [b["at"] - a["at"] for a, b in zip(run["history"], run["history"][1:], strict=False)]
    assert all(gap >= 1.5 for gap in gaps), gaps  # each step dwelt
    assert versions_served(listener, 40).keys() == {"2"}
    assert "canary v2 against v1: promoted at 100% (step 3/3)" in cli(plane, "status")


def test_bad_canary_requests_are_refused_and_nothing_changes(mesh: Mesh) -> None:
    _, _, plane, _, _ = mesh
    before = plane.admin_get("/status")["version_splits"]
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"version": "9"}, 409, "classifier v9 is READY on no endpoint"),
        ({"version": "2", "steps": [50, 10]}, 400, "steps: must rise and end at 100"),
        ({"version": "2", "dwell": 3}, 400, "dwell: unknown key"),
        ({"abort": True}, 409, "no canary of classifier is running"),
    ]
    for body, status, words in cases:
        with pytest.raises(urllib.error.HTTPError) as raised:
            plane.admin_post("/models/classifier/canary", body)
        assert raised.value.code == status
        assert words in raised.value.read().decode()
    assert plane.admin_get("/status")["version_splits"] == before
