"""Memory guard (the article's incident 1): a load that would cross the budget is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from model_server.demo_models import build_large_model, write_model
from tests.support import EXPLICIT, infer_classifier, start_server

pytestmark = pytest.mark.integration
MiB = 1024 * 1024


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_load_over_budget_is_refused_and_the_server_keeps_serving(
    copy_repo: Path, tmp_path: Path
) -> None:
    write_model(build_large_model(20 * MiB), copy_repo / "fits" / "1" / "model.onnx")
    write_model(build_large_model(250 * MiB), copy_repo / "huge" / "1" / "model.onnx")
    server = start_server(
        copy_repo, tmp_path, *EXPLICIT, "--models", "classifier", "--memory-budget", "400MiB"
    )
    try:
        client = server.client()
        rss_before = _rss(server.proc.pid)
        assert rss_before < 250 * MiB, "the test assumes a lean server process"
        client.load_model("fits")  # ~62 MiB expected: fits in what is left
        x = grpcclient.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
        np.testing.assert_array_equal(client.infer("fits", [x]).as_numpy("y"), [[2, 3, 4, 5]])

        with pytest.raises(InferenceServerException) as caught:
            client.load_model("huge")
        message = caught.value.message()
        assert "StatusCode.RESOURCE_EXHAUSTED" in str(caught.value.status())
        assert "model 'huge' version 1 needs about" in message
        assert "load refused" in message and "of 400.0 MiB" in message
        # Nothing was read into memory for the refused model.
        assert _rss(server.proc.pid) < rss_before + 150 * MiB
        rows = {(m.name, m.version): m for m in client.get_model_repository_index().models}
        assert rows[("huge", "1")].state == "FAILED"
        assert rows[("huge", "1")].reason.startswith("MemoryBudgetExceeded")
        assert "load refused" in server.log()
        # The server is alive and still serves what it had.
        images = np.zeros((2, 3, 32, 32), dtype=np.float32)
        assert infer_classifier(client, images).as_numpy("probs").shape == (2, 10)
        assert client.is_server_ready()
    finally:
        server.stop()
