"""The environment doctor passes here and fails loudly, naming the check, when something breaks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from infermesh import doctor
from tests.support import ROOT


def test_doctor_passes_in_the_installed_environment() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "infermesh.doctor"], capture_output=True, text=True, cwd=ROOT,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "doctor: environment OK" in out.stdout
    assert "ok   envoy binary: envoy 1." in out.stdout
    assert "ok   otlp exporter" in out.stdout


def test_a_broken_part_fails_the_doctor(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken() -> str:
        raise ImportError("cannot import name 'InstrumentationScope'")

    monkeypatch.setattr(doctor, "CHECKS", (("python", doctor._python_version), ("otlp", broken)))
    assert doctor.main() == 1
    printed = capsys.readouterr().out
    assert "FAIL otlp: ImportError: cannot import name 'InstrumentationScope'" in printed
    assert "1 check(s) failed" in printed
