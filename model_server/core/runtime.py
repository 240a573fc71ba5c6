"""ONNX Runtime sessions: execution provider choice and session options per device.

Session options (documented in docs/model-server.md):
- CPU: ``intra_op_num_threads`` 1 per instance by default (the gRPC front end needs a core of
  its own and concurrent instances scale better than one wide session on a small host),
  sequential execution, all graph optimisations, the CPU memory arena on. A model's
  config.pbtxt may override with ``parameters { key: "intra_op_thread_count" ... }``.
- CUDA: the CUDA execution provider on the chosen device, arena growing only as requested
  (kSameAsRequested), so memory readings reflect what the model really holds.
``auto`` picks CUDA only when NVML sees a device: onnxruntime-gpu lists the CUDA provider as
available even on hosts without a GPU, and a CUDA session there silently falls back to CPU.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from model_server.core.memory import nvml_device_count
from model_server.core.model_config import GraphTensor

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


@dataclass(frozen=True)
class DeviceChoice:
    """Where sessions run: ``kind`` is "cpu" or "cuda"; ``index`` the CUDA device."""

    kind: str
    index: int = 0

    @property
    def label(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


def choose_device(requested: str) -> DeviceChoice:
    """Resolves --device (auto, cpu, cuda, cuda:N) against what this host has."""
    if requested == "cpu":
        return DeviceChoice("cpu")
    if requested == "auto":
        has_gpu = CUDA in ort.get_available_providers() and nvml_device_count() > 0
        if has_gpu:
            preload_cuda_libraries()
        return DeviceChoice("cuda") if has_gpu else DeviceChoice("cpu")
    if requested == "cuda" or requested.startswith("cuda:"):
        index = int(requested.partition(":")[2] or 0)
        if CUDA not in ort.get_available_providers():
            raise ValueError("--device cuda: this onnxruntime has no CUDA execution provider")
        preload_cuda_libraries()
        return DeviceChoice("cuda", index)
    raise ValueError(f"--device {requested!r}: expected auto, cpu, cuda or cuda:N")


def preload_cuda_libraries() -> None:
    """Loads CUDA and cuDNN from the nvidia-* wheels when they are installed (the GPU image:
    ``onnxruntime-gpu[cuda,cudnn]``), so the host needs only its driver. Without the wheels the
    system's libraries are used, as before."""
    if importlib.util.find_spec("nvidia") is not None and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()


class OnnxSession:
    """One ONNX Runtime session; ``run`` is thread-safe and releases the GIL while it runs."""

    def __init__(
        self, path: Path, device: DeviceChoice, parameters: Mapping[str, str] | None = None
    ) -> None:
        parameters = parameters or {}
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.intra_op_num_threads = int(parameters.get("intra_op_thread_count", "1"))
        options.inter_op_num_threads = int(parameters.get("inter_op_thread_count", "1"))
        options.enable_cpu_mem_arena = True
        options.log_severity_level = 3  # errors only: warnings about unused initializers are noise
        providers: list[Any] = [CPU]
        if device.kind == "cuda":
            cuda_options = {"device_id": device.index, "arena_extend_strategy": "kSameAsRequested"}
            providers = [(CUDA, cuda_options), CPU]
        self._session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        self.providers: list[str] = list(self._session.get_providers())
        if device.kind == "cuda" and CUDA not in self.providers:
            raise RuntimeError(
                f"CUDA was requested on {device.label} but ONNX Runtime fell back to "
                f"{self.providers} (is the CUDA runtime installed?)"
            )
        self.inputs = [
            GraphTensor(i.name, i.type, tuple(i.shape)) for i in self._session.get_inputs()
        ]
        self.outputs = [
            GraphTensor(o.name, o.type, tuple(o.shape)) for o in self._session.get_outputs()
        ]

    @property
    def provider(self) -> str:
        """The execution provider that runs the model (the first one ONNX Runtime kept)."""
        return self.providers[0]

    def run(self, outputs: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return list(self._session.run(list(outputs), dict(feeds)))
