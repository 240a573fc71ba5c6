"""System shared memory in process: the registry with real files (a temporary directory
stands in for /dev/shm), and ``InferenceService.infer`` with a real
identity model reading its input from a region and writing its output into one. Hostile
references are refused with their code and a message naming the field, and the service
keeps serving after them with no region left held."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from model_server.core.errors import InferenceError
from model_server.core.memory import MemoryGuard, ProcessMemory
from model_server.core.runtime import DeviceChoice
from model_server.demo_models import build_identity_model, write_model
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.metrics import ServerMetrics
from model_server.protocol.service import InferenceService
from model_server.protocol.shared_memory import SharedMemoryRegistry, key_file
from model_server.protocol.shared_memory_tensors import (
    BYTE_SIZE,
    OFFSET,
    REGION,
    SystemSharedMemory,
)
from model_server.scheduling.gate import ServingGate
from model_server.security.access import Restriction
from tests.support import ROOT

HEADER, SECRET = "infermesh-operator-key", "op-secret-0123"
AUTH = ((HEADER, SECRET),)
X = np.arange(8, dtype=np.float32).reshape(2, 4)


def _object(directory: Path, key: str, size: int) -> Path:
    path = directory / key
    with path.open("wb") as f:
        f.truncate(size)
    return path


def _code(call: object, *args: object) -> str:
    with pytest.raises(InferenceError) as raised:
        call(*args)  # type: ignore[operator]
    return f"{raised.value.code.name}: {raised.value}"


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[SharedMemoryRegistry]:
    registry = SharedMemoryRegistry(tmp_path)
    yield registry
    registry.close()


@pytest.mark.parametrize("key", ["/in", "in", "/input_simple.0-1", "a" * 255])
def test_a_key_is_a_plain_name_with_an_optional_leading_slash(key: str) -> None:
    assert key_file(key) == key.lstrip("/")


@pytest.mark.parametrize(
    "key",
    ["", "/", "//in", "/../etc/passwd", "..", "/.", "a/b", "/dev/shm/in", "in\x00", "é",
     "a" * 256, "in put"],
)  # fmt: skip
def test_anything_else_is_refused_naming_the_key(key: str) -> None:
    message = _code(key_file, key)
    assert message.startswith("INVALID_ARGUMENT: key ") and "plain name" in message


def test_register_maps_a_range_and_status_lists_it(
    registry: SharedMemoryRegistry, tmp_path: Path
) -> None:
    _object(tmp_path, "obj", 4096)
    registry.register("a", "/obj", 0, 64)
    registry.register("b", "obj", 100, 32)  # an offset need not be page-aligned
    assert [(s.name, s.key, s.offset, s.byte_size) for s in registry.status("")] == [
        ("a", "/obj", 0, 64),
        ("b", "obj", 100, 32),
    ]
    assert registry.status("b")[0].offset == 100
    region = registry.get("b", "here")
    start, end = region.span(0, 32, "here")
    assert (start, end) == (100, 132)  # offsets into the mapping of the whole object
    region.write(start, b"\x07" * 32)
    with (tmp_path / "obj").open("rb") as f:  # the bytes landed in the object itself
        f.seek(100)
        assert f.read(33) == b"\x07" * 32 + b"\x00"


def test_what_cannot_be_registered_is_refused_naming_why(
    registry: SharedMemoryRegistry, tmp_path: Path
) -> None:
    _object(tmp_path, "obj", 64)
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "obj")
    registry.register("a", "/obj", 0, 64)
    cases = {
        ("a", "/obj", 0, 8): "ALREADY_EXISTS: shared memory region 'a' is already registered",
        ("b", "/absent", 0, 8): "INVALID_ARGUMENT: region 'b': key '/absent': no such",
        ("b", "/link", 0, 8): "INVALID_ARGUMENT: region 'b': key '/link': a symbolic link",
        ("b", "/dir", 0, 8): "INVALID_ARGUMENT: region 'b': key '/dir': ",
        ("b", "/obj", 60, 8): "INVALID_ARGUMENT: region 'b': key '/obj': offset 60 + byte_size 8",
        ("b", "/obj", 0, 0): "INVALID_ARGUMENT: region 'b': expected byte_size > 0",
        ("b", "/obj", -1, 8): "INVALID_ARGUMENT: region 'b': expected byte_size > 0",
        ("b", "/obj", 0, 2**64 - 1): "INVALID_ARGUMENT: region 'b': key '/obj': offset 0",
        ("", "/obj", 0, 8): "INVALID_ARGUMENT: name '': expected a region name",
        ("a\nb", "/obj", 0, 8): "INVALID_ARGUMENT: name 'a\\nb'",
        ("b", "/../obj", 0, 8): "INVALID_ARGUMENT: key '/../obj'",
    }
    for args, expected in cases.items():
        assert _code(registry.register, *args).startswith(expected), args
    assert [s.name for s in registry.status("")] == ["a"]  # nothing half-registered
    assert _code(registry.status, "b") == (
        "NOT_FOUND: no system shared memory region 'b' is registered"
    )
    registry.unregister("b")  # an unknown name is no error (Triton's)


def test_the_number_of_regions_is_bounded(tmp_path: Path) -> None:
    registry = SharedMemoryRegistry(tmp_path, max_regions=2)
    _object(tmp_path, "obj", 64)
    registry.register("a", "/obj", 0, 8)
    registry.register("b", "/obj", 8, 8)
    assert _code(registry.register, "c", "/obj", 16, 8).startswith("RESOURCE_EXHAUSTED: 2 ")
    registry.unregister("")
    registry.register("c", "/obj", 16, 8)
    registry.close()


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_region_in_use_is_closed_when_its_last_request_ends(
    registry: SharedMemoryRegistry, tmp_path: Path
) -> None:
    path = _object(tmp_path, "obj", 64)
    before = _open_descriptors()
    registry.register("a", "/obj", 0, 64)
    region = registry.get("a", "here")
    release = registry.hold([region])
    registry.unregister("a")
    assert registry.status("") == []
    start, _ = region.span(32, 4, "output 'y'")
    region.write(start, b"late")  # the output of a run that began before: still open
    assert path.read_bytes()[32:36] == b"late"
    assert _open_descriptors() == before + 1
    release()
    release()  # once only
    assert _open_descriptors() == before  # closed with its last user


def test_an_object_that_shrank_is_refused_not_read(
    registry: SharedMemoryRegistry, tmp_path: Path
) -> None:
    path = _object(tmp_path, "obj", 64)
    registry.register("a", "/obj", 0, 64)
    os.truncate(path, 16)
    region = registry.get("a", "input 'x'")
    assert _code(region.read, *region.span(0, 64, "input 'x'")).startswith(
        "FAILED_PRECONDITION: region 'a': key '/obj' ends at 16 bytes, shorter than when it "
        "was registered (the region needs 64)"
    )


def test_an_input_read_before_the_object_shrank_does_not_kill_the_server(
    tmp_path: Path,
) -> None:
    """The model reads its input a batch later than the request was checked: if the client
    truncated the object meanwhile, a load from a mapping of it would be SIGBUS. In a child
    process, since on the code before this test the signal kills whoever reads."""
    script = f"""
