"""The model repository in process (no server): loads real ONNX models from a Triton-layout
directory, resolves the version a request gets, names what is wrong, and unloads."""

from __future__ import annotations

import shutil

import pytest

from model_server.core.errors import InvalidInput, ModelNotFound
from model_server.lifecycle.repository import ModelLoadError, ModelRepository


async def test_a_load_serves_the_newest_ready_version_unless_one_is_asked_for(
    repository: ModelRepository,
) -> None:
    await repository.load("classifier")
    assert repository.is_ready("classifier")
    ready = {(e.version, e.state) for e in repository.index() if e.name == "classifier"}
    assert ready == {("1", "READY"), ("2", "READY")}
    assert repository.resolve("classifier", "").version == 2
    assert repository.resolve("classifier", "1").version == 1
    with pytest.raises(ModelNotFound, match=r"has no version 7 \(available: \[1, 2\]\)"):
        repository.resolve("classifier", "7")
    with pytest.raises(InvalidInput, match="version 'x' is not a number"):
        repository.resolve("classifier", "x")
    with pytest.raises(ModelNotFound, match=r"'detector' is not loaded \(loaded: \['classifier'\]"):
        repository.resolve("detector", "")


async def test_a_load_names_what_is_missing(repository: ModelRepository) -> None:
    with pytest.raises(ModelNotFound, match="model 'detector' is not in the repository"):
        await repository.load("detector")
    for version in ("1", "2"):
        shutil.rmtree(repository.root / "classifier" / version)
    with pytest.raises(ModelLoadError, match=r"no version directory holds model\.onnx"):
        await repository.load("classifier")
    assert not repository.is_ready("classifier")


async def test_an_unloaded_model_is_refused_by_name(repository: ModelRepository) -> None:
    await repository.load("classifier")
    await repository.unload("classifier")
    assert not repository.is_ready("classifier")
    with pytest.raises(ModelNotFound, match=r"'classifier' is not loaded \(loaded: \[\]\)"):
        repository.resolve("classifier", "")


def test_the_fingerprint_moves_when_a_version_file_changes(repository: ModelRepository) -> None:
    before = repository.model_fingerprint("classifier")
    assert repository.model_fingerprint("classifier") == before
    model = repository.root / "classifier" / "2" / "model.onnx"
    model.write_bytes(model.read_bytes() + b"\0")
    assert repository.model_fingerprint("classifier") != before
