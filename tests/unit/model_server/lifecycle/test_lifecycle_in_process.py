"""A model version's lifecycle in process (no server): loaded and warmed to READY, held in
UNLOADING while a request is in flight and freed only after it ends, and FAILED with the
reason when its file is not a model."""

from __future__ import annotations

import asyncio

import pytest

from model_server.lifecycle.repository import ModelLoadError, ModelRepository
from model_server.lifecycle.version import ModelState


async def test_an_unload_waits_for_the_request_in_flight(repository: ModelRepository) -> None:
    await repository.load("classifier")
    version = repository.resolve("classifier", "2")
    assert version.state is ModelState.READY and version.session is not None
    assert version.memory_bytes > 0 and version.load_ms > 0
    version.begin_request()  # a request the version has taken
    unloading = asyncio.create_task(version.unload())
    await asyncio.sleep(0)  # it runs up to its wait for the request
    for _ in range(20):
        await asyncio.sleep(0.01)
        assert not unloading.done()
    assert version.state is ModelState.UNLOADING
    assert version.session is not None  # still there for the request
    version.end_request()
    await asyncio.wait_for(unloading, 5)
    assert version.state is ModelState.UNAVAILABLE and version.reason == "unloaded"
    assert version.session is None


async def test_a_file_that_is_not_a_model_fails_its_version_with_the_reason(
    repository: ModelRepository,
) -> None:
    """The load is refused naming the version and the file; the other version still serves."""
    broken = repository.root / "classifier" / "2" / "model.onnx"
    broken.write_bytes(b"not an onnx model")
    with pytest.raises(ModelLoadError, match=r"version 2: InvalidProtobuf") as raised:
        await repository.load("classifier")
    assert str(broken) in str(raised.value)
    states = {e.version: (e.state, e.reason) for e in repository.index()}
    assert states["1"][0] == "READY"
    assert states["2"][0] == "FAILED" and str(broken) in states["2"][1]
    assert repository.resolve("classifier", "").version == 1  # the newest READY one
