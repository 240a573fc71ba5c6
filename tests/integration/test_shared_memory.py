"""System shared memory on a real model server with stock tritonclient, step for step as
Triton's simple_grpc_shm_client.py: create the regions under /dev/shm, register them, put
both inputs in one region (the second at an offset), ask for both outputs in another, infer,
read the outputs from the region, unregister. The server opens and closes the objects for real
(its /proc/PID/fd shows it), refuses callers without the shared-memory credential and hostile
references, and keeps serving."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient import utils
from tritonclient.utils import InferenceServerException

from model_server.demo_models import build_add_sub_model, write_model
from tests.support import ServerProcess, start_server, wait_for

pytestmark = pytest.mark.integration
HEADER = "infermesh-operator-key"
SECRET = "shm-operator-credential-0123456789"
AUTH = {HEADER: SECRET}
INPUT0 = np.arange(16, dtype=np.int32).reshape(1, 16)
INPUT1 = np.ones((1, 16), dtype=np.int32)
SIZE = INPUT0.nbytes  # 64 bytes per tensor


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    write_model(build_add_sub_model("INT32", 16), repo / "simple" / "1" / "model.onnx")
    return repo


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    key = tmp_path_factory.mktemp("secrets") / "operator.key"
    key.write_text(SECRET + "\n")
    server = start_server(
        repo, tmp_path_factory.mktemp("logs"), "--restricted-api", f"shared-memory:{HEADER}=@{key}"
    )
    yield server
    server.stop()


@pytest.fixture
def keys() -> Iterator[tuple[str, str]]:
    """Unique shm keys for this test (removed after it, whatever happened)."""
    tag = uuid.uuid4().hex[:12]
    pair = (f"/infermesh_test_in_{tag}", f"/infermesh_test_out_{tag}")
    yield pair
    for key in pair:
        if os.path.exists(f"/dev/shm{key}"):
            os.unlink(f"/dev/shm{key}")


def _held(server: ServerProcess, key: str) -> bool:
    """Whether the server holds the object open (a descriptor on it)."""
    target = f"/dev/shm{key}"
    descriptors = Path(f"/proc/{server.proc.pid}/fd")
    return any(os.readlink(fd) == target for fd in descriptors.iterdir() if fd.is_symlink())


def _status(error: Any) -> str:
    assert isinstance(error, InferenceServerException)
    return f"{error.status()} {error.message()}"


def _refused(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(InferenceServerException) as raised:
        call(*args, **kwargs)
    return _status(raised.value)


def test_triton_shm_example_with_stock_tritonclient(
    server: ServerProcess, keys: tuple[str, str]
) -> None:
    in_key, out_key = keys
    client = grpcclient.InferenceServerClient(server.url)
    client.unregister_system_shared_memory(headers=AUTH)  # as the example starts

    shm_op_handle = shm.create_shared_memory_region("output_data", out_key, SIZE * 2)
    client.register_system_shared_memory("output_data", out_key, SIZE * 2, headers=AUTH)
    shm_ip_handle = shm.create_shared_memory_region("input_data", in_key, SIZE * 2)
    shm.set_shared_memory_region(shm_ip_handle, [INPUT0])
    shm.set_shared_memory_region(shm_ip_handle, [INPUT1], offset=SIZE)
    client.register_system_shared_memory("input_data", in_key, SIZE * 2, headers=AUTH)
    try:
        assert _held(server, in_key) and _held(server, out_key)
        status = client.get_system_shared_memory_status(headers=AUTH)
        assert {(r.name, r.key, r.offset, r.byte_size) for r in status.regions.values()} == {
            ("input_data", in_key, 0, SIZE * 2),
            ("output_data", out_key, 0, SIZE * 2),
        }

        inputs = [
            grpcclient.InferInput("INPUT0", [1, 16], "INT32"),
            grpcclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        inputs[0].set_shared_memory("input_data", SIZE)
        inputs[1].set_shared_memory("input_data", SIZE, offset=SIZE)
        outputs = [
            grpcclient.InferRequestedOutput("OUTPUT0"),
            grpcclient.InferRequestedOutput("OUTPUT1"),
        ]
        outputs[0].set_shared_memory("output_data", SIZE)
        outputs[1].set_shared_memory("output_data", SIZE, offset=SIZE)
        results = client.infer("simple", inputs, outputs=outputs, headers=AUTH)

        answer = results.get_response()
        assert list(answer.raw_output_contents) == [b"", b""]  # nothing in the message
        output0 = results.get_output("OUTPUT0")
        output0_data = shm.get_contents_as_numpy(
            shm_op_handle, utils.triton_to_np_dtype(output0.datatype), output0.shape
        )
        output1 = results.get_output("OUTPUT1")
        output1_data = shm.get_contents_as_numpy(
            shm_op_handle, utils.triton_to_np_dtype(output1.datatype), output1.shape, offset=SIZE
        )
        assert np.array_equal(output0_data, INPUT0 + INPUT1)
        assert np.array_equal(output1_data, INPUT0 - INPUT1)

        client.unregister_system_shared_memory("input_data", headers=AUTH)
        assert list(client.get_system_shared_memory_status(headers=AUTH).regions) == ["output_data"]
        wait_for(lambda: not _held(server, in_key), 10, "input region closed")
        client.unregister_system_shared_memory(headers=AUTH)  # every region
        assert len(client.get_system_shared_memory_status(headers=AUTH).regions) == 0
        wait_for(lambda: not _held(server, out_key), 10, "output region closed")
    finally:
        shm.destroy_shared_memory_region(shm_ip_handle)
        shm.destroy_shared_memory_region(shm_op_handle)


def test_callers_without_the_credential_are_refused(
    server: ServerProcess, keys: tuple[str, str]
) -> None:
    in_key, _ = keys
    client = grpcclient.InferenceServerClient(server.url)
    handle = shm.create_shared_memory_region("guarded", in_key, SIZE * 2)
    try:
        for headers in (None, {HEADER: "wrong"}):
            for call, args in (
                (client.register_system_shared_memory, ("guarded", in_key, SIZE * 2)),
                (client.get_system_shared_memory_status, ()),
                (client.unregister_system_shared_memory, ()),
            ):
                message = _refused(call, *args, headers=headers)
                assert message.startswith("StatusCode.PERMISSION_DENIED the shared-memory API")
                assert SECRET not in message
        client.register_system_shared_memory("guarded", in_key, SIZE * 2, headers=AUTH)
        # Inference is open on this server, but not with a region.
        x = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
        x.set_shared_memory("guarded", SIZE)
        y = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
        y.set_data_from_numpy(INPUT1)
        message = _refused(client.infer, "simple", [x, y])
        assert message.startswith("StatusCode.PERMISSION_DENIED a request that names a shared")
        client.unregister_system_shared_memory("guarded", headers=AUTH)
    finally:
        shm.destroy_shared_memory_region(handle)


def test_hostile_calls_are_refused_by_name_and_the_server_keeps_serving(
    server: ServerProcess, keys: tuple[str, str], tmp_path: Path
) -> None:
    in_key, _ = keys
    client = grpcclient.InferenceServerClient(server.url)
    handle = shm.create_shared_memory_region("in", in_key, SIZE * 2)
    shm.set_shared_memory_region(handle, [INPUT0, INPUT1])
    secret_file = tmp_path / "not-shm.txt"
    secret_file.write_text("private")
    try:
        client.register_system_shared_memory("in", in_key, SIZE * 2, headers=AUTH)
        register = client.register_system_shared_memory
        refusals = {
            "StatusCode.ALREADY_EXISTS shared memory region 'in' is already registered": (
                register, ("in", in_key, SIZE)),
            "StatusCode.INVALID_ARGUMENT region 'x': key '/infermesh_absent_": (
                register, ("x", f"/infermesh_absent_{uuid.uuid4().hex}", 8)),
            "StatusCode.INVALID_ARGUMENT key '/../../": (
                register, ("x", f"/../..{secret_file}", 8)),
            "StatusCode.INVALID_ARGUMENT key '/a/b'": (register, ("x", "/a/b", 8)),
            f"StatusCode.INVALID_ARGUMENT region 'x': key '{in_key}': offset 64 + byte_size 128": (
                register, ("x", in_key, SIZE * 2, SIZE)),
            "StatusCode.INVALID_ARGUMENT region 'x': expected byte_size > 0": (
                register, ("x", in_key, 0)),
            "StatusCode.NOT_FOUND no system shared memory region 'nope'": (
                client.get_system_shared_memory_status, ("nope",)),
            "StatusCode.UNIMPLEMENTED CUDA shared memory needs a GPU build; this server runs on "
            "cpu": (client.get_cuda_shared_memory_status, ()),
        }  # fmt: skip
        for expected, (call, args) in refusals.items():
            assert _refused(call, *args, headers=AUTH).startswith(expected)

        def infer(size: int, offset: int, region: str = "in") -> Any:
            x = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
            x.set_shared_memory(region, size, offset=offset)
            y = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
            y.set_shared_memory(region, SIZE, offset=SIZE)
            return client.infer("simple", [x, y], headers=AUTH)

        for args, expected in (
            ((SIZE, 0, "nope"), "StatusCode.NOT_FOUND model 'simple' input 'INPUT0': "),
            ((SIZE, SIZE * 2), "StatusCode.INVALID_ARGUMENT model 'simple' input 'INPUT0': "
             "shared_memory_offset 128 + shared_memory_byte_size 64 = 192 is beyond region"),
            ((SIZE - 4, 0), "StatusCode.INVALID_ARGUMENT model 'simple' input 'INPUT0': "
             "parameters['shared_memory_byte_size'] is 60, expected 64"),
            ((-SIZE, 0), "StatusCode.INVALID_ARGUMENT model 'simple' input 'INPUT0': "
             "parameters['shared_memory_byte_size']: expected an int64 or uint64 >= 0"),
        ):  # fmt: skip
            assert _refused(infer, *args).startswith(expected)

        body = {
            "inputs": [
                {"name": n, "shape": [1, 16], "datatype": "INT32", "data": [0] * 16}
                for n in ("INPUT0", "INPUT1")
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"shared_memory_region": "in",
                                                          "shared_memory_byte_size": SIZE}}],
        }  # fmt: skip
        url = f"http://127.0.0.1:{server.http_port}/v2/models/simple/infer"
        request = urllib.request.Request(url, json.dumps(body).encode(), AUTH, method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400
        assert "served over gRPC only" in refused.value.read().decode()

        answer = infer(SIZE, 0)  # still serving, the region intact
        assert np.array_equal(answer.as_numpy("OUTPUT0"), INPUT0 + INPUT1)
        assert server.proc.poll() is None
    finally:
        client.unregister_system_shared_memory(headers=AUTH)
        shm.destroy_shared_memory_region(handle)


def test_without_the_restriction_shared_memory_is_off_and_regions_go_at_shutdown(
    repo: Path, tmp_path: Path, keys: tuple[str, str]
) -> None:
    in_key, _ = keys
    handle = shm.create_shared_memory_region("in", in_key, SIZE)
    try:
        open_server = start_server(repo, tmp_path / "open")
        try:
            client = grpcclient.InferenceServerClient(open_server.url)
            message = _refused(client.register_system_shared_memory, "in", in_key, SIZE)
            assert message.startswith(
                "StatusCode.PERMISSION_DENIED system shared memory is off on this server"
            )
            assert "system_shared_memory" not in client.get_server_metadata().extensions
        finally:
            open_server.stop()

        key_file = tmp_path / "key"
        key_file.write_text(SECRET)
        server = start_server(
            repo, tmp_path / "on", "--restricted-api", f"shared-memory:{HEADER}=@{key_file}"
        )
        try:
            client = grpcclient.InferenceServerClient(server.url)
            assert "system_shared_memory" in client.get_server_metadata().extensions
            client.register_system_shared_memory("left", in_key, SIZE, headers=AUTH)
            assert _held(server, in_key)
        finally:
            server.stop()  # SIGINT: drain, then every region closed (a failed check: still)
        assert server.proc.returncode == 0, server.log()
        assert "system shared memory 'left' unregistered" in server.log()
    finally:
        shm.destroy_shared_memory_region(handle)
