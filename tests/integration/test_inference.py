"""ModelInfer and the metadata APIs against a real server, with the stock Triton client."""

from __future__ import annotations

import queue
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2
from tritonclient.grpc import service_pb2

from tests.support import (
    ServerProcess,
    classifier_request,
    infer_classifier,
    metric_value,
    start_server,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(demo_repo, tmp_path_factory.mktemp("logs"))
    yield proc
    proc.stop()


def reference(demo_repo: Path, version: int, images: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(
        str(demo_repo / "classifier" / str(version) / "model.onnx"),
        providers=["CPUExecutionProvider"],
    )
    return np.asarray(session.run(["probs"], {"input": images})[0])


def images(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, 32, 32), dtype=np.float32)


@pytest.mark.parametrize("version", ["1", "2"])
def test_outputs_equal_onnxruntime_run_directly(
    server: ServerProcess, demo_repo: Path, version: str
) -> None:
    x = images(5, seed=int(version))
    result = infer_classifier(server.client(), x, version=version)
    np.testing.assert_allclose(
        result.as_numpy("probs"), reference(demo_repo, int(version), x), atol=1e-6
    )
    assert result.get_response().model_version == version


def test_request_without_version_gets_the_newest_ready_one(
    server: ServerProcess, demo_repo: Path
) -> None:
    x = images(2)
    result = infer_classifier(server.client(), x)
    assert result.get_response().model_version == "2"
    np.testing.assert_allclose(result.as_numpy("probs"), reference(demo_repo, 2, x), atol=1e-6)
    assert not np.allclose(reference(demo_repo, 1, x), reference(demo_repo, 2, x))


def test_request_id_is_echoed_and_outputs_are_raw(server: ServerProcess) -> None:
    response = server.stub().ModelInfer(classifier_request(images(1), request_id="req-42"))
    assert response.id == "req-42"
    assert response.outputs[0].name == "probs"
    assert list(response.outputs[0].shape) == [1, 10]
    assert len(response.raw_output_contents[0]) == 10 * 4


def test_typed_contents_are_accepted(server: ServerProcess, demo_repo: Path) -> None:
    x = images(2, seed=7)
    request = service_pb2.ModelInferRequest(model_name="classifier", model_version="1")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=[2, 3, 32, 32])
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    response = server.stub().ModelInfer(request)
    probs = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(2, 10)
    np.testing.assert_allclose(probs, reference(demo_repo, 1, x), atol=1e-6)


def test_requested_outputs_are_honoured(server: ServerProcess) -> None:
    request = classifier_request(images(1))
    request.outputs.add(name="probs")
    response = server.stub().ModelInfer(request)
    assert [o.name for o in response.outputs] == ["probs"]


def test_metadata_config_and_provider(server: ServerProcess) -> None:
    client = server.client()
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("classifier") and client.is_model_ready("classifier", "1")
    assert not client.is_model_ready("classifier", "9")
    assert not client.is_model_ready("nope")
    metadata = client.get_model_metadata("classifier")
    assert metadata.versions == ["1", "2"]
    assert metadata.inputs[0].name == "input" and metadata.inputs[0].datatype == "FP32"
    assert list(metadata.inputs[0].shape) == [-1, 3, 32, 32]
    assert list(metadata.outputs[0].shape) == [-1, 10]
    config = client.get_model_config("classifier").config
    assert config.max_batch_size == 32
    assert config.parameters["execution_provider"].string_value == "CPUExecutionProvider"
    server_metadata = client.get_server_metadata()
    assert server_metadata.name == "infermesh" and "model_repository" in server_metadata.extensions


def test_statistics_count_inferences(server: ServerProcess) -> None:
    client = server.client()

    def stats() -> service_pb2.ModelStatistics:
        return client.get_inference_statistics("classifier", "1").model_stats[0]

    before = stats()
    infer_classifier(client, images(3), version="1")
    after = stats()
    assert after.inference_count == before.inference_count + 3
    assert after.execution_count == before.execution_count + 1
    assert after.inference_stats.success.count == before.inference_stats.success.count + 1
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns


def test_health_services_serve(server: ServerProcess) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    assert server.health("") == serving
    assert server.health("inference.GRPCInferenceService") == serving


def test_prometheus_metrics(server: ServerProcess) -> None:
    infer_classifier(server.client(), images(1), version="2")
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    ok = 'inference_requests_total{code="OK",model="classifier",version="2"}'
    assert ok in text
    assert metric_value(text, "inference_request_duration_seconds_count", model="classifier") > 0
    assert 'le="0.00025"' in text  # sub-millisecond buckets
    assert metric_value(text, "model_state", model="classifier", version="1", state="READY") == 1
    assert metric_value(text, "accelerator_memory_total_bytes", source="process") > 0
    assert "model_load_time_ms_bucket" in text


def test_stream_infer_answers_each_request(server: ServerProcess, demo_repo: Path) -> None:
    client = server.client()
    results: queue.Queue[tuple[grpcclient.InferResult | None, Exception | None]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for seed in range(3):
            x = images(1, seed)
            tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
            tensor.set_data_from_numpy(x)
            client.async_stream_infer(
                "classifier", [tensor], model_version="1", request_id=str(seed)
            )
        answers = [results.get(timeout=10) for _ in range(3)]
    finally:
        client.stop_stream()
    for seed, (result, error) in enumerate(answers):
        assert error is None and result is not None
        assert result.get_response().id == str(seed)
        np.testing.assert_allclose(
            result.as_numpy("probs"), reference(demo_repo, 1, images(1, seed)), atol=1e-6
        )


def test_version_header_applies_when_the_request_names_no_version(server: ServerProcess) -> None:
    """Envoy's version split tells the server which version a request's share went to."""
    client = server.client()
    tensor = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(images(1))
    routed = client.infer("classifier", [tensor], headers={"x-model-version": "1"})
    assert routed.get_response().model_version == "1"
    named = client.infer(
        "classifier", [tensor], model_version="2", headers={"x-model-version": "1"}
    )
    assert named.get_response().model_version == "2"  # the request's own version wins
