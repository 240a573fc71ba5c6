"""Config parsing, version policy and completion from the ONNX graph (pure functions)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from model_server.core.errors import ModelConfigError
from model_server.core.model_config import (
    DERIVED_MAX_BATCH_SIZE,
    GraphTensor,
    check_declared_config,
    complete_spec,
    instance_count,
    parse_config_override,
    read_declared_config,
    select_versions,
)

GRAPH_IN = [GraphTensor("input", "tensor(float)", ("batch", 3, 32, 32))]
GRAPH_OUT = [GraphTensor("probs", "tensor(float)", ("batch", 10))]


def config(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


@pytest.mark.parametrize(
    ("policy", "available", "expected"),
    [
        ("", [1, 2, 3], [3]),
        ("version_policy { latest { num_versions: 2 } }", [1, 5, 3], [3, 5]),
        ("version_policy { latest { num_versions: 9 } }", [2, 1], [1, 2]),
        ("version_policy { all {} }", [3, 1, 2], [1, 2, 3]),
        ("version_policy { specific { versions: [1, 3] } }", [1, 2, 3], [1, 3]),
    ],
)
def test_version_policy(policy: str, available: list[int], expected: list[int]) -> None:
    assert select_versions(config(policy), available) == expected


def test_specific_version_without_a_file_is_an_error() -> None:
    with pytest.raises(ModelConfigError, match=r"version\(s\) \[4\] that have no model file"):
        select_versions(config("version_policy { specific { versions: [1, 4] } }"), [1, 2])


def test_every_config_error_is_reported_at_once() -> None:
    bad = config(
        'name: "other" platform: "tensorflow_savedmodel" max_batch_size: -1 '
        'input [ { name: "a" data_type: TYPE_FP32 dims: [ 0 ] }, '
        '{ name: "a" data_type: TYPE_FP32 dims: [ 1 ] } ] '
        "version_policy { latest { num_versions: 0 } }"
    )
    with pytest.raises(ModelConfigError) as caught:
        check_declared_config(bad, "classifier")
    message = str(caught.value)
    for fragment in (
        "does not match the directory name 'classifier'",
        "platform 'tensorflow_savedmodel' is not supported",
        "max_batch_size must be >= 0",
        "dims [0] must be positive or -1",
        "input 'a' is declared twice",
        "num_versions must be >= 1",
    ):
        assert fragment in message


def test_read_declared_config_pbtxt_yaml_and_absent(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.pbtxt").write_text("max_batch_size: 8")
    assert read_declared_config(tmp_path / "a").max_batch_size == 8
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.yaml").write_text("max_batch_size: 4\nversion_policy: {all: {}}\n")
    b = read_declared_config(tmp_path / "b")
    assert b.name == "b" and b.max_batch_size == 4 and b.version_policy.HasField("all")
    (tmp_path / "c").mkdir()
    assert read_declared_config(tmp_path / "c").name == "c"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.pbtxt").write_text("max_batch_size: eight")
    with pytest.raises(ModelConfigError, match=r"config\.pbtxt"):
        read_declared_config(tmp_path / "d")


def test_config_override_json() -> None:
    assert parse_config_override('{"max_batch_size": 2}', "m").name == "m"
    with pytest.raises(ModelConfigError, match="not a valid ModelConfig JSON"):
        parse_config_override("{not json", "m")


def test_autocomplete_from_the_graph() -> None:
    spec = complete_spec(config('name: "c"'), GRAPH_IN, GRAPH_OUT)
    assert spec.max_batch_size == DERIVED_MAX_BATCH_SIZE
    assert spec.inputs[0].dims == (3, 32, 32) and spec.inputs[0].datatype.name == "FP32"
    assert spec.outputs[0].dims == (10,)


def test_autocomplete_without_a_batch_dimension() -> None:
    fixed = [GraphTensor("x", "tensor(int64)", (4,))]
    spec = complete_spec(config('name: "c"'), fixed, fixed)
    assert spec.max_batch_size == 0 and spec.inputs[0].dims == (4,)


def test_declared_dims_take_the_stricter_value() -> None:
    declared = config(
        'name: "c" max_batch_size: 8 input [ { name: "input" data_type: TYPE_FP32 '
        "dims: [ -1, 32, 32 ] } ]"
    )
    spec = complete_spec(declared, GRAPH_IN, GRAPH_OUT)
    assert spec.inputs[0].dims == (3, 32, 32)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('input [ { name: "image" data_type: TYPE_FP32 dims: [3,32,32] } ]', "not in the ONNX"),
        ('input [ { name: "input" data_type: TYPE_INT64 dims: [3,32,32] } ]', "TYPE_INT64"),
        ('input [ { name: "input" data_type: TYPE_FP32 dims: [3,32] } ]', "have rank 2"),
        ('input [ { name: "input" data_type: TYPE_FP32 dims: [3,32,16] } ]', "dim 2 is 16"),
    ],
)
def test_config_that_contradicts_the_graph(text: str, fragment: str) -> None:
    with pytest.raises(ModelConfigError, match=fragment):
        complete_spec(config(f'name: "c" max_batch_size: 8 {text}'), GRAPH_IN, GRAPH_OUT)


def test_undeclared_graph_input_is_an_error() -> None:
    two = [*GRAPH_IN, GraphTensor("mask", "tensor(bool)", ("batch", 4))]
    declared = config(
        'name: "c" max_batch_size: 8 input [ { name: "input" data_type: TYPE_FP32 '
        "dims: [3,32,32] } ]"
    )
    with pytest.raises(ModelConfigError, match=r"graph inputs \['mask'\] are not declared"):
        complete_spec(declared, two, GRAPH_OUT)


def test_missing_section_is_completed_from_the_graph() -> None:
    declared = config('name: "c" max_batch_size: 8 output [ { name: "probs" data_type: TYPE_FP32 '
                      "dims: [10] } ]")  # fmt: skip
    assert complete_spec(declared, GRAPH_IN, GRAPH_OUT).inputs[0].dims == (3, 32, 32)


def test_batching_needs_a_dynamic_first_dimension() -> None:
    fixed = [GraphTensor("input", "tensor(float)", (1, 3, 32, 32))]
    with pytest.raises(ModelConfigError, match="needs a dynamic first dimension"):
        complete_spec(
            config('name: "c" max_batch_size: 8 input [ { name: "input" data_type: TYPE_FP32 '
                   "dims: [3,32,32] } ]"),
            fixed,
            GRAPH_OUT,
        )  # fmt: skip


def test_instance_count() -> None:
    assert instance_count(config("")) == 1
    assert instance_count(config("instance_group [ { count: 2 }, { count: 3 } ]")) == 5
