"""The inference service in process (no server, no transport): ``InferenceService.infer`` with
a real repository and real ONNX Runtime sessions, as the gRPC and REST servicers call it. The
version a request gets, the codes and messages of what is refused, the gate's count of what
is in flight, the fallback a request is routed to, and the statistics that count it all."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from infermesh.wire import FALLBACK_HEADER
from model_server.core.errors import InferenceError, InvalidInput
from model_server.core.validation import OFFLOAD_DECODE_BYTES, slow_to_decode
from model_server.demo_models import build_identity_model, write_model
from model_server.generative.text import FINAL_PARAMETER, parse_generation
from model_server.lifecycle.repository import ModelRepository
from model_server.protocol.service import FALLBACK_PARAMETER, InferenceService
from model_server.scheduling import schedulers
from model_server.scheduling.gate import ServingGate
from tests.support import classifier_request

IMAGES = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)


@pytest.fixture
async def service(repository: ModelRepository) -> InferenceService:
    await repository.load("classifier")
    gate = ServingGate(ready=lambda: True)
    return InferenceService(repository, repository.metrics, gate, 64 << 20, lambda n, loaded: None)


async def _refused(
    service: InferenceService,
    request: service_pb2.ModelInferRequest,
    metadata: tuple[tuple[str, str], ...] = (),
    time_remaining_s: float | None = None,
) -> str:
    with pytest.raises(InferenceError) as raised:
        await service.infer(request, metadata, time_remaining_s)
    return f"{raised.value.code.name}: {raised.value}"


async def test_a_request_gets_the_newest_version_or_the_one_it_names(
    service: InferenceService,
) -> None:
    answer = await service.infer(classifier_request(IMAGES, request_id="r-1"), ())
    assert (answer.model_name, answer.model_version, answer.id) == ("classifier", "2", "r-1")
    probs = np.frombuffer(answer.raw_output_contents[0], dtype=np.float32).reshape(2, 10)
    assert np.allclose(probs.sum(axis=1), 1.0, atol=1e-4)  # a softmax per image
    pinned = await service.infer(classifier_request(IMAGES, version="1"), ())
    assert pinned.model_version == "1"
    assert service.gate.in_flight == 0  # every call left the gate


async def test_what_is_refused_names_the_field_and_gets_its_code(
    service: InferenceService,
) -> None:
    wrong = classifier_request(IMAGES)
    wrong.inputs[0].shape[:] = [2, 3, 16, 16]  # the bytes no longer match the shape
    assert (await _refused(service, wrong)).startswith("INVALID_ARGUMENT: ")
    assert "input" in await _refused(service, wrong)
    missing = classifier_request(IMAGES)
    missing.model_name = "detector"
    assert (await _refused(service, missing)).startswith("NOT_FOUND: ")
    assert "'detector'" in await _refused(service, missing)
    absent = classifier_request(IMAGES, version="7")
    assert "has no version 7" in await _refused(service, absent)
    assert service.gate.in_flight == 0


async def test_a_draining_gate_refuses_new_requests(service: InferenceService) -> None:
    service.gate.refusing = True
    message = await _refused(service, classifier_request(IMAGES))
    assert message == "UNAVAILABLE: server is draining and takes no new requests"
    service.gate.refusing = False
    assert (await service.infer(classifier_request(IMAGES), ())).model_version == "2"


async def test_a_request_routed_to_a_fallback_is_answered_by_it(
    service: InferenceService,
) -> None:
    """Envoy's fallback cluster keeps the model name the client asked for and says which
    model it fell back to: the server answers with that model's newest version."""
    request = classifier_request(IMAGES)
    request.model_name = "detector"  # not loaded here
    answer = await service.infer(request, ((FALLBACK_HEADER, "classifier"),))
    assert (answer.model_name, answer.model_version) == ("classifier", "2")
    # Without the header the same request is refused, naming the model.
    assert (await _refused(service, request)).startswith("NOT_FOUND: ")


async def test_statistics_count_what_was_answered(service: InferenceService) -> None:
    for _ in range(3):
        await service.infer(classifier_request(IMAGES), ())
    stats = service.model_statistics("classifier", "2").model_stats
    (v2,) = [s for s in stats if s.version == "2"]
    assert v2.inference_stats.success.count == 3
    assert v2.inference_count == 6  # 3 requests of 2 images
    assert service.model_ready("classifier", "2") and not service.model_ready("detector", "")


