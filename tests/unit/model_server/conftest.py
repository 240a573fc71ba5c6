"""Fixtures of the model server's in-process tests."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from model_server.core.faults import FaultInjector
from model_server.core.memory import MemoryGuard, ProcessMemory
from model_server.core.runtime import DeviceChoice
from model_server.demo_lm import build_demo_lm
from model_server.lifecycle.repository import ModelRepository
from model_server.observability.metrics import ServerMetrics
from model_server.protocol.service import InferenceService
from model_server.scheduling.gate import ServingGate


@pytest.fixture
async def repository(demo_repo: Path, tmp_path: Path) -> AsyncIterator[ModelRepository]:
    """A repository of the demo classifier (versions 1 and 2) on CPU, nothing loaded yet;
    whatever a test loads is unloaded after it."""
    root = tmp_path / "models"
    shutil.copytree(demo_repo / "classifier", root / "classifier")
    repo = ModelRepository(
        root, DeviceChoice("cpu"), MemoryGuard(ProcessMemory(8 << 30)), ServerMetrics()
    )
    yield repo
    for name in repo.loaded_names():
        await repo.unload(name)


@pytest.fixture
async def lm_service(tmp_path: Path) -> AsyncIterator[InferenceService]:
    """The demo generative model served in process, with fault injection available."""
    build_demo_lm(tmp_path / "lm")
    metrics = ServerMetrics()
    repository = ModelRepository(
        tmp_path / "lm", DeviceChoice("cpu"), MemoryGuard(ProcessMemory(8 << 30)), metrics
    )
    await repository.load("demo_lm")
    gate = ServingGate(ready=lambda: True)
    faults = FaultInjector(enabled=True)
    yield InferenceService(repository, metrics, gate, 64 << 20, lambda n, loaded: None, faults)
    for name in repository.loaded_names():
        await repository.unload(name)
