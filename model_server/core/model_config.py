"""Model configuration: Triton's config.pbtxt (or config.yaml), completed from the ONNX graph.

Two layers, as in Triton: the *declared* config is read from the model directory (it may be
partial or absent) and checked for what can be checked without the model; once ONNX Runtime
has opened the model, ``complete_spec`` merges the declared config with the graph's signature
into a frozen ``ModelSpec``. Every inconsistency is collected and reported at once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import yaml
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from model_server.core.datatypes import BY_CONFIG_TYPE, BY_ONNX_TYPE, Datatype
from model_server.core.errors import ModelConfigError

ModelConfig = model_config_pb2.ModelConfig
CONFIG_FILES = ("config.pbtxt", "config.yaml", "config.yml")
DEFAULT_MODEL_FILENAME = "model.onnx"
# Batch limit given to a model without a config whose graph has a dynamic first dimension.
DERIVED_MAX_BATCH_SIZE = 32
SUPPORTED_PLATFORMS = {"", "onnxruntime_onnx"}
SUPPORTED_BACKENDS = {"", "onnxruntime"}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: ``dims`` exclude the batch dimension; -1 is dynamic."""

    name: str
    datatype: Datatype
    dims: tuple[int, ...]
    optional: bool = False

    def shape_with_batch(self, max_batch_size: int) -> list[int]:
        return ([-1] if max_batch_size > 0 else []) + list(self.dims)


@dataclass(frozen=True)
class GraphTensor:
    """A tensor of the ONNX graph as ONNX Runtime reports it (shape includes any batch dim)."""

    name: str
    onnx_type: str
    shape: tuple[int | str | None, ...]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    config: model_config_pb2.ModelConfig = field(compare=False)

    @cached_property
    def _inputs_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.inputs}

    @cached_property
    def _outputs_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.outputs}

    @cached_property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def input_named(self, name: str) -> TensorSpec | None:
        return self._inputs_by_name.get(name)

    def output_named(self, name: str) -> TensorSpec | None:
        return self._outputs_by_name.get(name)


def read_declared_config(model_dir: Path) -> model_config_pb2.ModelConfig:
    """Reads config.pbtxt / config.yaml from ``model_dir``; an empty config when there is none."""
    config = ModelConfig()
    for filename in CONFIG_FILES:
        path = model_dir / filename
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        try:
            if filename.endswith(".pbtxt"):
                text_format.Parse(text, config)
            else:
                json_format.ParseDict(yaml.safe_load(text) or {}, config)
        except (text_format.ParseError, json_format.ParseError, yaml.YAMLError) as exc:
            raise ModelConfigError(f"{path.name}: {exc}") from exc
        break
    if not config.name:
        config.name = model_dir.name
    check_declared_config(config, model_dir.name)
    return config


def parse_config_override(text: str, model_name: str) -> model_config_pb2.ModelConfig:
    """Parses the JSON config a RepositoryModelLoad request may carry (Triton's "config")."""
    config = ModelConfig()
    try:
        json_format.Parse(text, config)
    except (json_format.ParseError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"config override is not a valid ModelConfig JSON: {exc}") from exc
    if not config.name:
        config.name = model_name
    check_declared_config(config, model_name)
    return config


def check_declared_config(config: model_config_pb2.ModelConfig, dir_name: str) -> None:
    """Checks what can be checked before the model is opened; raises with every error found."""
    errors: list[str] = []
    if config.name != dir_name:
        errors.append(f"name {config.name!r} does not match the directory name {dir_name!r}")
    if config.platform not in SUPPORTED_PLATFORMS:
        errors.append(f"platform {config.platform!r} is not supported (expected onnxruntime_onnx)")
    if config.backend not in SUPPORTED_BACKENDS:
        errors.append(f"backend {config.backend!r} is not supported (expected onnxruntime)")
    if config.max_batch_size < 0:
        errors.append(f"max_batch_size must be >= 0, got {config.max_batch_size}")
    errors += batching_errors(config)
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for tensor in tensors:
            where = f"{kind} {tensor.name!r}"
            if not tensor.name:
                errors.append(f"an {kind} has no name")
            if tensor.name in seen:
                errors.append(f"{where} is declared twice")
            seen.add(tensor.name)
            if tensor.data_type not in BY_CONFIG_TYPE:
                type_name = model_config_pb2.DataType.Name(tensor.data_type)
                errors.append(f"{where}: data_type {type_name} is not supported")
            if any(d < -1 or d == 0 for d in tensor.dims):
                errors.append(f"{where}: dims {list(tensor.dims)} must be positive or -1")
            if tensor.HasField("reshape"):
                errors.append(f"{where}: reshape is not supported")
    if config.version_policy.WhichOneof("policy_choice") == "latest" and (
        config.version_policy.latest.num_versions < 1
    ):
        errors.append("version_policy.latest.num_versions must be >= 1")
    for group in config.instance_group:
        if group.count < 0:
            errors.append(f"instance_group count must be >= 0, got {group.count}")
    if errors:
        raise ModelConfigError("; ".join(errors))


