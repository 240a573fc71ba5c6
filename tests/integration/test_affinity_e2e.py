"""Prefix affinity for real: three demo-LM servers behind Envoy and the control plane, the
demo LM with ``affinity: prefix``. Requests sharing a prefix land on one server, different
prefixes spread over all three, a very hot prefix spills over under the bound, a drained
server gets nothing, and /status shows the mode and each endpoint's cache hit rate."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2_grpc

from model_server.demo_lm import build_demo_lm
from tests.envoy_support import Envoy, free_port
from tests.mesh_support import ControlPlaneThread, start_plane_and_envoy, write_topology
from tests.support import MODEL, ServerProcess, start_server, text_request, wait_for

pytestmark = pytest.mark.integration

FACTOR = 150  # hash_balance_factor
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


@dataclass
class Mesh:
    servers: list[ServerProcess]
    plane: ControlPlaneThread
    envoy: Envoy
    listener: int
    log: Path

    def sent(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log.exists() else 0

    def upstreams(self, after: int, count: int) -> list[str]:
        """The upstream of each of the ``count`` stream requests logged after line ``after``."""

        def entries() -> list[str] | None:
            lines = self.log.read_text().splitlines()[after:] if self.log.exists() else []
            found = [json.loads(line) for line in lines]
            streams = [e["upstream"] for e in found if e["path"] == STREAM]
            return streams if len(streams) >= count else None

        return wait_for(entries, 20, f"{count} stream requests in the access log")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    workdir = tmp_path_factory.mktemp("affinity")
    repo = workdir / "repo"
    build_demo_lm(repo)
    otlp, listener = free_port(), free_port()
    log = workdir / "access.log"
    with contextlib.ExitStack() as stops:
        servers = []
        for i in range(3):
            server = start_server(
                repo, workdir / f"s{i}", "--models", MODEL,
                "--otlp-endpoint", f"127.0.0.1:{otlp}", "--telemetry-interval", "0.2",
            )  # fmt: skip
            stops.callback(server.stop)
            servers.append(server)
        # Weights move only on large changes: the test reads which server a key maps to.
        lm = {"name": MODEL, "sla_p99_ms": 5000, "capacity_qps": 50, "generative": True,
              "routing": {"hysteresis": 0.9},
              "affinity": {"mode": "prefix", "prefix_blocks": 4, "one_request_streams": True,
                           "hash_balance_factor": FACTOR}}  # fmt: skip
        topology = write_topology(
            workdir / "t.yaml", listener, [s.url for s in servers], more_models=[lm],
            top={"listener": {"access_log": str(log)}},
        )  # fmt: skip
        plane, envoy = start_plane_and_envoy(stops, workdir, topology, listener, 6, otlp)
        wait_for(
            lambda: envoy.admin("/clusters").count(f"model:{MODEL}::127.0.0.1:") > 0
            and all(f"model:{MODEL}::{s.url}::health_flags::healthy" in envoy.admin("/clusters")
                    for s in servers),
            30,
            "the three servers healthy in the model's cluster",
        )  # fmt: skip
        yield Mesh(servers, plane, envoy, listener, log)


def generate(listener: int, prompt: str, max_tokens: int = 2) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{listener}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = text_request(prompt, max_tokens=max_tokens)
        metadata = (("x-model-name", MODEL),)
        for response in stub.ModelStreamInfer(iter([request]), metadata=metadata, timeout=60):
            assert not response.error_message, response.error_message


def host_stat(envoy: Envoy, stat: str) -> dict[str, int]:
    """Each of the model's endpoints' ``stat`` (rq_active, weight) from Envoy's /clusters."""
    return {host: int(value) for host, value in envoy.host_stats(f"model:{MODEL}", stat).items()}


def prefix(i: int) -> str:
    return f"System prompt {i:03d}: you answer questions about caches. " * 2  # >= 64 bytes


def test_a_shared_prefix_lands_on_one_server_and_different_prefixes_spread(mesh: Mesh) -> None:
    mark = mesh.sent()
    for question in range(8):
        generate(mesh.listener, prefix(0) + f"question {question}?")
    assert len(set(mesh.upstreams(mark, 8))) == 1
    mark = mesh.sent()
    for i in range(1, 25):
        generate(mesh.listener, prefix(i) + "why?")
    spread = collections.Counter(mesh.upstreams(mark, 24))
    assert len(spread) == 3, spread  # 24 keys over three equal servers
    status = mesh.plane.admin_get("/status")["affinity"][MODEL]
    assert status["mode"] == "prefix" and status["hash_balance_factor"] == FACTOR
    assert set(status["endpoints"]) == {s.url for s in mesh.servers}


def test_a_very_hot_prefix_spills_over_under_the_bound(mesh: Mesh) -> None:
    """24 concurrent streams on one prefix: the bound holds each server's requests in flight
    to FACTOR % of the mean, so the key's own server takes about half, the rest spill."""
    mark, count = mesh.sent(), 24
    start = threading.Barrier(count)

    def one(i: int) -> None:
        start.wait(30)
        generate(mesh.listener, prefix(0) + f"hot {i}?", max_tokens=48)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    # What the bound bounds: each server's streams in flight, as Envoy counts them.
    busiest, weights = 0, host_stat(mesh.envoy, "weight")
    while any(thread.is_alive() for thread in threads):
        busiest = max([busiest, *host_stat(mesh.envoy, "rq_active").values()])
    for thread in threads:
        thread.join(120)
    load = collections.Counter(mesh.upstreams(mark, count))
    assert len(load) >= 2, load  # it spilled
    # Envoy picks a host while its streams in flight are at most ceil(ceil((all in flight + 1)
    # x FACTOR/100) x its weight's share) (hostOverloadFactor in Envoy's thread-aware load
    # balancer): with 24 streams and equal weights 12, so 13 at most with the one it picks.
    share = max(weights.values()) / sum(weights.values())
    bound = math.ceil(math.ceil(count * FACTOR / 100) * share) + 1
    print(f"\nhot prefix: busiest host {busiest} in flight (bound {bound}), requests {load}")
    assert busiest >= 4, busiest  # the samples saw the burst
    assert busiest <= bound, (busiest, bound, weights, load)
    # By requests (a stream that ends early frees its place for a later one): most spilled.
    assert max(load.values()) <= count * 3 // 4, load


@pytest.mark.parametrize("health", ["DRAINING", "UNHEALTHY"])
def test_a_drained_or_ejected_server_receives_nothing(mesh: Mesh, health: str) -> None:
    """An operator's drain, and an ejection (the same EDS health the router sets)."""
    mark = mesh.sent()
    generate(mesh.listener, prefix(0) + "where?")
    (home,) = mesh.upstreams(mark, 1)
    mesh.plane.admin_post(f"/endpoints/{home}", {"health": health})
    try:
        flags = f"model:{MODEL}::{home}::health_flags::"
        wait_for(
            lambda: any(line.startswith(flags) and not line.endswith("::healthy")
                        for line in mesh.envoy.admin("/clusters").splitlines()),
            20,
            f"Envoy to see {home} {health}",
        )  # fmt: skip
        mark = mesh.sent()
        for i in range(12):
            generate(mesh.listener, prefix(i % 4) + f"after {i}?")
        served = mesh.upstreams(mark, 12)
        assert home not in served, served
        # the drained server's key moved to one other server, and stays there
        moved = [served[i] for i in range(0, 12, 4)]
        assert len(set(moved)) == 1, served
    finally:
        mesh.plane.admin_post(f"/endpoints/{home}", {"health": None})
