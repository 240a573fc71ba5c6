"""The prepared GPU check (bench/gpu_check.py) says plainly what it found: on a host with no
GPU it prints its table with NO GPU and exits 2, rather than passing or crashing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.integration


def has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return bool(pynvml.nvmlDeviceGetCount())
    except Exception:  # no library or no driver: no GPU
        return False


def test_the_gpu_check_reports_what_it_found() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py")],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    print(done.stdout)
    assert "| check | result | figures |" in done.stdout
    if has_gpu():
        assert done.returncode == 0, done.stdout + done.stderr[-2000:]
        assert "| CUDA provider | PASS |" in done.stdout
    else:
        assert done.returncode == 2, done.stdout + done.stderr[-2000:]
        assert "| device | NO GPU |" in done.stdout
        assert "the remaining checks need one (not run)" in done.stdout
