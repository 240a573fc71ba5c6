"""Scenarios against the compose topology run natively: a rolling restart of every model
server under load (the source article's incident 3), and hostile inputs through Envoy while
good traffic flows (incident 2). Each prints what clients saw."""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.scenarios.harness import ComposeMesh
from tests.support import classifier_request, wait_for

pytestmark = pytest.mark.integration
SERVERS = ("model-server-1", "model-server-2", "model-server-3")


@pytest.fixture
def mesh(demo_repo: Path, tmp_path: Path) -> Iterator[ComposeMesh]:
    with ComposeMesh(tmp_path, demo_repo) as running:
        yield running


def restarted(mesh: ComposeMesh, server: str, starts_before: int) -> bool:
    healthy = mesh.log.read_text().count(f"infermesh: {server} healthy")
    return mesh.starts(server) > starts_before and healthy > starts_before


def test_rolling_restart_of_every_model_server_under_load(mesh: ComposeMesh) -> None:
    started = time.monotonic()
    with mesh.traffic(clients=4, deadline_s=240) as traffic:
        traffic.wait_ok(100)
        for server in SERVERS:  # one at a time: SIGTERM drains it, the launcher restarts it
            before = mesh.starts(server)
            os.kill(mesh.pids()[server], signal.SIGTERM)
            back = functools.partial(restarted, mesh, server, before)
            wait_for(back, 90, f"{server} drained, restarted and healthy")
            # One at a time means: the next goes only once Envoy routes to this one again.
            wait_for(lambda: mesh.envoy_healthy() == len(SERVERS), 30, "Envoy to route to it")
            traffic.wait_ok(100)
    took = time.monotonic() - started
    print(
        f"\nrolling restart of {len(SERVERS)} model servers under load: {traffic.ok} OK, "
        f"{len(traffic.errors)} failed in {took:.1f} s"
    )
    assert not traffic.errors, traffic.errors[:5]


def bad_requests() -> list[tuple[str, service_pb2.ModelInferRequest, grpc.StatusCode]]:
    """Each sent with the x-model-name header (as a stream must be): a header-less body over
    Envoy's 80 MiB routing buffer gets HTTP 413, which gRPC reads as UNKNOWN."""
    good = classifier_request(np.zeros((1, 3, 32, 32), dtype=np.float32))
    shape = classifier_request(np.zeros((1, 3, 16, 16), dtype=np.float32))
    dtype = classifier_request(np.zeros((1, 3, 32, 32), dtype=np.float32))
    dtype.inputs[0].datatype = "INT32"
    short = classifier_request(np.zeros((1, 3, 32, 32), dtype=np.float32))
    short.raw_input_contents[0] = short.raw_input_contents[0][:-4]
    unknown = classifier_request(np.zeros((1, 3, 32, 32), dtype=np.float32))
    unknown.model_name = "nonexistent"
    huge = classifier_request(np.zeros((1, 3, 32, 32), dtype=np.float32))
    huge.raw_input_contents[0] = b"\0" * (100 * 1024 * 1024)  # over the 80 MiB routed bodies
    assert good.model_name == "classifier"
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    return [
        ("wrong shape", shape, invalid),
        ("wrong datatype", dtype, invalid),
        ("wrong byte length", short, invalid),
        ("unknown model", unknown, grpc.StatusCode.NOT_FOUND),
        ("oversized message", huge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ]


def test_hostile_inputs_through_envoy_get_their_codes_and_disturb_nothing(
    mesh: ComposeMesh,
) -> None:
    seen: dict[str, grpc.StatusCode] = {}
    options = [("grpc.max_send_message_length", 200 * 1024 * 1024)]
    with mesh.traffic(clients=2, deadline_s=120) as traffic:
        traffic.wait_ok(50)
        with mesh.edge_channel(options) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(20):
                for name, request, _code in bad_requests():
                    metadata = (("x-model-name", request.model_name), *mesh.api_metadata)
                    with pytest.raises(grpc.RpcError) as raised:
                        stub.ModelInfer(request, timeout=30, metadata=metadata)
                    seen[name] = raised.value.code()
        traffic.wait_ok(50)
    print(f"\nhostile inputs through Envoy: {seen}; good traffic {traffic.ok} OK, "
          f"{len(traffic.errors)} failed")  # fmt: skip
    assert seen == {name: code for name, _, code in bad_requests()}
    assert not traffic.errors, traffic.errors[:5]
