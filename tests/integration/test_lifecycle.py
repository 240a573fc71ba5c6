"""Lifecycle: readiness after warm-up, failed models, hot (re)load under traffic, polling."""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2
from tritonclient.utils import InferenceServerException

from tests.support import (
    EXPLICIT,
    ServerProcess,
    Traffic,
    metric_value,
    start_server,
    wait_for,
)

pytestmark = pytest.mark.integration
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

SLOW_WARMUP = """
model_warmup [ {
  name: "long_warmup" batch_size: 32 count: 600
  inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 3, 32, 32 ] random_data: true } }
} ]
"""


def index(server: ServerProcess) -> dict[tuple[str, str], tuple[str, str]]:
    rows = server.client().get_model_repository_index().models
    return {(m.name, m.version): (m.state, m.reason) for m in rows}


def test_not_serving_until_warm(copy_repo: Path, tmp_path: Path) -> None:
    config = copy_repo / "classifier" / "config.pbtxt"
    config.write_text(config.read_text() + SLOW_WARMUP)
    server = start_server(copy_repo, tmp_path, wait_ready=False)
    try:
        client = server.client()
        assert client.is_server_live()  # live at once, while the models load
        seen_warming = wait_for(
            lambda: any(state == "WARMING" for state, _ in index(server).values()),
            30,
            "a version in WARMING",
            interval=0.01,
        )
        assert seen_warming
        assert not client.is_server_ready()
        assert server.health() == NOT_SERVING
        assert server.health("inference.GRPCInferenceService") == NOT_SERVING
        with pytest.raises(InferenceServerException) as caught:
            client.infer("classifier", [_input()])
        assert "UNAVAILABLE" in str(caught.value.status())
        server.wait_ready(60)
        assert server.health() == SERVING
        assert {state for state, _ in index(server).values()} == {"READY"}
    finally:
        server.stop()


def _input() -> grpcclient.InferInput:
    import numpy as np

    tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 3, 32, 32), dtype=np.float32))
    return tensor


def test_broken_models_fail_with_reasons_and_the_rest_serves(
    copy_repo: Path, tmp_path: Path
) -> None:
    (copy_repo / "corrupt" / "1").mkdir(parents=True)
    (copy_repo / "corrupt" / "1" / "model.onnx").write_bytes(b"this is not an onnx model")
    shutil.copytree(copy_repo / "classifier", copy_repo / "badconfig")
    (copy_repo / "badconfig" / "config.pbtxt").write_text(
        (copy_repo / "classifier" / "config.pbtxt")
        .read_text()
        .replace('"classifier"', '"badconfig"')
        .replace('name: "input"', 'name: "image"')
    )
    (copy_repo / "empty").mkdir()
    server = start_server(copy_repo, tmp_path, *EXPLICIT, wait_ready=False)
    try:
        wait_for(lambda: "startup loading done" in server.log(), 60, "startup loading")
        rows = index(server)
        assert rows[("corrupt", "1")][0] == "FAILED"
        corrupt_reason = rows[("corrupt", "1")][1]
        assert "INVALID_PROTOBUF" in corrupt_reason and "corrupt/1/model.onnx" in corrupt_reason
        state, reason = rows[("badconfig", "1")]
        assert state == "FAILED" and "input 'image' is not in the ONNX graph" in reason
        assert (
            rows[("empty", "")][0] == "FAILED" and "no version directory" in rows[("empty", "")][1]
        )
        assert rows[("classifier", "2")][0] == "READY"
        # Every model on disk is required by default: the server is not ready, but serves.
        assert not server.client().is_server_ready()
        assert server.client().is_model_ready("classifier")
        server.client().infer("classifier", [_input()])
        with pytest.raises(InferenceServerException) as caught:
            server.client().infer("corrupt", [_input()])
        assert "UNAVAILABLE" in str(caught.value.status())
        assert "FAILED" in caught.value.message()
        with pytest.raises(InferenceServerException) as load_error:
            server.client().load_model("corrupt")
        assert "version 1" in load_error.value.message()
        assert (
            "ERROR model_server.lifecycle.version: model 'corrupt' version 1: FAILED"
            in server.log()
        )
    finally:
        server.stop()


def test_required_models_only_decide_readiness(copy_repo: Path, tmp_path: Path) -> None:
    (copy_repo / "corrupt" / "1").mkdir(parents=True)
    (copy_repo / "corrupt" / "1" / "model.onnx").write_bytes(b"garbage")
    server = start_server(copy_repo, tmp_path, *EXPLICIT, "--models", "classifier")
    try:
        assert server.client().is_server_ready()
        assert index(server)[("corrupt", "")][0] == "UNAVAILABLE"
        with pytest.raises(InferenceServerException):
            server.client().load_model("corrupt")
        assert index(server)[("corrupt", "1")][0] == "FAILED"
        assert server.client().is_server_ready()
    finally:
        server.stop()