def select_versions(config: model_config_pb2.ModelConfig, available: Sequence[int]) -> list[int]:
    """Applies version_policy (default: latest 1, as Triton) to the versions found on disk."""
    newest_first = sorted(set(available), reverse=True)
    policy = config.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return sorted(newest_first)
    if choice == "specific":
        wanted = sorted(set(policy.specific.versions))
        missing = [v for v in wanted if v not in newest_first]
        if missing:
            raise ModelConfigError(
                f"version_policy.specific lists version(s) {missing} that have no model file"
            )
        return wanted
    count = policy.latest.num_versions if choice == "latest" else 1
    return sorted(newest_first[:count])


def model_filename(config: model_config_pb2.ModelConfig) -> str:
    return config.default_model_filename or DEFAULT_MODEL_FILENAME


def instance_count(config: model_config_pb2.ModelConfig) -> int:
    """Concurrent executions of one version: the sum of instance_group counts (default 1)."""
    return max(1, sum(group.count or 1 for group in config.instance_group))


def _graph_dims(shape: Sequence[int | str | None]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) and d > 0 else -1 for d in shape)


def _batchable(tensors: Sequence[GraphTensor]) -> bool:
    return all(len(t.shape) >= 1 and _graph_dims(t.shape)[0] == -1 for t in tensors)


def complete_spec(
    declared: model_config_pb2.ModelConfig,
    graph_inputs: Sequence[GraphTensor],
    graph_outputs: Sequence[GraphTensor],
) -> ModelSpec:
    """Merges the declared config with the ONNX graph; raises with every inconsistency."""
    config = ModelConfig()
    config.CopyFrom(declared)
    config.platform = "onnxruntime_onnx"
    errors: list[str] = []
    autocomplete = not config.input and not config.output
    if autocomplete and config.max_batch_size == 0 and _batchable([*graph_inputs, *graph_outputs]):
        config.max_batch_size = DERIVED_MAX_BATCH_SIZE
    batch = config.max_batch_size > 0
    for kind, declared_tensors, graph_tensors in (
        ("input", config.input, graph_inputs),
        ("output", config.output, graph_outputs),
    ):
        by_name = {t.name: t for t in graph_tensors}
        if not declared_tensors:
            for tensor in graph_tensors:
                entry = declared_tensors.add()
                entry.name = tensor.name
                datatype = BY_ONNX_TYPE.get(tensor.onnx_type)
                if datatype is None:
                    errors.append(
                        f"{kind} {tensor.name!r}: ONNX type {tensor.onnx_type} is not supported"
                    )
                    continue
                entry.data_type = datatype.config_type
                entry.dims.extend(_graph_dims(tensor.shape)[1 if batch else 0 :])
        for entry in declared_tensors:
            graph = by_name.get(entry.name)
            where = f"{kind} {entry.name!r}"
            if graph is None:
                errors.append(f"{where} is not in the ONNX graph (graph has {sorted(by_name)})")
                continue
            _merge_tensor(entry, graph, batch, where, errors)
        if kind == "input":
            undeclared = sorted(set(by_name) - {t.name for t in declared_tensors})
            if undeclared:
                errors.append(f"graph inputs {undeclared} are not declared in the config")
    if errors:
        raise ModelConfigError("; ".join(errors))
    return ModelSpec(
        name=config.name,
        max_batch_size=config.max_batch_size,
        inputs=tuple(_tensor_spec(t) for t in config.input),
        outputs=tuple(_tensor_spec(t) for t in config.output),
        config=config,
    )


def _merge_tensor(
    entry: model_config_pb2.ModelInput | model_config_pb2.ModelOutput,
    graph: GraphTensor,
    batch: bool,
    where: str,
    errors: list[str],
) -> None:
    declared_type = BY_CONFIG_TYPE.get(entry.data_type)
    graph_type = BY_ONNX_TYPE.get(graph.onnx_type)
    if declared_type is None or graph_type is None or declared_type != graph_type:
        errors.append(
            f"{where}: config says {model_config_pb2.DataType.Name(entry.data_type)}, "
            f"the ONNX graph has {graph.onnx_type}"
        )
        return
    graph_dims = _graph_dims(graph.shape)
    if batch:
        if not graph_dims or graph_dims[0] != -1:
            errors.append(
                f"{where}: max_batch_size > 0 needs a dynamic first dimension, "
                f"the ONNX graph has shape {list(graph.shape)}"
            )
            return
        graph_dims = graph_dims[1:]
    if len(graph_dims) != len(entry.dims):
        errors.append(
            f"{where}: config dims {list(entry.dims)} have rank {len(entry.dims)}, the ONNX "
            f"graph's {'non-batch ' if batch else ''}dims {list(graph_dims)} have rank "
            f"{len(graph_dims)}"
        )
        return
    merged = []
    for index, (mine, theirs) in enumerate(zip(entry.dims, graph_dims, strict=True)):
        if mine != -1 and theirs != -1 and mine != theirs:
            errors.append(f"{where}: dim {index} is {mine} in the config, {theirs} in the graph")
        merged.append(theirs if mine == -1 else mine)  # keep the stricter of the two
    del entry.dims[:]
    entry.dims.extend(merged)