import os
import numpy as np
from pathlib import Path
from model_server.protocol.shared_memory import SharedMemoryRegistry
path = Path({str(tmp_path)!r}) / "in"
path.write_bytes(np.arange(2048, dtype=np.float32).tobytes())
registry = SharedMemoryRegistry(path.parent)
registry.register("i", "/in", 0, 8192)
region = registry.get("i", "input 'x'")
raw = region.read(*region.span(4096, 4096, "input 'x'"))
os.truncate(path, 0)  # the client shrinks it while the request waits for its batch
assert np.frombuffer(raw, np.float32).tolist() == list(range(1024, 2048))
registry.close()
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=60, check=False)
    assert done.returncode == 0, f"the reader died with {done.returncode} (-7: SIGBUS)"


def test_an_output_written_after_the_object_shrank_does_not_kill_the_server(
    tmp_path: Path,
) -> None:
    """The output is written after the model runs, a whole run after the check: if the client
    truncated the object meanwhile, a store into the mapping would be SIGBUS. In a child
    process, since on the code before this test the signal kills whoever writes."""
    script = f"""
import os, sys
from pathlib import Path
from model_server.protocol.shared_memory import SharedMemoryRegistry
path = Path({str(tmp_path)!r}) / "out"
path.write_bytes(bytes(8192))
registry = SharedMemoryRegistry(path.parent)
registry.register("o", "/out", 0, 8192)
region = registry.get("o", "output 'y'")
start, end = region.span(4096, 4096, "output 'y'")  # checked: fits
os.truncate(path, 0)  # the client shrinks it while the model runs
region.write(start, b"y" * 4096)
assert path.read_bytes()[4096:] == b"y" * 4096
registry.close()
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=60, check=False)
    assert done.returncode == 0, f"the writer died with {done.returncode} (-7: SIGBUS)"


# -- the request path, with a real model ----------------------------------------------------


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[InferenceService]:
    write_model(build_identity_model("FP32", [-1, 4]), tmp_path / "models/ident/1/model.onnx")
    repository = ModelRepository(
        tmp_path / "models",
        DeviceChoice("cpu"),
        MemoryGuard(ProcessMemory(8 << 30)),
        ServerMetrics(),
    )
    await repository.load("ident")
    shm = tmp_path / "shm"
    shm.mkdir()
    _object(shm, "in", 4096)
    _object(shm, "out", 4096)
    registry = SharedMemoryRegistry(shm)
    registry.register("in", "/in", 0, 64)
    registry.register("out", "/out", 0, 64)
    registry.get("in", "").write(0, X.tobytes())
    restriction = Restriction(frozenset({"shared-memory"}), HEADER, SECRET)
    service = InferenceService(
        repository,
        repository.metrics,
        ServingGate(ready=lambda: True),
        64 << 20,
        lambda n, loaded: None,
        shared_memory=SystemSharedMemory(restriction, registry),
    )
    yield service
    registry.close()
    await repository.unload("ident")


def _request(
    input_ref: dict[str, object] | None = None, output_ref: dict[str, object] | None = None
) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="ident")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 4])
    if input_ref is None:
        request.raw_input_contents.append(X.tobytes())
    for target, ref in ((tensor, input_ref), (request.outputs.add(name="y"), output_ref)):
        for name, value in (ref or {}).items():
            if isinstance(value, str):
                target.parameters[name].string_param = value
            elif isinstance(value, bool):
                target.parameters[name].bool_param = value
            else:
                assert isinstance(value, int)
                target.parameters[name].int64_param = value
    return request


IN = {REGION: "in", BYTE_SIZE: 32}
OUT = {REGION: "out", BYTE_SIZE: 64}


async def _refused(
    service: InferenceService, request: service_pb2.ModelInferRequest, metadata: object = AUTH
) -> str:
    with pytest.raises(InferenceError) as raised:
        await service.infer(request, metadata)  # type: ignore[arg-type]
    return f"{raised.value.code.name}: {raised.value}"


async def test_an_input_is_read_from_its_region_and_the_output_written_into_one(
    service: InferenceService,
) -> None:
    answer = await service.infer(_request(IN, {REGION: "out", BYTE_SIZE: 32, OFFSET: 16}), AUTH)
    output = answer.outputs[0]
    assert (output.name, list(output.shape), output.datatype) == ("y", [2, 4], "FP32")
    assert list(answer.raw_output_contents) == [b""]  # aligned, and empty
    assert output.parameters[REGION].string_param == "out"
    assert output.parameters[BYTE_SIZE].int64_param == 32
    region = service.shared_memory.registry.get("out", "")
    written = np.frombuffer(region.read(16, 48), dtype=np.float32).reshape(2, 4)
    assert np.array_equal(written, X)
    # The input in the message and the output in a region, or the other way round.
    mixed = await service.infer(_request(None, OUT), AUTH)
    assert list(mixed.raw_output_contents) == [b""]
    back = await service.infer(_request(IN, None), AUTH)
    assert np.array_equal(np.frombuffer(back.raw_output_contents[0], np.float32), X.ravel())


async def test_an_input_in_a_region_is_read_once_when_the_request_is_attached(
    service: InferenceService,
) -> None:
    """Read once, read-only: what the client writes afterwards does not reach the request, and
    a model cannot scribble on the client's object."""
    attached = service.shared_memory.attach(_request(IN, None), AUTH)
    try:
        raw = attached.request.raw_input_contents[0]
        assert isinstance(raw, memoryview) and raw.readonly and raw.nbytes == 32
        region = service.shared_memory.registry.get("in", "")
        region.write(0, np.full(8, 5.0, np.float32).tobytes())  # the client writes again
        assert np.frombuffer(raw, np.float32).tolist() == X.ravel().tolist()
    finally:
        attached.release()
        region.write(0, X.tobytes())


