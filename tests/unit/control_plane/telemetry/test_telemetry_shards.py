"""Telemetry shards: a store's changes since the last push, the merge of what shards push and
of their canary series, and the control plane with real shard processes on one port."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1 import metrics_pb2 as m

from control_plane.config.topology import TelemetryOptions
from control_plane.telemetry.receiver import EXPORT_METHOD
from control_plane.telemetry.series import version_telemetry
from control_plane.telemetry.shards import Push, TelemetryShards
from control_plane.telemetry.store import TelemetryStore
from control_plane.telemetry.values import EndpointTelemetry, Flag, Signal
from tests.envoy_support import free_port
from tests.mesh_support import start_control_plane, write_topology
from tests.otlp_support import attrs, counter, gauge, histogram, request
from tests.support import ROOT, alive, children, wait_for


# -- the store's side: what changed since the last push --------------------------------------
def test_changed_gives_the_endpoints_that_reported_since_the_last_call() -> None:
    store = TelemetryStore(forget_after_s=5.0, track_changes=True)
    store.ingest(request([gauge("inference_queue_depth", 3.0)], "a:1"), received_at=100.0)
    store.ingest(request([gauge("inference_queue_depth", 4.0)], "b:1"), received_at=100.0)
    telemetry, forgotten = store.changed(100.5)
    assert set(telemetry) == {"a:1", "b:1"} and not forgotten
    at, a = telemetry["a:1"]  # read when its report was stored: its ages as of then
    assert at == 100.0 and a.queue_depth == (3, 0.0) and a.age_s == 0.0
    assert store.changed(100.6) == ({}, set())  # nothing new
    store.ingest(request([gauge("inference_queue_depth", 9.0)], "b:1"), received_at=103.0)
    telemetry, _ = store.changed(103.1)
    assert set(telemetry) == {"b:1"}
    assert telemetry["b:1"][1].queue_depth == (9, 0.0)
    telemetry, forgotten = store.changed(106.0)  # a:1 unseen for 6 s > forget_after_s
    assert forgotten == {"a:1"} and not telemetry
    store.ingest(request([gauge("inference_queue_depth", 1.0)], "a:1"), received_at=107.0)
    telemetry, forgotten = store.changed(107.0)  # back: reported, not forgotten
    assert set(telemetry) == {"a:1"} and not forgotten


def test_an_untracked_store_keeps_no_change_lists() -> None:
    store = TelemetryStore(forget_after_s=1.0)
    for t in range(5):
        store.ingest(request([gauge("inference_queue_depth", 1.0)], f"e:{t}"), received_at=t)
    assert store.changed(10.0) == ({}, set())


def test_version_series_of_several_stores_merge_like_one_store() -> None:
    """Two shards each holding some endpoints give the canary the figures one store gives."""
    one, left, right = TelemetryStore(), TelemetryStore(), TelemetryStore()
    fast, slow = [0.004] * 50, [0.09] * 50
    for t, n in ((100.0, 0), (102.0, 1)):
        a = [
            histogram(fast * n, t, version="2"),
            counter(45.0 * n, t, version="2"),
            counter(5.0 * n, t, "INTERNAL", version="2"),
            counter(99.0 * n, t, version="1"),
        ]
        b = [histogram(slow * n, t, version="2"), counter(50.0 * n, t, version="2")]
        for store, body in ((one, a), (one, b), (left, a), (right, b)):
            endpoint = "10.0.0.1:1" if body is a else "10.0.0.2:1"
            store.ingest(request(body, endpoint), received_at=t)
    for since in (None, 101.0):
        parts = [left.version_series("m", since), right.version_series("m", since)]
        # What a shard sends goes through pickle.
        parts = [pickle.loads(pickle.dumps(p)) for p in parts]
        merged = version_telemetry(
            [versions for found in parts for _, versions in found.values()], 103.0, 10.0
        )
        assert merged == one.version_stats("m", 103.0, since)
    assert one.version_stats("m", 103.0)["2"].requests == pytest.approx(100)


def label_gauge(name: str, value: str) -> m.Metric:
    attributes = attrs(**{"name": name, "value": value})
    point = m.NumberDataPoint(attributes=attributes, as_double=1.0)
    return m.Metric(name="server_label", gauge=m.Gauge(data_points=[point]))


def test_telemetry_crosses_processes_unchanged() -> None:
    """A push pickles each endpoint's telemetry as plain values: it comes back equal, with
    its signals, flag and models of their own types."""
    store = TelemetryStore()
    for t, n in ((100.0, 0), (101.0, 1)):
        body = [
            histogram([0.004] * 10 * n, t),
            counter(10.0 * n, t),
            gauge("server_draining", 1.0),
            gauge("inference_queue_depth", 2.0, model="m"),
            label_gauge("device_class", "a100"),
        ]
        store.ingest(request(body, "a:1"), received_at=t)
    before = store.snapshot(101.5)["a:1"]
    after = pickle.loads(pickle.dumps(before))
    assert after == before and after is not before
    assert type(after.p99_ms) is Signal and type(after.draining) is Flag and after.draining.value
    assert after.models and type(after.models[0].qps) is Signal
    assert after.labels == (("device_class", "a100"),)


# -- the control plane's side: what the shards pushed ----------------------------------------
def telemetry(endpoint: str, age_s: float = 0.0, interval_s: float = 1.0) -> EndpointTelemetry:
    return EndpointTelemetry(endpoint, age_s, interval_s, stale=False)


def push(
    at: float,
    *endpoints: str,
    forgotten: frozenset[str] = frozenset(),
    touched: tuple[str, ...] = (),
) -> Push:
    found = {e: (at, telemetry(e)) for e in endpoints}
    return Push(
        at,
        found,
        touched,
        bool(found),
        forgotten,
        frozenset({"hint:1"}),
        (),
        len(endpoints),
        {},
        (),
    )


def test_the_newest_push_wins_and_only_its_shard_forgets_an_endpoint() -> None:
    options = TelemetryOptions(stale_after_intervals=3.0, forget_after_s=60.0)
    shards = TelemetryShards(2, options)
    shards._apply(0, push(10.0, "a:1", "b:1"))
    shards._apply(1, push(11.0, "b:1"))  # b reconnected and landed on shard 1
    shards._apply(0, push(12.0, forgotten=frozenset({"b:1"})))  # shard 0 forgets its old b
    snapshot = shards.snapshot(12.0, ages=False)
    assert set(snapshot) == {"a:1", "b:1"}  # b is still known, from shard 1
    assert shards.take_placement_hints() == {"hint:1"} and shards.take_placement_hints() == set()
    aged = shards.snapshot(13.0)
    assert aged["a:1"].age_s == pytest.approx(3.0) and aged["b:1"].age_s == pytest.approx(2.0)
    # The routing read: the same object until the stale flag flips (3 intervals of 1 s).
    assert shards.snapshot(12.5, ages=False)["a:1"] is snapshot["a:1"]
    assert shards.snapshot(13.5, ages=False)["a:1"].stale
    assert not shards.snapshot(13.5, ages=False)["b:1"].stale
    assert set(shards.snapshot(72.0)) == set()  # unheard of for forget_after_s


def test_telemetry_ages_from_when_its_shard_read_it_not_from_its_push() -> None:
    """A shard windows an endpoint when its report is stored and pushes it up to 0.1 s later
    (more when loaded): the control plane ages it from the reading, not the push."""
    shards = TelemetryShards(1, TelemetryOptions(stale_after_intervals=3.0))
    read = {"a:1": (10.0, telemetry("a:1", age_s=0.0))}
    shards._apply(0, Push(10.4, read, (), True, frozenset(), frozenset(), (), 1, {}, ()))
    assert shards.snapshot(11.0)["a:1"].age_s == pytest.approx(1.0)
    store = TelemetryStore(track_changes=True)
    store.ingest(request([gauge("inference_queue_depth", 3.0)], "a:1"), received_at=20.0)
    at, t = store.changed(20.3)[0]["a:1"]
    shards._apply(
        0, Push(20.3, {"a:1": (at, t)}, (), True, frozenset(), frozenset(), (), 1, {}, ())
    )
    assert shards.snapshot(21.0)["a:1"].queue_depth == (3.0, pytest.approx(1.0))


# -- real shard processes --------------------------------------------------------------------
def export(port: int, body: bytes, channel_options: list[tuple[str, int]] | None = None) -> None:
    # Each call on its own connection (a local subchannel pool), as separate servers would be.
    options = [("grpc.use_local_subchannel_pool", 1), *(channel_options or [])]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        call = channel.unary_unary(
            EXPORT_METHOD, response_deserializer=ExportMetricsServiceResponse.FromString
        )
        call(body, timeout=30)


def admin_json(admin: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}{path}", timeout=5) as response:
        return cast("dict[str, Any]", json.loads(response.read()))


def metric(admin: str, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(rf"^{name} ([\d.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.integration
def test_shards_share_the_port_serve_every_connection_and_come_back(tmp_path: Path) -> None:
    endpoints = [f"127.0.0.1:{port}" for port in range(20001, 20013)]
    top = {"telemetry": {"shards": 2}}
    topology = write_topology(tmp_path / "t.yaml", free_port(), endpoints[:1], top=top)
    proc, log = start_control_plane(topology, tmp_path / "cp.log")
    try:
        match = wait_for(
            lambda: re.search(r"admin=[\d.]+:(\d+) otlp=[\d.]+:(\d+)", log.read_text()),
            60,
            "control plane up",
        )
        admin, otlp = match.group(1), int(match.group(2))
        shards = [p for p in children(proc.pid) if "spawn_main" in _cmdline(p)]
        assert len(shards) == 2, _cmdline_all(proc.pid)

        # Twelve servers, each on its own connection: the kernel spreads them over both
        # shards, and every one reaches the control plane's telemetry.
        for i, endpoint in enumerate(endpoints):
            body = request([gauge("inference_queue_depth", float(i))], endpoint)
            export(otlp, body.SerializeToString())

        def depths() -> dict[str, float | None]:
            found = admin_json(admin, "/telemetry")["endpoints"]
            return {k: (v.get("queue_depth") or {}).get("value") for k, v in found.items()}

        wait_for(lambda: len(depths()) == len(endpoints), 20, "every endpoint in /telemetry")
        assert depths() == {e: float(i) for i, e in enumerate(endpoints)}
        wait_for(lambda: metric(admin, "telemetry_points_total") >= 12, 10, "points counted")

        # Hostile input still gets INVALID_ARGUMENT, from whichever shard takes it.
        with pytest.raises(grpc.RpcError) as bad:
            export(otlp, b"\xff\xff not protobuf")
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        # The port is the shards': a second control plane on it fails instead of sharing it.
        with socket.socket() as probe, pytest.raises(OSError):
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", otlp))

        # A shard that dies is started again, and exports keep arriving.
        os.kill(shards[0], signal.SIGKILL)
        wait_for(lambda: metric(admin, "telemetry_shard_restarts_total") >= 1, 60, "a restart")
        wait_for(
            lambda: len([p for p in children(proc.pid) if "spawn_main" in _cmdline(p)]) == 2,
            60,
            "two shards again",
        )
        body = request([gauge("inference_queue_depth", 42.0)], endpoints[0])
        export(otlp, body.SerializeToString())
        wait_for(lambda: depths()[endpoints[0]] == 42.0, 20, "a new export after the restart")

        live = [p for p in children(proc.pid) if "spawn_main" in _cmdline(p)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        wait_for(lambda: not any(alive(p) for p in live), 10, "the shards gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.integration
def test_a_taken_port_stops_the_control_plane_with_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        top = {"telemetry": {"shards": 2, "port": port}}
        topology = write_topology(tmp_path / "t.yaml", free_port(), ["127.0.0.1:1"], top=top)
        command = [
            sys.executable, "-m", "control_plane", "--topology", str(topology),
            "--xds-port", "0", "--admin-port", "0",
        ]  # fmt: skip
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert f"cannot start: telemetry port 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def _cmdline_all(pid: int) -> list[str]:
    return [_cmdline(p) for p in children(pid)]


def test_a_shard_that_dies_before_it_is_ready_is_an_error_the_restart_loop_retries(
    tmp_path: Path,
) -> None:
    """A shard that exits before its "ready" (its certificates half-written mid-renewal, the
    memory pressure that killed its predecessor) made recv() raise EOFError, which the restart
    loop, catching OSError only, let end the supervising thread: no more restarts, no word but
    a traceback. It is now the OSError the loop retries on."""
    shards = TelemetryShards(1, TelemetryOptions(host="127.0.0.1"), pki=(str(tmp_path), "cp"))
    with pytest.raises(OSError, match="exited before it was ready"):
        shards._start_one(0, 0)
