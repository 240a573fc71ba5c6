"""A generative model in the real server: text in, tokens out, streamed the way tritonclient
expects; the answers equal the numpy reference's greedy decoding."""

from __future__ import annotations

import contextlib
import queue
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from model_server.demo_lm import build_demo_lm
from model_server.generative.lm_reference import BOS_ID, init_weights
from model_server.generative.lm_reference import generate_greedy as reference_greedy
from tests.envoy_support import free_port
from tests.mesh_support import start_plane_and_envoy, write_topology
from tests.support import MODEL, ServerProcess, metric_value, start_server, text_request

pytestmark = pytest.mark.integration
PROMPT = "The mesh "


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("lm-repo")
    build_demo_lm(repo)
    server = start_server(repo, tmp_path_factory.mktemp("lm-logs"), "--models", MODEL)
    yield server
    server.stop()


def expected(prompt: str, max_tokens: int) -> bytes:
    ids = reference_greedy(init_weights(), [BOS_ID, *prompt.encode()], max_tokens)
    return bytes(i for i in ids if i < 256)


def test_unary_returns_the_whole_completion(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(text_request(PROMPT, max_tokens=12), timeout=30)
    text = bytes(response.raw_output_contents[0][4:])
    assert text == expected(PROMPT, 12)
    assert response.parameters["triton_final_response"].bool_param
    assert response.parameters["finish_reason"].string_param in ("length", "eos")


def test_streaming_with_tritonclient_yields_tokens_then_a_final_flag(
    server: ServerProcess,
) -> None:
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.url)
    client.start_stream(callback=lambda result, error: results.put(error or result))
    prompt = grpcclient.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    client.async_stream_infer(MODEL, [prompt], parameters={"max_tokens": 10})
    pieces: list[bytes] = []
    finals: list[bool] = []
    while not finals or not finals[-1]:
        result = results.get(timeout=30)
        assert not isinstance(result, Exception), result
        response = result.get_response()
        pieces.append(result.as_numpy("text_output")[0])
        finals.append(response.parameters["triton_final_response"].bool_param)
    client.stop_stream()
    assert b"".join(pieces) == expected(PROMPT, 10)
    assert finals.count(True) == 1 and len(pieces) <= 10
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        metrics = r.read().decode()
    assert metric_value(metrics, "kv_cache_blocks_total", model=MODEL) == 512  # the budget
    assert metric_value(metrics, "kv_cache_blocks_used", model=MODEL) == 0  # all given back
    assert metric_value(metrics, "generation_tokens_total", model=MODEL) >= len(pieces)
    assert metric_value(metrics, "generation_time_to_first_token_seconds_count", model=MODEL) >= 1
    assert metric_value(metrics, "generation_sequences", model=MODEL, state="running") == 0
    # A lone sequence's first decode step gathers its past; the ones after reuse the step
    # before's outputs
    steps = {p: metric_value(metrics, "generation_decode_steps_total", model=MODEL, past=p)
             for p in ("gathered", "carried")}  # fmt: skip
    assert steps["gathered"] >= 1 and steps["carried"] >= len(pieces) - 2, steps