HOSTILE: dict[str, tuple[dict[str, object] | None, dict[str, object] | None, str]] = {
    "unknown input region": (
        {REGION: "nope", BYTE_SIZE: 32},
        None,
        "NOT_FOUND: model 'ident' input 'x': parameters['shared_memory_region'] names 'nope'",
    ),
    "unknown output region": (
        None,
        {REGION: "nope", BYTE_SIZE: 32},
        "NOT_FOUND: model 'ident' output 'y': parameters['shared_memory_region'] names 'nope'",
    ),
    "beyond the region": (
        {**IN, OFFSET: 40},
        None,
        "INVALID_ARGUMENT: model 'ident' input 'x': shared_memory_offset 40 + "
        "shared_memory_byte_size 32 = 72 is beyond region 'in' (64 bytes)",
    ),
    "size not the tensor's": (
        {REGION: "in", BYTE_SIZE: 16},
        None,
        "INVALID_ARGUMENT: model 'ident' input 'x': parameters['shared_memory_byte_size'] is "
        "16, expected 32 (shape [2, 4] x 4 bytes of FP32)",
    ),
    "negative size": (
        {REGION: "in", BYTE_SIZE: -32},
        None,
        "INVALID_ARGUMENT: model 'ident' input 'x': parameters['shared_memory_byte_size']: "
        "expected an int64 or uint64 >= 0, got int64_param -32",
    ),
    "negative offset": (
        {**IN, OFFSET: -8},
        None,
        "expected an int64 or uint64 >= 0, got int64_param -8",
    ),
    "size as text": ({REGION: "in", BYTE_SIZE: "32"}, None, "got string_param '32'"),
    "size as bool": ({REGION: "in", BYTE_SIZE: True}, None, "got bool_param True"),
    "no size": ({REGION: "in"}, None, "parameters['shared_memory_byte_size'] is required"),
    "size without a region": (None, {BYTE_SIZE: 8}, "given without 'shared_memory_region'"),
    "region as a number": ({REGION: 3, BYTE_SIZE: 32}, None, "expected a region name"),
    "output too small": (
        IN,
        {REGION: "out", BYTE_SIZE: 16},
        "INVALID_ARGUMENT: output 'y': 32 bytes (shape [2, 4]) do not fit its "
        "shared_memory_byte_size of 16 in region 'out'",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
async def test_hostile_references_are_refused_naming_the_field(
    service: InferenceService, case: str
) -> None:
    input_ref, output_ref, expected = HOSTILE[case]
    message = await _refused(service, _request(input_ref, output_ref))
    assert expected in message, message
    assert message.split(":")[0] in ("INVALID_ARGUMENT", "NOT_FOUND")
    # ... and the service goes on serving, with nothing held.
    answer = await service.infer(_request(IN, OUT), AUTH)
    assert list(answer.raw_output_contents) == [b""]
    assert service.gate.in_flight == 0
    registry = service.shared_memory.registry
    assert [registry.get(n, "").users for n in ("in", "out")] == [0, 0]


async def test_more_raw_contents_than_inputs_outside_regions_are_refused(
    service: InferenceService,
) -> None:
    request = _request(IN, None)
    request.raw_input_contents.append(X.tobytes())
    assert "raw_input_contents has 1 entries for 0 inputs outside shared memory" in (
        await _refused(service, request)
    )


async def test_a_request_naming_a_region_needs_the_credential(
    service: InferenceService,
) -> None:
    for metadata in ((), ((HEADER, "wrong"),), (("other", SECRET),)):
        message = await _refused(service, _request(IN, None), metadata)
        assert message.startswith("PERMISSION_DENIED: a request that names a shared memory")
        assert SECRET not in message
    plain = await service.infer(_request(None, None), ())  # tensors in the message need none
    assert np.array_equal(np.frombuffer(plain.raw_output_contents[0], np.float32), X.ravel())


async def test_without_a_restriction_shared_memory_is_off(service: InferenceService) -> None:
    service.shared_memory = SystemSharedMemory(None, service.shared_memory.registry)
    message = await _refused(service, _request(IN, None))
    assert message.startswith("PERMISSION_DENIED: system shared memory is off on this server")
    assert "system_shared_memory" not in service.extensions