def _prompt(text: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="demo_lm")
    tensor = request.inputs.add(name="text_input", datatype="BYTES")
    tensor.shape.append(1)
    request.raw_input_contents.append(len(text).to_bytes(4, "little") + text.encode())
    request.parameters["max_tokens"].int64_param = 4
    return request


async def test_generation_goes_through_the_gate_and_the_injected_faults(
    lm_service: InferenceService,
) -> None:
    """A completion is admitted by the same gate as unary inference and meets the same
    fault drills (an injected error is answered UNAVAILABLE and counted)."""
    answer = await lm_service.infer(_prompt("hello"), ())
    assert answer.model_name == "demo_lm" and answer.raw_output_contents
    lm_service.faults.apply({"error_rate": 1.0})
    assert await _refused(lm_service, _prompt("hello")) == "UNAVAILABLE: injected fault"
    lm_service.faults.apply({"reset": True})
    lm_service.gate.refusing = True
    assert "draining" in await _refused(lm_service, _prompt("hello"))
    assert lm_service.gate.in_flight == 0
    (v1,) = [s for s in lm_service.model_statistics("demo_lm", "1").model_stats]
    assert v1.inference_stats.success.count == 1 and v1.inference_stats.fail.count >= 1


async def test_a_completion_routed_to_a_fallback_is_generated_by_it(
    lm_service: InferenceService,
) -> None:
    """The version is resolved once, on the one request path: a completion for a model this
    server lacks is generated by the route's fallback model, which the answer names."""
    request = _prompt("hello")
    request.model_name = "demo_lm_large"  # not in this repository
    answer = await lm_service.infer(request, ((FALLBACK_HEADER, "demo_lm"),))
    assert (answer.model_name, answer.model_version) == ("demo_lm", "1")
    assert answer.parameters[FALLBACK_PARAMETER].string_param == "demo_lm_large"
    assert answer.raw_output_contents and answer.parameters[FINAL_PARAMETER].bool_param
    assert (await _refused(lm_service, request)).startswith("NOT_FOUND: ")


async def test_a_completion_past_its_deadline_ends_and_frees_its_sequence(
    lm_service: InferenceService,
) -> None:
    """The deadline (the ``timeout`` parameter, in microseconds, or the gRPC deadline) holds
    for generation as for batched inference: DEADLINE_EXCEEDED, counted as a failure, and the
    sequence leaves the engine with its KV blocks."""
    request = _prompt("hello")
    request.parameters["max_tokens"].int64_param = 64
    request.parameters["timeout"].int64_param = 1  # 1 us: gone before the first token
    message = await _refused(lm_service, request)
    assert message.startswith("DEADLINE_EXCEEDED: ") and "deadline" in message
    assert "DEADLINE_EXCEEDED" in await _refused(lm_service, _prompt("hi"), time_remaining_s=0)
    engine = lm_service.repository.resolve("demo_lm", "").engine
    assert engine is not None
    deadline = time.monotonic() + 10
    while (
        engine.running
        or engine.waiting
        or engine.cache.free_blocks < engine.cache.shape.total_blocks
    ):
        assert time.monotonic() < deadline, "the engine kept the expired sequences"
        await asyncio.sleep(0.01)
    (v1,) = [s for s in lm_service.model_statistics("demo_lm", "1").model_stats]
    assert v1.inference_stats.fail.count == 2 and lm_service.gate.in_flight == 0
    assert (await lm_service.infer(_prompt("hello"), ())).raw_output_contents  # still serving


# -- hostile tensors and parameters: refused by name, never an INTERNAL ----------------------


async def _identity_service(
    repository: ModelRepository, name: str, datatype: str
) -> InferenceService:
    """The service over an identity model ``name`` of ``datatype`` [-1, -1]: the client says
    every dim (the first is the batch)."""
    write_model(build_identity_model(datatype, [-1, -1]), repository.root / f"{name}/1/model.onnx")
    await repository.load(name)
    gate = ServingGate(ready=lambda: True)
    return InferenceService(repository, repository.metrics, gate, 64 << 20, lambda n, loaded: None)