def test_metadata_shows_text_in_and_text_out(server: ServerProcess) -> None:
    client = grpcclient.InferenceServerClient(server.url)
    metadata = client.get_model_metadata(MODEL)
    assert [(t.name, t.datatype) for t in metadata.inputs] == [("text_input", "BYTES")]
    assert [(t.name, t.datatype) for t in metadata.outputs] == [("text_output", "BYTES")]
    config = client.get_model_config(MODEL).config
    assert config.model_transaction_policy.decoupled


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (service_pb2.ModelInferRequest(model_name=MODEL), "expected one input 'text_input'"),
        (text_request(PROMPT, max_tokens=0), "max_tokens must be >= 1"),
        (text_request(PROMPT, max_tokens=600), "exceeds the model's 512 positions"),
        (text_request(PROMPT, temperature="hot"), "parameters['temperature']: expected"),
        (text_request(PROMPT, top_p=0.5), "top_p narrows the tokens sampled from"),
        (text_request(PROMPT, top_k=3, temperature=0.0), "top_k narrows"),
    ],
)
def test_bad_generation_requests_are_named(
    server: ServerProcess, request_: service_pb2.ModelInferRequest, words: str
) -> None:
    with grpc.insecure_channel(server.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.ModelInfer(request_, timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (raised.value.details() or "")


def test_tokens_stream_through_envoy_one_by_one(
    server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = tmp_path_factory.mktemp("lm-mesh")
    listener = free_port()
    # A short timeout: a unary call would be cut after it, the stream only if it goes quiet.
    lm = {"name": MODEL, "sla_p99_ms": 2000, "capacity_qps": 50, "generative": True,
          "timeout_s": 0.25}  # fmt: skip
    topology = write_topology(
        workdir / "t.yaml", listener, [server.url], more_models=[lm], timeout_s=1
    )
    with contextlib.ExitStack() as stops:
        start_plane_and_envoy(stops, workdir, topology, listener, healthy=2)
        results: queue.Queue[Any] = queue.Queue()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{listener}")
        client.start_stream(
            callback=lambda result, error: results.put(error or result),
            headers={"x-model-name": MODEL},
        )
        prompt = grpcclient.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
        started = time.monotonic()
        client.async_stream_infer(MODEL, [prompt], parameters={"max_tokens": 400})
        pieces: list[bytes] = []
        final = False
        while not final:
            result = results.get(timeout=30)
            assert not isinstance(result, Exception), result
            pieces.append(result.as_numpy("text_output")[0])
            final = result.get_response().parameters["triton_final_response"].bool_param
        elapsed = time.monotonic() - started
        client.stop_stream()
    assert len(pieces) > 1  # one response per token, not one at the end
    assert b"".join(pieces) == expected(PROMPT, 400)
    print(f"{len(pieces)} tokens through Envoy in {elapsed:.2f} s")


def kv_blocks_used(server: ServerProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        return metric_value(r.read().decode(), "kv_cache_blocks_used", model=MODEL)


def test_a_thousand_sequences_ended_cancelled_or_dropped_leave_no_block_behind(
    server: ServerProcess,
) -> None:
    """Normal ends, cancellations after the first token, and closed connections mid-stream."""
    with grpc.insecure_channel(server.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for i in range(1000):
            request = text_request(f"{i} ", max_tokens=3 if i % 3 == 0 else 40)
            call = stub.ModelStreamInfer(iter([request]), timeout=30)
            if i % 3 == 0:
                assert sum(1 for _ in call) >= 1  # to its end
            else:
                next(call)  # the first token ...
                call.cancel()  # ... then the client goes away
        # A connection closed in the middle of a stream.
        lost = grpc.insecure_channel(server.url)
        stream = service_pb2_grpc.GRPCInferenceServiceStub(lost).ModelStreamInfer(
            iter([text_request("bye ", max_tokens=400)]), timeout=30
        )
        next(stream)
        assert kv_blocks_used(server) > 0  # it holds blocks while it runs ...
        lost.close()
    deadline = time.monotonic() + 10  # ... and gives them back once the server sees it gone
    while kv_blocks_used(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_blocks_used(server) == 0
    with grpc.insecure_channel(server.url) as channel:  # and it still answers correctly
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(text_request(PROMPT, max_tokens=12), timeout=30)
    assert bytes(response.raw_output_contents[0][4:]) == expected(PROMPT, 12)


def test_a_users_decoder_export_without_a_config_loads_the_same_way(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Only a model.onnx with Optimum's names, as `optimum-cli export onnx` leaves it."""
    built = tmp_path_factory.mktemp("built")
    build_demo_lm(built)
    repo = tmp_path_factory.mktemp("user-repo")
    (repo / "user_lm" / "1").mkdir(parents=True)
    (repo / "user_lm" / "1" / "model.onnx").write_bytes(
        (built / MODEL / "1" / "model.onnx").read_bytes()
    )
    server = start_server(repo, tmp_path_factory.mktemp("user-logs"), "--models", "user_lm")
    try:
        with grpc.insecure_channel(server.url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            request = text_request(PROMPT, max_tokens=8)
            request.model_name = "user_lm"
            response = stub.ModelInfer(request, timeout=30)
        assert bytes(response.raw_output_contents[0][4:]) == expected(PROMPT, 8)
    finally:
        server.stop()
