"""The gpu image variant builds (its CUDA and cuDNN wheels: about 3 GB, cached by the engine
after the first build) and, on this host without a GPU, carries what a GPU host needs: ONNX
Runtime with the CUDA provider, the CUDA libraries it preloads, and a model server that asked
for a GPU it cannot see refuses to start, by name, rather than serve from the CPU."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.container_support import docker
from tests.support import ROOT

pytestmark = pytest.mark.containers
IMAGE = "infermesh:gpu"


@pytest.fixture(scope="module")
def gpu_image(mesh_image: str) -> str:
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(ROOT / "tools" / "containers.sh"), "image", "gpu", IMAGE],
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    print(f"\n{done.stdout.strip()}\ngpu image: {time.monotonic() - started:.0f} s")
    assert done.returncode == 0, done.stderr[-2000:]
    return IMAGE


def test_the_gpu_image_carries_the_cuda_runtime(gpu_image: str) -> None:
    probe = (
        "import onnxruntime as ort, importlib.metadata as m; ort.preload_dlls(); "
        "print(*ort.get_available_providers()); "
        "print(*sorted(d.metadata['Name'] for d in m.distributions()))"
    )
    providers, packages = docker("run", "--rm", gpu_image, "python", "-c", probe).splitlines()
    assert "CUDAExecutionProvider" in providers.split()
    assert {"nvidia-cuda-runtime", "nvidia-cublas"} <= set(packages.split())
    assert any(name.startswith("nvidia-cudnn") for name in packages.split())


def test_a_server_without_its_gpu_refuses_to_start(gpu_image: str) -> None:
    done = subprocess.run(
        ["/usr/bin/docker", "run", "--rm", gpu_image, "infermesh-model-server", "--host",
         "127.0.0.1", "--port", "8001", "--model-repository", "models", "--device", "cuda"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--device cuda:0: NVML cannot see that GPU" in done.stderr
    assert "Traceback" not in done.stderr