@pytest.fixture
async def dynamic(repository: ModelRepository) -> InferenceService:
    return await _identity_service(repository, "ident", "FP32")


def _ident(shape: list[int], data: bytes = b"") -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="ident")
    request.inputs.add(name="x", datatype="FP32", shape=shape)
    request.raw_input_contents.append(data)
    return request


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ([-1, -1], "INVALID_ARGUMENT: model 'ident' input 'x': shape [-1, -1] has a negative dim"),
        ([0, 2**62], "INVALID_ARGUMENT: model 'ident' input 'x': shape [0, 4611686018427387904] "
                     "has 4611686018427387904 at axis 1, more than any tensor this server takes"),
    ],
)  # fmt: skip
async def test_client_dims_that_numpy_cannot_shape_are_refused_by_name(
    dynamic: InferenceService, shape: list[int], expected: str
) -> None:
    """Before: a sent -1 equalled the declared -1 and skipped the checks, and numpy's reshape
    raised ValueError (INTERNAL, a stack trace per request); so did a huge dim of an empty
    tensor."""
    assert (await _refused(dynamic, _ident(shape))).startswith(expected)
    answer = await dynamic.infer(_ident([1, 2], np.ones(2, np.float32).tobytes()), ())
    assert list(answer.outputs[0].shape) == [1, 2]  # and the server serves on


async def test_a_priority_of_unicode_digits_is_refused_by_name(
    service: InferenceService,
) -> None:
    message = await _refused(service, classifier_request(IMAGES), (("x-priority", "\u00b2"),))
    assert message.startswith("INVALID_ARGUMENT: header x-priority: expected a number >= 0")


@pytest.mark.parametrize(
    ("stops", "expected"),
    [
        ('["\\ud800"]', "a string holds a lone UTF-16 surrogate"),
        ("[" * 100_000 + "]" * 100_000, "expected a JSON array of strings"),
    ],
    ids=["lone surrogate", "nested 100,000 deep"],
)
def test_stop_sequences_that_do_not_encode_are_refused_by_name(stops: str, expected: str) -> None:
    request = _prompt("Once ")
    request.parameters["stop_sequences"].string_param = stops
    with pytest.raises(InvalidInput) as refused:
        parse_generation(request, bos=1, max_positions=512)
    assert refused.value.message.startswith("parameters['stop_sequences']: ")
    assert expected in refused.value.message


@pytest.mark.parametrize("name", ["../classifier", "/etc", "a/b", ".", "..", "", "a\\b"])
async def test_a_model_name_is_one_directory_of_the_repository(
    repository: ModelRepository, name: str
) -> None:
    """``root / "/srv/x"`` is ``/srv/x``: a load naming a path served any model directory the
    server could read, outside its repository."""
    with pytest.raises(InvalidInput, match="expected the name of a directory in the repository"):
        await repository.load(name)


@pytest.fixture
async def strings(repository: ModelRepository) -> InferenceService:
    return await _identity_service(repository, "strings", "BYTES")


def _strings(count: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="strings")
    request.inputs.add(name="x", datatype="BYTES", shape=[1, count])
    request.raw_input_contents.append(b"\0\0\0\0" * count)  # ``count`` empty strings
    return request


async def test_a_large_bytes_request_is_decoded_off_the_event_loop(
    strings: InferenceService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding BYTES is Python work per string: 64 MiB of empty strings held the event loop
    (every other request, stream and health check) for seconds. Past OFFLOAD_DECODE_BYTES
    the decoding runs on a worker thread; a small request stays on the loop (no hop)."""
    where: list[bool] = []
    decode = schedulers.decode_request

    def watched(*args: Any) -> Any:
        where.append(threading.current_thread() is threading.main_thread())
        return decode(*args)

    monkeypatch.setattr(schedulers, "decode_request", watched)
    big = OFFLOAD_DECODE_BYTES // 4 + 1
    assert slow_to_decode(_strings(big)) and not slow_to_decode(_strings(16))
    answer = await strings.infer(_strings(big), ())
    assert list(answer.outputs[0].shape) == [1, big]
    await strings.infer(_strings(16), ())
    assert where == [False, True]  # the big one on a worker thread, the small one on the loop
    assert not slow_to_decode(classifier_request(IMAGES))  # numbers decode in place
