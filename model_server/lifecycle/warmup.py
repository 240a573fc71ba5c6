"""Warm-up inputs for a model version: config.pbtxt's ``model_warmup`` entries (zeros, random
data or a file under the model's ``warmup/`` folder), else one sample of zeros."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from model_server.core.datatypes import BY_CONFIG_TYPE, Datatype, to_onnx_strings
from model_server.core.model_config import ModelSpec, TensorSpec


def _synthetic(spec: TensorSpec, batch_dims: list[int], zero: bool, seed: int) -> np.ndarray:
    shape = batch_dims + [d if d > 0 else 1 for d in spec.dims]
    return _fill(spec.datatype, shape, zero, seed)


def _fill(datatype: Datatype, shape: list[int], zero: bool, seed: int) -> np.ndarray:
    if datatype.is_bytes:
        return np.full(shape, "" if zero else "warmup", dtype=object)
    if zero:
        return np.zeros(shape, dtype=datatype.numpy)
    rng = np.random.default_rng(seed)
    if datatype.numpy.kind == "f":
        return rng.random(shape).astype(datatype.numpy)
    if datatype.numpy.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(0, 100, shape).astype(datatype.numpy)


def warmup_inputs(spec: ModelSpec, model_dir: Path) -> list[tuple[dict[str, np.ndarray], int]]:
    """Feeds for warm-up: the config's model_warmup entries, else one sample of zeros."""
    batch_dims = [1] if spec.max_batch_size > 0 else []
    warmups = list(spec.config.model_warmup)
    if not warmups:
        feeds = {t.name: _synthetic(t, batch_dims, True, 0) for t in spec.inputs}
        return [({k: _onnx_ready(v) for k, v in feeds.items()}, 1)]
    runs = []
    for index, warmup in enumerate(warmups):
        batch = [max(1, warmup.batch_size)] if spec.max_batch_size > 0 else []
        feeds = {}
        for name, source in warmup.inputs.items():
            datatype = BY_CONFIG_TYPE[source.data_type]
            shape = batch + list(source.dims)
            choice = source.WhichOneof("input_data_type")
            if choice == "input_data_file":
                raw = (model_dir / "warmup" / source.input_data_file).read_bytes()
                feeds[name] = np.frombuffer(raw, dtype=datatype.numpy).reshape(shape)
            else:
                feeds[name] = _fill(datatype, shape, choice != "random_data", index)
        runs.append(({k: _onnx_ready(v) for k, v in feeds.items()}, max(1, warmup.count)))
    return runs


def _onnx_ready(array: np.ndarray) -> np.ndarray:
    return to_onnx_strings(array) if array.dtype == object else array
