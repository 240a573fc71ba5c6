"""Server spans continue the caller's W3C trace, directly and through Envoy."""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from control_plane.model.mesh import model_cluster
from infermesh.api_keys import add_key, basic_authorization, new_key
from tests.envoy_support import free_port
from tests.mesh_support import ControlPlaneThread, start_ads_envoy, write_topology
from tests.support import start_server, wait_for

pytestmark = pytest.mark.integration


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, str], Any]] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    self.spans.extend((resource, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def find(self, trace_id: str) -> tuple[dict[str, str], Any] | None:
        with self.lock:
            return next(((r, s) for r, s in self.spans if s.trace_id.hex() == trace_id), None)


@pytest.fixture
def sink() -> Iterator[tuple[SpanSink, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    receiver = SpanSink()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, port
    server.stop(0)


def call(url: str, trace_id: str, parent: str, headers: dict[str, str] | None = None) -> None:
    tensor = grpcclient.InferInput("input", [2, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(np.zeros((2, 3, 32, 32), dtype=np.float32))
    traceparent = f"00-{trace_id}-{parent}-01"
    grpcclient.InferenceServerClient(url).infer(
        "classifier", [tensor], headers={"traceparent": traceparent, **(headers or {})}
    )


def attributes(span: Any) -> dict[str, Any]:
    return {a.key: a.value.string_value or a.value.int_value for a in span.attributes}


def test_spans_continue_the_callers_trace_directly_and_through_envoy(
    demo_repo: Path, tmp_path: Path, sink: tuple[SpanSink, int]
) -> None:
    receiver, port = sink
    with contextlib.ExitStack() as stops:
        server = start_server(
            demo_repo, tmp_path / "s", "--models", "classifier",
            "--trace-endpoint", f"127.0.0.1:{port}",
        )  # fmt: skip
        stops.callback(server.stop)
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        call(server.url, trace_id, parent)
        found = wait_for(lambda: receiver.find(trace_id), 10, "the server span")
        resource, span = found
        assert span.parent_span_id.hex() == parent
        assert span.kind == span.SPAN_KIND_SERVER
        assert resource["service.instance.id"] == server.url
        attrs = attributes(span)
        assert attrs["infermesh.model"] == "classifier"
        assert attrs["infermesh.model.version"] == "2"
        assert attrs["infermesh.batch_size"] == 2
        assert attrs["rpc.grpc.status_code"] == 0
        assert "infermesh.tenant" not in attrs  # no authenticating edge: no tenant
        # Through Envoy the traceparent header arrives unchanged: the same trace continues,
        # and the span names the tenant Envoy authenticated.
        listener = free_port()
        key = new_key("team-t")
        add_key(tmp_path / "api-keys", key)
        auth = {"mode": "api_keys", "api_keys_file": str(tmp_path / "api-keys")}
        topology = write_topology(tmp_path / "t.yaml", listener, [server.url],
                                  top={"listener": {"auth": auth}})  # fmt: skip
        plane = ControlPlaneThread(topology)
        stops.callback(plane.stop)
        envoy = start_ads_envoy(tmp_path, plane.plane.xds_port, listener, delta=False)
        stops.callback(envoy.stop)
        wait_for(
            lambda: (
                f"{model_cluster('classifier')}::{server.url}::health_flags::healthy"
                in envoy.admin("/clusters")
            ),
            20,
            "a healthy endpoint in Envoy",
        )
        trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
        call(f"127.0.0.1:{listener}", trace_id, parent,
             {"authorization": basic_authorization(key)})  # fmt: skip
        _, via_envoy = wait_for(lambda: receiver.find(trace_id), 10, "the span via Envoy")
        assert via_envoy.parent_span_id.hex() == parent
        assert attributes(via_envoy)["infermesh.tenant"] == "team-t"
