"""Real Prometheus scrapes all three kinds of targets with otel/prometheus.yml's jobs."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from control_plane.model.mesh import model_cluster
from tests.envoy_support import free_port
from tests.mesh_support import ControlPlaneThread, start_ads_envoy, write_topology
from tests.support import ROOT, start_server, stop_process, wait_for

pytestmark = pytest.mark.integration


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="tools/install.sh installs it")
def test_prometheus_scrapes_envoy_servers_and_control_plane(
    demo_repo: Path, tmp_path: Path
) -> None:
    with contextlib.ExitStack() as stops:
        server = start_server(demo_repo, tmp_path / "server", "--models", "classifier")
        stops.callback(server.stop)
        listener = free_port()
        plane = ControlPlaneThread(write_topology(tmp_path / "t.yaml", listener, [server.url]))
        stops.callback(plane.stop)
        envoy = start_ads_envoy(tmp_path, plane.plane.xds_port, listener, delta=False)
        stops.callback(envoy.stop)
        config = yaml.safe_load((ROOT / "otel" / "prometheus.yml").read_text())
        targets = {
            "envoy": f"127.0.0.1:{envoy.admin_port}",
            "model-servers": f"127.0.0.1:{server.metrics_port}",
            "control-plane": f"127.0.0.1:{plane.plane.admin_port}",
        }
        jobs = [j for j in config["scrape_configs"] if j["job_name"] in targets]
        assert len(jobs) == 3
        for job in jobs:
            job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        config["scrape_configs"] = jobs
        config["global"]["scrape_interval"] = "1s"
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = stops.enter_context((tmp_path / "prometheus.log").open("wb"))
        prometheus = subprocess.Popen(
            [
                "prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        stops.callback(_stop, prometheus)
        api = f"http://127.0.0.1:{port}/api/v1"

        def all_up() -> bool:
            try:
                active = _get(f"{api}/targets")["data"]["activeTargets"]
            except OSError:
                return False
            return len(active) == 3 and all(t["health"] == "up" for t in active)

        wait_for(all_up, 60, "every target up in Prometheus", interval=0.5)

        def has(query: str) -> bool:
            result = _get(f"{api}/query?query={urllib.parse.quote(query)}")["data"]["result"]
            return bool(result)

        cluster = model_cluster("classifier").replace(":", "_")
        for query in (
            'model_state{model="classifier",state="READY"}',
            "xds_responses_total",
            f'envoy_cluster_membership_healthy{{envoy_cluster_name="{cluster}"}}',
        ):
            wait_for(functools.partial(has, query), 30, f"Prometheus has {query}", interval=0.5)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    stop_process(proc, signal.SIGTERM, 15)
