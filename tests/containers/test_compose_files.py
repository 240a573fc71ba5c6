"""Compose itself accepts every compose file, alone and with its overlay: Compose 1.29 here
(`docker-compose config`), Compose v2 where the CLI has it (the same harness picks it)."""

from __future__ import annotations

import subprocess

import pytest

from tests.container_support import compose_command
from tests.support import ROOT

pytestmark = pytest.mark.containers


@pytest.mark.parametrize(
    "files",
    [("compose.yaml",), ("compose.yaml", "compose.gpu.yaml"), ("compose.private.yaml",)],
    ids=lambda files: "+".join(files),
)
def test_compose_accepts_the_file(container_tools: None, files: tuple[str, ...]) -> None:
    args = [arg for name in files for arg in ("-f", name)]
    done = subprocess.run(
        [*compose_command(), *args, "config", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_a_v2_only_key_is_refused(container_tools: None, tmp_path: object) -> None:
    """The check can fail: Compose 1.29 refuses the top-level `name:` (the key compose.yaml
    had), so a file valid only for v2 does not pass unseen."""
    if compose_command()[-1] == "compose":
        pytest.skip("Compose v2 accepts `name:`; this checks Compose 1.29's schema")
    text = "name: infermesh\n" + (ROOT / "compose.private.yaml").read_text()
    done = subprocess.run(
        [*compose_command(), "-f", "-", "config", "-q"],
        input=text, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "name" in done.stderr, done.stderr
