"""Model control on a real model server: Triton's --model-control-mode and restricted API
groups (--restricted-api), over gRPC and over REST, with tritonclient and raw HTTP."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from model_server.security.access import (
    GROUP_OF_METHOD,
    GROUPS,
    RestrictionError,
    parse_restriction,
    rest_group,
    restriction_table,
)
from tests.support import EXPLICIT, ROOT, ServerProcess, start_server, wait_for

pytestmark = pytest.mark.integration
HEADER = "infermesh-operator-key"
SECRET = "s3cr3t-operator-credential-0123456789"
FROZEN = re.compile(r"garbage collector: \d+ objects frozen")


@pytest.fixture(scope="module")
def repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(demo_repo / "classifier", repo / "classifier")
    return repo


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("secrets") / "operator.key"
    path.write_text(SECRET + "\n")
    return path


@pytest.fixture(scope="module")
def restricted(
    repo: Path, key_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_server(
        repo,
        tmp_path_factory.mktemp("logs"),
        *EXPLICIT,
        "--restricted-api",
        f"model-repository,statistics:{HEADER}=@{key_file}",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def default_mode(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(repo, tmp_path_factory.mktemp("logs"))  # no mode given: none
    yield server
    server.stop()


def _infer(client: Any, module: Any = grpcclient) -> np.ndarray:
    x = module.InferInput("input", [1, 3, 32, 32], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
    return client.infer("classifier", [x]).as_numpy("probs")


def _post(url: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- the default mode: none ---------------------------------------------------------------------


def test_default_mode_refuses_load_and_unload_naming_the_mode(default_mode: ServerProcess) -> None:
    client = default_mode.client()
    for call in (client.unload_model, client.load_model):
        with pytest.raises(InferenceServerException) as caught:
            call("classifier")
        assert caught.value.status() == "StatusCode.UNAVAILABLE"
        assert "--model-control-mode none" in caught.value.message()
    assert client.is_model_ready("classifier")  # nothing was unloaded
    base = f"http://127.0.0.1:{default_mode.http_port}/v2/repository/models/classifier"
    for action in ("unload", "load"):
        status, body = _post(f"{base}/{action}")
        assert status == 503, body
        assert "--model-control-mode none" in body["error"]
    assert _infer(client).shape == (1, 10)


def test_default_mode_serves_the_repository_index_over_rest(default_mode: ServerProcess) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{default_mode.http_port}")
    rows = http.get_model_repository_index()
    assert {(r["name"], r["state"]) for r in rows} >= {("classifier", "READY")}


# -- restricted groups ----------------------------------------------------------------------


def test_restricted_grpc_calls_without_the_credential_are_refused_naming_the_group(
    restricted: ServerProcess,
) -> None:
    client = restricted.client()
    calls = {
        "model-repository": [
            lambda h: client.unload_model("classifier", headers=h),
            lambda h: client.load_model("classifier", headers=h),
            lambda h: client.get_model_repository_index(headers=h),
        ],
        "statistics": [lambda h: client.get_inference_statistics("classifier", headers=h)],
    }
    for group, group_calls in calls.items():
        for call in group_calls:
            for headers in ({}, {HEADER: "wrong"}, {HEADER: SECRET[:-1]}, {"x-other": SECRET}):
                with pytest.raises(InferenceServerException) as caught:
                    call(headers)
                assert caught.value.status() == "StatusCode.PERMISSION_DENIED"
                assert group in caught.value.message() and HEADER in caught.value.message()
                assert SECRET not in caught.value.message()
    assert client.is_model_ready("classifier")
    assert _infer(client).shape == (1, 10)  # inference is not restricted
    assert SECRET not in restricted.log()


def test_restricted_grpc_calls_with_the_credential_work(restricted: ServerProcess) -> None:
    client = restricted.client()
    creds = {HEADER: SECRET}
    frozen = len(FROZEN.findall(restricted.log()))
    client.unload_model("classifier", headers=creds)
    rows = {m.name: m.state for m in client.get_model_repository_index(headers=creds).models}
    assert rows["classifier"] == "UNAVAILABLE"
    client.load_model("classifier", headers=creds)
    assert client.is_model_ready("classifier")
    # the collector settles again after each: the unloaded version's cycles freed, the new
    # version frozen out of later collections (model_server.core.collector)
    wait_for(lambda: len(FROZEN.findall(restricted.log())) >= frozen + 2, 10, "two settles")
    stats = client.get_inference_statistics("classifier", headers=creds).model_stats
    assert stats[0].name == "classifier"
    assert _infer(client).shape == (1, 10)


def test_restricted_rest_calls_answer_403_json_and_work_with_the_credential(
    restricted: ServerProcess,
) -> None:
    base = f"http://127.0.0.1:{restricted.http_port}"
    for path in (
        "/v2/repository/index",
        "/v2/repository/models/classifier/unload",
        "/v2/repository/models/classifier/load",
        "/v2//repository/models/classifier/unload",
        "/v2/%72epository/models/classifier/unload",  # percent-encoded 'r'
    ):
        status, body = _post(base + path, headers={HEADER: "nope"})
        assert status == 403, (path, body)
        assert "model-repository" in body["error"] and SECRET not in body["error"]
    request = urllib.request.Request(base + "/v2/models/classifier/stats")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 403
    assert "statistics" in json.loads(caught.value.read())["error"]

    http = httpclient.InferenceServerClient(f"127.0.0.1:{restricted.http_port}")
    creds = {HEADER: SECRET}
    http.unload_model("classifier", headers=creds)
    assert not http.is_model_ready("classifier")
    http.load_model("classifier", headers=creds, config=json.dumps({"max_batch_size": 8}))
    assert http.is_model_ready("classifier")
    assert http.get_model_config("classifier")["max_batch_size"] == 8
    rows = http.get_model_repository_index(headers=creds)
    assert {(r["name"], r["state"]) for r in rows} >= {("classifier", "READY")}
    assert _infer(http, httpclient).shape == (1, 10)


def test_rest_repository_bad_bodies_name_the_field(restricted: ServerProcess) -> None:
    base = f"http://127.0.0.1:{restricted.http_port}/v2/repository"
    creds = {HEADER: SECRET}
    cases = [
        ("/index", b'{"ready": "yes"}', "'ready'"),
        ("/index", b"[1, 2]", "JSON object"),
        ("/index", b"{not json", "not valid JSON"),
        ("/models/classifier/load", b'{"parameters": []}', "'parameters'"),
        ("/models/classifier/load", b'{"parameters": {"config": {"a": 1}}}', "parameters.config"),
        ("/models/classifier/load", b'{"parameters": {"config": "{]"}}', "classifier"),
        ("/models/classifier/load", b'{"parameters": {"file:1/model.onnx": "AA=="}}', "file"),
        ("/models/nope/load", b"", "nope"),
    ]
    for path, body, expected in cases:
        status, answer = _post(base + path, body, creds)
        assert status in (400, 404), (path, body, answer)
        assert expected in answer["error"], (path, answer)
    assert restricted.client().is_model_ready("classifier")


# -- configuration ----------------------------------------------------------------------------


def test_restriction_values_are_checked(tmp_path: Path) -> None:
    key = tmp_path / "k"
    key.write_text("  value\n")
    parsed = parse_restriction(f"model-repository,trace:X-Key=@{key}")
    assert parsed.groups == {"model-repository", "trace"} and parsed.header == "x-key"
    assert parsed.value == "value" and "value" not in repr(parsed)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    bad = {
        "model-repository": "expected GROUP",
        "nonsense:x=@/k": "unknown API group",
        "statistics:x=literal-secret": "must come from a file",
        f"statistics:x=@{tmp_path / 'missing'}": "cannot read",
        f"statistics:x=@{empty}": "is empty",
    }
    for text, expected in bad.items():
        with pytest.raises(RestrictionError) as caught:
            parse_restriction(text)
        assert expected in str(caught.value)
        assert "literal-secret" not in str(caught.value)
    with pytest.raises(RestrictionError, match="restricted twice"):
        restriction_table([parsed, parse_restriction(f"trace:y=@{key}")])


def test_the_cli_refuses_bad_flags_before_starting(tmp_path: Path) -> None:
    for args in (
        ["--restricted-api", "statistics:x=plain"],
        ["--repository-poll-interval", "1"],  # without --model-control-mode poll
        ["--model-control-mode", "sometimes"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "model_server", "--port", "0", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert done.returncode == 2, done
        assert "plain" not in done.stderr or "--model-control-mode" in done.stderr


def test_every_grpc_method_and_rest_path_has_triton_s_group() -> None:
    assert set(GROUP_OF_METHOD.values()) == set(GROUPS)
    paths = {
        ("GET", "/v2/health/ready"): "health",
        ("GET", "/v2/models/m/ready"): "health",
        ("GET", "/v2"): "metadata",
        ("GET", "/v2/models/m/versions/1"): "metadata",
        ("POST", "/v2/models/m/versions/1/infer"): "inference",
        ("GET", "/v2/models/m/config"): "model-config",
        ("GET", "/v2/models/stats"): "statistics",
        ("GET", "/v2/models/m/versions/2/stats"): "statistics",
        ("POST", "/v2/repository/index"): "model-repository",
        ("POST", "/v2/systemsharedmemory/status"): "shared-memory",
        ("POST", "/v2/cudasharedmemory/region/r/register"): "shared-memory",
        ("GET", "/v2/trace/setting"): "trace",
        ("POST", "/v2/models/m/trace/setting"): "trace",
        ("GET", "/v2/logging"): "logging",
    }
    for (method, path), group in paths.items():
        assert rest_group(path) == group, (method, path)
    assert rest_group("/metrics") is None