def _tensor_spec(
    tensor: model_config_pb2.ModelInput | model_config_pb2.ModelOutput,
) -> TensorSpec:
    return TensorSpec(
        name=tensor.name,
        datatype=BY_CONFIG_TYPE[tensor.data_type],
        dims=tuple(tensor.dims),
        optional=bool(getattr(tensor, "optional", False)),
    )


# config.pbtxt model parameter (Triton's ``parameters`` map, which stock Triton accepts and
# its backends ignore when unknown): "true" runs a batch below the preferred sizes at once
# when every instance is idle instead of waiting max_queue_delay_microseconds for company.
SKIP_DELAY_WHEN_IDLE = "dynamic_batching_skip_delay_when_idle"
_BOOLEANS = {"true": True, "false": False}


@dataclass(frozen=True)
class BatchingPolicy:
    """config.pbtxt's dynamic_batching, in seconds; 0 means "none" for sizes and timeouts."""

    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_s: float = 0.0
    priority_levels: int = 1  # levels 1..N; 1 is served first
    default_priority: int = 1
    max_queue_size: int = 0  # requests queued across every level; 0: unbounded
    default_timeout_s: float = 0.0  # a request queued longer is answered DEADLINE_EXCEEDED
    # Triton waits max_queue_delay for a preferred size even on an idle model (False, the
    # default); True runs at once when no batch is running (SKIP_DELAY_WHEN_IDLE).
    skip_delay_when_idle: bool = False


def batching_policy(config: model_config_pb2.ModelConfig) -> BatchingPolicy | None:
    """The version's batching policy, or None when it does not batch dynamically."""
    if not config.HasField("dynamic_batching") or config.max_batch_size <= 0:
        return None
    d = config.dynamic_batching
    levels = max(1, int(d.priority_levels))
    queue = d.default_queue_policy
    return BatchingPolicy(
        max_batch_size=config.max_batch_size,
        preferred_batch_sizes=tuple(sorted(int(s) for s in d.preferred_batch_size)),
        max_queue_delay_s=d.max_queue_delay_microseconds / 1e6,
        priority_levels=levels,
        default_priority=int(d.default_priority_level) or levels,
        max_queue_size=int(queue.max_queue_size),
        default_timeout_s=queue.default_timeout_microseconds / 1e6,
        skip_delay_when_idle=_skip_delay_when_idle(config) is True,
    )


def _skip_delay_when_idle(config: model_config_pb2.ModelConfig) -> bool | None:
    """The SKIP_DELAY_WHEN_IDLE parameter: False when absent, None when not a boolean."""
    if SKIP_DELAY_WHEN_IDLE not in config.parameters:
        return False
    return _BOOLEANS.get(config.parameters[SKIP_DELAY_WHEN_IDLE].string_value.strip().lower())


def batching_errors(config: model_config_pb2.ModelConfig) -> list[str]:
    """Problems with the dynamic_batching section (empty: fine or absent). A max_batch_size of
    0 may still be filled in from the graph, so sizes are checked only against a declared one."""
    if not config.HasField("dynamic_batching"):
        return []
    d, errors = config.dynamic_batching, []
    for size in d.preferred_batch_size:
        if size <= 0 or 0 < config.max_batch_size < size:
            errors.append(
                f"dynamic_batching.preferred_batch_size {size} must be in 1..max_batch_size "
                f"({config.max_batch_size})"
            )
    if _skip_delay_when_idle(config) is None:
        value = config.parameters[SKIP_DELAY_WHEN_IDLE].string_value
        errors.append(
            f"parameters[{SKIP_DELAY_WHEN_IDLE!r}] must be 'true' or 'false', got {value!r}"
        )
    if d.default_priority_level > d.priority_levels:
        errors.append(
            f"dynamic_batching.default_priority_level {d.default_priority_level} must be <= "
            f"priority_levels ({d.priority_levels})"
        )
    return errors