def test_load_unload_and_reload_under_traffic_lose_nothing(copy_repo: Path, tmp_path: Path) -> None:
    server = start_server(copy_repo, tmp_path, *EXPLICIT, "--models", "classifier")
    client = server.client()
    metrics_url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    try:
        with Traffic(server.url, clients=4) as latest, Traffic(server.url, 2, "2") as pinned:
            latest.wait_ok(50)

            # Six clients on one worker thread per version: requests queue, and the gauges,
            # read at scrape time, show it.
            def scrape() -> str:
                return str(urllib.request.urlopen(metrics_url, timeout=5).read().decode())

            # Both gauges from one scrape: between two scrapes the queue can empty for a moment.
            def queued_and_in_flight() -> bool:
                text = scrape()
                return (
                    metric_value(text, "inference_queue_depth", model="classifier") > 0
                    and metric_value(text, "inference_in_flight_requests") > 0
                )

            wait_for(queued_and_in_flight, 10, "a queue and requests in flight under load")
            # A new version appears: load makes it READY, then unversioned traffic moves to it.
            shutil.copytree(copy_repo / "classifier" / "1", copy_repo / "classifier" / "3")
            client.load_model("classifier")
            assert client.is_model_ready("classifier", "3")
            latest.wait_ok(50)
            wait_for(lambda: latest.versions.get("3", 0) > 20, 30, "traffic on version 3")
            # Version 2 changes on disk: the reload swaps in a new session under pinned traffic.
            before = pinned.ok
            shutil.copy(copy_repo / "classifier" / "1" / "model.onnx", copy_repo / "classifier"
                        / "2" / "model.onnx")  # fmt: skip
            client.load_model("classifier")
            wait_for(lambda: pinned.ok > before + 50, 30, "pinned traffic after reload")
            # The replaced version 2 unloads; the metrics keep showing the new one READY.
            wait_for(lambda: "version 2: UNAVAILABLE (unloaded)" in server.log(), 10, "old v2 gone")
            text = scrape()
            labels = {"model": "classifier", "version": "2"}
            assert metric_value(text, "model_state", state="READY", **labels) == 1
            assert metric_value(text, "model_state", state="UNLOADING", **labels) == 0
            assert metric_value(text, "model_execution_provider_info", **labels) == 1
            # Another model loads and unloads next to the traffic.
            shutil.copytree(copy_repo / "classifier", copy_repo / "other")
            (copy_repo / "other" / "config.pbtxt").write_text(
                (copy_repo / "classifier" / "config.pbtxt")
                .read_text()
                .replace('"classifier"', '"other"')
            )
            client.load_model("other")
            assert client.is_model_ready("other")
            client.unload_model("other")
            assert not client.is_model_ready("other")
            latest.wait_ok(50)
        assert latest.errors == [] and pinned.errors == []
        assert latest.versions.get("3", 0) > 0 and set(pinned.versions) == {"2"}
        assert client.is_server_ready()
        states = index(server)
        assert states[("classifier", "3")][0] == "READY"
        assert states[("other", "")][0] == "UNAVAILABLE"
    finally:
        server.stop()


def test_removed_version_is_unloaded_after_its_requests(copy_repo: Path, tmp_path: Path) -> None:
    server = start_server(copy_repo, tmp_path, *EXPLICIT, "--models", "classifier")
    try:
        shutil.rmtree(copy_repo / "classifier" / "1")
        server.client().load_model("classifier")
        wait_for(lambda: ("classifier", "1") not in index(server), 10, "version 1 gone")
        with pytest.raises(grpc.RpcError) as caught:
            import numpy as np

            from tests.support import classifier_request

            server.stub().ModelInfer(
                classifier_request(np.zeros((1, 3, 32, 32), np.float32), version="1")
            )
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop()


def test_repository_polling_picks_up_a_new_version(copy_repo: Path, tmp_path: Path) -> None:
    server = start_server(
        copy_repo, tmp_path, "--model-control-mode", "poll", "--repository-poll-interval", "0.2"
    )
    try:
        assert not server.client().is_model_ready("classifier", "3")
        shutil.copytree(copy_repo / "classifier" / "1", copy_repo / "classifier" / "3")
        wait_for(
            lambda: server.client().is_model_ready("classifier", "3"), 30, "version 3 by polling"
        )
        assert "changed on disk; reloading" in server.log()
    finally:
        server.stop()
