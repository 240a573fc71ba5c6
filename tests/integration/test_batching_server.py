"""Dynamic batching in the real model server: joined executions, exact answers, a bounded queue."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from tritonclient.grpc import service_pb2_grpc

from tests.support import ServerProcess, classifier_request, metric_value, start_server, wait_for

pytestmark = pytest.mark.integration


def with_batching(
    repo: Path, dynamic_batching: str, max_batch_size: int = 32, instances: int = 1
) -> Path:
    config = repo / "classifier" / "config.pbtxt"
    text = config.read_text().replace("max_batch_size: 32", f"max_batch_size: {max_batch_size}")
    text = text.replace("count: 1", f"count: {instances}")
    config.write_text(text + f"dynamic_batching {{ {dynamic_batching} }}\n")
    return repo


def server_metrics(server: ServerProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        return r.read().decode()


def queue_depth(server: ServerProcess) -> float:
    return metric_value(server_metrics(server), "inference_queue_depth", model="classifier")


def hammer(
    server: ServerProcess, clients: int, each: int
) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[grpc.RpcError]]:
    """``clients`` threads, ``each`` requests apiece, all at once: (input, output) pairs, errors."""
    answers: list[tuple[np.ndarray, np.ndarray]] = []
    errors: list[grpc.RpcError] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(index: int) -> None:
        rng = np.random.default_rng(index)
        with grpc.insecure_channel(server.url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            start.wait()
            for _ in range(each):
                images = rng.random((1, 3, 32, 32), dtype=np.float32)
                try:
                    response = stub.ModelInfer(classifier_request(images, "1"), timeout=30)
                except grpc.RpcError as error:
                    with lock:
                        errors.append(error)
                    continue
                probs = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(1, 10)
                with lock:
                    answers.append((images, probs))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client thread outlived its join"
    return answers, errors


@pytest.fixture
def batching_server(copy_repo: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    # Two instances: two sessions on two worker threads, each taking whole batches.
    repo = with_batching(copy_repo, "max_queue_delay_microseconds: 2000", instances=2)
    server = start_server(repo, tmp_path / "logs", "--models", "classifier")
    yield server
    server.stop()


def test_concurrent_requests_share_executions_and_answers_are_exact(
    batching_server: ServerProcess, copy_repo: Path
) -> None:
    answers, errors = hammer(batching_server, clients=16, each=8)
    assert not errors and len(answers) == 128
    session = ort.InferenceSession(str(copy_repo / "classifier" / "1" / "model.onnx"))
    for images, probs in answers:
        expected = session.run(None, {"input": images})[0]
        np.testing.assert_allclose(probs, expected, rtol=1e-5, atol=1e-6)
    stats = batching_server.client().get_inference_statistics("classifier", "1").model_stats[0]
    assert stats.inference_count >= 128
    assert stats.execution_count < stats.inference_count  # joined into fewer ONNX Runtime calls
    config = batching_server.client().get_model_config("classifier").config
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert config.instance_group[0].count == 2


def test_a_full_queue_answers_resource_exhausted_and_the_rest_are_served(
    copy_repo: Path, tmp_path: Path
) -> None:
    """The queue is filled on purpose, not hoped for: with a 3 s queue delay and batches of up
    to 8, one-image requests wait; two fill a queue of 2, and the third is refused at once.
    (It was 24 client threads hoping to overflow the queue; on a loaded host the server kept
    up with them and nothing was refused.)"""
    repo = with_batching(
        copy_repo,
        "max_queue_delay_microseconds: 3000000 default_queue_policy { max_queue_size: 2 }",
        max_batch_size=8,
    )
    server = start_server(repo, tmp_path / "logs", "--models", "classifier")
    try:
        rng = np.random.default_rng(7)
        images = [rng.random((1, 3, 32, 32), dtype=np.float32) for _ in range(3)]
        with grpc.insecure_channel(server.url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            queued = [
                stub.ModelInfer.future(classifier_request(x, "1"), timeout=30) for x in images[:2]
            ]
            wait_for(lambda: queue_depth(server) == 2, 10, "two requests waiting in the queue")
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(classifier_request(images[2], "1"), timeout=30)
            answers = [future.result(timeout=30) for future in queued]
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full (2 requests waiting)" in (refused.value.details() or "")
        session = ort.InferenceSession(str(copy_repo / "classifier" / "1" / "model.onnx"))
        for x, answer in zip(images, answers, strict=False):  # the two waiting: served, exact
            probs = np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(1, 10)
            np.testing.assert_allclose(probs, session.run(None, {"input": x})[0], rtol=1e-5)
        metrics = server_metrics(server)
        assert metric_value(metrics, "inference_rejections_total", reason="queue_full") == 1
        exhausted = metric_value(metrics, "inference_requests_total", code="RESOURCE_EXHAUSTED")
        assert exhausted == 1
        assert server.client().is_server_ready()  # and it keeps serving
    finally:
        server.stop()
