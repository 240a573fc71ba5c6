from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from model_server.demo_models import build_demo_repository


@pytest.fixture(scope="session")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo repository, built once per test session (read-only for tests)."""
    root = tmp_path_factory.mktemp("demo-models")
    build_demo_repository(root)
    return root


@pytest.fixture
def copy_repo(demo_repo: Path, tmp_path: Path) -> Iterator[Path]:
    """A private, writable copy of the demo repository."""
    import shutil

    target = tmp_path / "models"
    shutil.copytree(demo_repo, target)
    yield target
