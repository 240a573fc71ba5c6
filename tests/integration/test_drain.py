"""Graceful drain (the article's incident 3): SIGTERM under 32 concurrent clients loses nothing."""

from __future__ import annotations

import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.support import Traffic, start_server, wait_for

pytestmark = pytest.mark.integration
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Errors a client may see that prove the request was never taken: a refusal while draining,
# or no connection at all once the server has gone.
NEVER_TAKEN = re.compile(
    r"draining|failed to connect|Connection refused|connections to all backends"
)


def test_sigterm_under_load_answers_everything_it_took(demo_repo: Path, tmp_path: Path) -> None:
    server = start_server(
        demo_repo, tmp_path, "--models", "classifier",
        "--drain-delay", "1.0", "--drain-timeout", "20",
    )  # fmt: skip
    ready_url = f"http://127.0.0.1:{server.metrics_port}/ready"
    try:
        assert _http_status(ready_url) == 200  # the kubelet's plaintext readiness probe
        with Traffic(server.url, clients=32, leave_when_draining=True) as traffic:
            traffic.wait_ok(300)
            signalled = time.monotonic()
            server.signal(signal.SIGTERM)
            # Health turns NOT_SERVING at once, while requests are still accepted.
            wait_for(lambda: server.health() == NOT_SERVING, 0.5, "NOT_SERVING after SIGTERM")
            assert _http_status(ready_url) == 503
            ok_at_not_serving = traffic.ok
            traffic.wait_ok(20, timeout=5)  # still answered during the drain delay
            assert traffic.ok > ok_at_not_serving
            code = server.wait_exit(timeout=25)
            took = time.monotonic() - signalled
        assert code == 0, server.log()
        assert took < 20
        unexpected = [e for e in traffic.errors if not (
            e[0] == grpc.StatusCode.UNAVAILABLE and NEVER_TAKEN.search(e[1])
        )]  # fmt: skip
        assert unexpected == [], unexpected[:5]
        log = server.log()
        for phase in ("drain 1/3", "drain 2/3", "drain 3/3"):
            assert phase in log
        # Every request the server answered OK reached a client: nothing was lost on the way.
        answered = re.search(r"requests answered since start: (.*)", log)
        assert answered, log
        counts = dict(pair.split("=") for pair in answered.group(1).split(", "))
        assert int(counts["OK"]) == traffic.ok
        assert int(counts.get("UNAVAILABLE", 0)) == sum(
            1 for e in traffic.errors if "draining" in e[1]
        )
    finally:
        server.stop()


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
