"""``infermesh models``: model control for the whole pool on the servers' own ports, with the
operator key; and the local credentials ``infermesh up`` makes."""

from __future__ import annotations

import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from infermesh.api_keys import API_KEY_FILE, API_KEYS_FILE, ensure_local_credentials
from infermesh.secrets import ADMIN_TOKEN_FILE, OPERATOR_KEY_FILE
from infermesh.wire import OPERATOR_HEADER
from tests.support import EXPLICIT, ROOT, ServerProcess, infermesh, start_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pool(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[list[ServerProcess], Path]]:
    workdir = tmp_path_factory.mktemp("pool")
    shutil.copytree(demo_repo / "classifier", workdir / "models" / "classifier")
    ensure_local_credentials(workdir)
    key = workdir / OPERATOR_KEY_FILE
    servers = []
    try:
        for index in range(2):
            servers.append(start_server(
                workdir / "models", workdir / f"s{index}", *EXPLICIT, "--restricted-api",
                f"model-repository:{OPERATOR_HEADER}=@{key}",
            ))  # fmt: skip
        yield servers, workdir
    finally:
        for server in servers:
            server.stop()


def test_models_unload_load_and_index_on_every_server(
    pool: tuple[list[ServerProcess], Path],
) -> None:
    servers, workdir = pool
    flags = [arg for s in servers for arg in ("--server", s.url)]
    done = infermesh(workdir, "models", "unload", "classifier", *flags)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("classifier unloaded") == 2
    assert not any(s.client().is_model_ready("classifier") for s in servers)
    done = infermesh(workdir, "models", "load", "classifier", *flags)
    assert done.returncode == 0, done.stderr
    assert all(s.client().is_model_ready("classifier") for s in servers)
    done = infermesh(workdir, "models", "index", *flags)
    assert done.returncode == 0 and done.stdout.count("classifier v1  READY") == 2, done.stdout


def test_a_wrong_key_is_refused_by_each_server_and_never_printed(
    pool: tuple[list[ServerProcess], Path], tmp_path: Path
) -> None:
    servers, _ = pool
    wrong = tmp_path / "wrong.key"
    wrong.write_text("not-the-operator-key-0123456789\n")
    # Plaintext servers: no operator certificate here (ROOT may hold a local mesh's).
    flags = [arg for s in servers for arg in ("--server", s.url)] + ["--pki", str(tmp_path)]
    done = infermesh(
        ROOT, "models", "unload", "classifier", *flags,
        "--credential", f"{OPERATOR_HEADER}=@{wrong}",
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.count("PERMISSION_DENIED") == 2
    assert "not-the-operator-key" not in done.stderr + done.stdout
    assert all(s.client().is_model_ready("classifier") for s in servers)
    missing = infermesh(ROOT, "models", "index", *flags, "--credential", "x=@/nonexistent/key")
    assert missing.returncode == 2 and "cannot read /nonexistent/key" in missing.stderr
    nameless = infermesh(ROOT, "models", "load", *flags)
    assert nameless.returncode == 2 and "needs a model name" in nameless.stderr


def test_local_credentials_are_made_once_private_and_random(tmp_path: Path) -> None:
    made = ensure_local_credentials(tmp_path)
    files = (OPERATOR_KEY_FILE, ADMIN_TOKEN_FILE, API_KEY_FILE, API_KEYS_FILE)
    assert made == [tmp_path / f for f in files]
    values = [path.read_text().strip() for path in made]
    assert len(set(values)) == 4 and all(len(v) >= 40 for v in values)
    # The control plane's file holds the key's hash, never its secret.
    key_id, secret = values[2].split(":")
    assert secret not in values[3] and f"{key_id}:{{SHA}}" in values[3]
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in made)
    assert ensure_local_credentials(tmp_path) == []  # kept: services already read them
    assert [path.read_text().strip() for path in made] == values
