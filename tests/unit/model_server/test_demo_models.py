"""Tests for model_server.demo_models: determinism, numerics, config, atomic/idempotent writes."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from model_server import demo_models
from model_server.demo_lm import build_demo_lm
from model_server.demo_models import (
    build_classifier,
    build_demo_repository,
    build_identity_model,
    build_large_model,
    write_model,
)


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("repo")
    build_demo_repository(out)
    return out


def _inputs(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 3, 32, 32)).astype(np.float32)


def test_layout_and_returned_paths(tmp_path: Path) -> None:
    paths = build_demo_repository(tmp_path)
    assert paths == [
        tmp_path / "classifier" / "1" / "model.onnx",
        tmp_path / "classifier" / "2" / "model.onnx",
    ]
    assert all(p.is_file() for p in paths)
    assert (tmp_path / "classifier" / "config.pbtxt").is_file()
    # Atomic writes leave no temporary files behind.
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and p.name.endswith(".tmp")]
    assert leftovers == []


def test_build_is_byte_identical(tmp_path: Path, repo: Path) -> None:
    again = build_demo_repository(tmp_path / "again")
    for v, path in zip((1, 2), again, strict=True):
        first = (repo / "classifier" / str(v) / "model.onnx").read_bytes()
        assert path.read_bytes() == first
        assert build_classifier(v).SerializeToString(deterministic=True) == first


def test_versions_differ(repo: Path) -> None:
    x = _inputs(4)
    p1 = _session(repo / "classifier" / "1" / "model.onnx").run(["probs"], {"input": x})[0]
    p2 = _session(repo / "classifier" / "2" / "model.onnx").run(["probs"], {"input": x})[0]
    assert np.abs(p1 - p2).max() > 1e-3


def test_classifier_v1_numerics(repo: Path) -> None:
    sess = _session(repo / "classifier" / "1" / "model.onnx")
    (inp,) = sess.get_inputs()
    (out,) = sess.get_outputs()
    assert (inp.name, inp.type, inp.shape) == ("input", "tensor(float)", ["batch", 3, 32, 32])
    assert (out.name, out.type, out.shape) == ("probs", "tensor(float)", ["batch", 10])

    x = _inputs(4)
    probs = sess.run(["probs"], {"input": x})[0]
    assert probs.shape == (4, 10)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    # Depends on the input: rows differ between samples.
    assert np.abs(probs - probs[0]).max() > 1e-4
    # Not degenerate: neither uniform nor one-hot.
    top = probs.max(axis=1)
    assert np.all(top > 0.12)
    assert np.all(top < 0.9)

    singles = np.concatenate([sess.run(["probs"], {"input": x[i : i + 1]})[0] for i in range(4)])
    np.testing.assert_allclose(probs, singles, atol=1e-5, rtol=0)


def test_classifier_rejects_unknown_version() -> None:
    with pytest.raises(ValueError):
        build_classifier(3)


def test_config_parses_and_matches_model(repo: Path) -> None:
    text = (repo / "classifier" / "config.pbtxt").read_text()
    assert text.startswith("#") and "model_server.demo_models" in text.splitlines()[0]
    cfg = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert cfg.name == "classifier"
    assert cfg.platform == "onnxruntime_onnx"
    assert cfg.max_batch_size == 32
    assert cfg.version_policy.WhichOneof("policy_choice") == "all"
    assert [i.name for i in cfg.input] == ["input"]
    assert [o.name for o in cfg.output] == ["probs"]
    assert cfg.input[0].data_type == model_config_pb2.TYPE_FP32
    assert cfg.output[0].data_type == model_config_pb2.TYPE_FP32
    assert list(cfg.input[0].dims) == [3, 32, 32]
    assert list(cfg.output[0].dims) == [10]
    assert len(cfg.instance_group) == 1
    assert cfg.instance_group[0].count == 1
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_AUTO

    model = build_classifier(1)
    assert [i.name for i in model.graph.input] == [i.name for i in cfg.input]
    assert [o.name for o in model.graph.output] == [o.name for o in cfg.output]
    # Config dims are the model dims without the batch dim.
    in_dims = model.graph.input[0].type.tensor_type.shape.dim
    assert in_dims[0].dim_param == "batch"
    assert [d.dim_value for d in in_dims[1:]] == list(cfg.input[0].dims)
    out_dims = model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in out_dims[1:]] == list(cfg.output[0].dims)


def test_existing_files_not_rewritten_unless_force(tmp_path: Path) -> None:
    paths = build_demo_repository(tmp_path)
    files = [*paths, tmp_path / "classifier" / "config.pbtxt"]
    old = 1_000_000_000
    for f in files:
        os.utime(f, ns=(old * 10**9, old * 10**9))
    # A truncated model stays as is: the builder only fills in what is missing.
    paths[1].write_bytes(b"junk")
    os.utime(paths[1], ns=(old * 10**9, old * 10**9))

    assert build_demo_repository(tmp_path) == paths
    assert all(f.stat().st_mtime_ns == old * 10**9 for f in files)
    assert paths[1].read_bytes() == b"junk"

    paths[0].unlink()
    build_demo_repository(tmp_path)
    assert paths[0].stat().st_mtime_ns != old * 10**9
    assert paths[1].read_bytes() == b"junk"

    build_demo_repository(tmp_path, force=True)
    assert all(f.stat().st_mtime_ns != old * 10**9 for f in files)
    assert paths[1].read_bytes() == build_classifier(2).SerializeToString(deterministic=True)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "models"
    assert demo_models.main(["--out", str(out)]) == 0
    first = capsys.readouterr().out
    assert first.count("wrote") == 3 and "exists" not in first
    assert demo_models.main(["--out", str(out)]) == 0
    second = capsys.readouterr().out
    assert second.count("exists") == 3 and "wrote" not in second
    assert demo_models.main(["--out", str(out), "--force"]) == 0
    assert capsys.readouterr().out.count("wrote") == 3


def test_identity_fp32_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "id_fp32" / "1" / "model.onnx"
    write_model(build_identity_model("FP32", [-1, 4]), path)
    sess = _session(path)
    assert sess.get_inputs()[0].shape == ["batch", 4]
    x = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    y = sess.run(["y"], {"x": x})[0]
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x)


def test_identity_bytes_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "id_bytes" / "1" / "model.onnx"
    write_model(build_identity_model("BYTES", [-1]), path)
    sess = _session(path)
    assert sess.get_inputs()[0].type == "tensor(string)"
    x = np.array(["hello", "", "wörld", "a b c"], dtype=object)
    y = sess.run(["y"], {"x": x})[0]
    assert y.tolist() == x.tolist()


@pytest.mark.parametrize(
    ("dtype", "np_dtype"),
    [
        ("BOOL", np.bool_),
        ("UINT8", np.uint8),
        ("INT8", np.int8),
        ("INT32", np.int32),
        ("INT64", np.int64),
        ("FP16", np.float16),
        ("FP64", np.float64),
    ],
)
def test_identity_other_dtypes(dtype: str, np_dtype: type[np.generic]) -> None:
    model = build_identity_model(dtype, [-1, 2, -1])
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", 2, "d2"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = (np.arange(12).reshape(2, 2, 3) % 3).astype(np_dtype)
    y = sess.run(["y"], {"x": x})[0]
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(y, x)


def test_identity_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError):
        build_identity_model("COMPLEX64", [1])


def test_large_model(tmp_path: Path) -> None:
    path = tmp_path / "large" / "1" / "model.onnx"
    write_model(build_large_model(50_000_000), path)
    assert path.stat().st_size >= 50_000_000
    sess = _session(path)
    x = np.random.default_rng(2).normal(size=(5, 4)).astype(np.float32)
    y = sess.run(["y"], {"x": x})[0]
    assert y.shape == (5, 4)
    np.testing.assert_allclose(y, x + np.arange(1, 5, dtype=np.float32), atol=1e-6)


@pytest.mark.skipif(os.geteuid() != 0, reason="reading as another uid needs root to switch")
def test_the_repository_is_readable_by_another_user(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The servers may run as another user than the one who built the models (a container's
    uid reading a bind mount): every file must be readable by it, as an ordinary write makes
    it under the usual umask."""
    top = Path(tempfile.mkdtemp(prefix="infermesh-other-uid-"))
    try:
        top.chmod(0o755)  # the test's own directory, so that another uid may enter it
        build_demo_repository(top)
        build_demo_lm(top / "lm")
        files = sorted(str(p) for p in top.rglob("*") if p.is_file())
        assert len(files) == 5  # classifier: config, v1, v2; demo_lm: config, v1
        done = subprocess.run(
            ["cat", *files], user=65534, capture_output=True, check=False, timeout=60
        )
        assert done.returncode == 0, done.stderr.decode()[-500:]
        assert {oct(Path(f).stat().st_mode & 0o777) for f in files} == {
            oct(0o666 & ~demo_models._umask())
        }
    finally:
        shutil.rmtree(top)
