"""The container tier's session: the engine (installed by tools/containers.sh when missing,
dockerd started here when none runs, and then stopped) and the image, built once (cached by
the engine between runs). Each step prints its time."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.container_support import DockerEngine
from tests.support import ROOT


def _setup(step: str) -> None:
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(ROOT / "tools" / "containers.sh"), step],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    output = (done.stdout + done.stderr).strip()
    print(f"\n{output}\ncontainers.sh {step}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"tools/containers.sh {step} failed (exit {done.returncode})")


@pytest.fixture(scope="session")
def container_tools() -> None:
    """Docker Engine, Compose and debootstrap installed (tools/containers.sh engine)."""
    _setup("engine")


@pytest.fixture(scope="session")
def docker_engine(
    container_tools: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DockerEngine]:
    engine = DockerEngine(tmp_path_factory.mktemp("dockerd")).start()
    try:
        yield engine
    finally:
        engine.stop()  # only a dockerd started here


@pytest.fixture(scope="session")
def mesh_image(docker_engine: DockerEngine) -> str:
    _setup("base")
    _setup("image")
    return "infermesh:latest"
