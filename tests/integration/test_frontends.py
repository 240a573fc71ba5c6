"""``--frontends N`` with real processes: stock tritonclient through two front ends answers
as one process does; a front end killed under load costs its clients only clean UNAVAILABLE
errors and comes back; the repository API and statistics work through the front ends (one
view: the engine's); SIGTERM stops every process and a killed engine takes its front ends
with it. Every process is found by its PID (the engine's children) and checked gone."""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2
from tritonclient.grpc import service_pb2_grpc

from infermesh.wire import TOKENS_USED_HEADER
from model_server.demo_lm import build_demo_lm
from model_server.frontends.engine import resident_bytes
from model_server.generative.text import completion_tokens
from tests.support import (
    EXPLICIT,
    MODEL,
    ServerProcess,
    Traffic,
    alive,
    children,
    infer_classifier,
    metric_value,
    start_server,
    successes,
    text_request,
    wait_for,
)

pytestmark = pytest.mark.integration
PRIVATE = re.compile(r"private directory (\S+)")
IMAGES = np.random.default_rng(29).standard_normal((4, 3, 32, 32)).astype(np.float32)
MAX_FRONTEND_RSS = 150 * 1024 * 1024


@pytest.fixture(scope="module")
def repo(demo_repo: Path) -> Path:
    return demo_repo  # the classifier, versions 1 and 2; read only


@pytest.fixture(scope="module")
def two(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(repo, tmp_path_factory.mktemp("logs"), "--frontends", "2", *EXPLICIT)
    yield server
    server.stop()


def frontends(server: ServerProcess) -> set[int]:
    return children(server.proc.pid)


def test_answers_equal_one_process_and_front_ends_hold_no_model(
    two: ServerProcess, repo: Path, tmp_path: Path
) -> None:
    # and the standard loop, with CPython's garbage collector settings
    one = start_server(repo, tmp_path, "--event-loop", "asyncio", "--gc-threshold", "0")
    try:
        for version in ("1", "2"):
            want = infer_classifier(one.client(), IMAGES, version).as_numpy("probs")
            got = infer_classifier(two.client(), IMAGES, version).as_numpy("probs")
            np.testing.assert_array_equal(got, want)
        assert two.client().get_model_metadata("classifier") == (
            one.client().get_model_metadata("classifier")
        )
    finally:
        one.stop()
    assert "event loop asyncio" in one.log()
    assert "garbage collector" not in one.log()
    # --gc-threshold's default in the engine and, passed on, in each front end: the young
    # threshold raised, and what start-up left alive frozen once the models loaded
    assert two.log().count("garbage collector: young generation threshold 10000") == 3
    assert len(re.findall(r"garbage collector: \d+ objects frozen", two.log())) >= 3
    # uvloop by default, in the engine and in each front end (the engine passes its choice on)
    assert re.search(r"restricted API groups: .*; event loop uvloop", two.log())
    for index in (0, 1):
        assert re.search(rf"front end {index} \(pid \d+\) listening on .*, event loop uvloop",
                         two.log())  # fmt: skip
    pids = frontends(two)
    assert len(pids) == 2
    for pid in pids:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "onnxruntime" not in maps, f"front end {pid} loaded ONNX Runtime"
        assert resident_bytes(pid) < MAX_FRONTEND_RSS
    with pytest.raises(grpcclient.InferenceServerException, match="not loaded"):
        two.client().infer("nope", [grpcclient.InferInput("x", [1], "FP32")])


def test_statistics_count_every_front_ends_requests(two: ServerProcess) -> None:
    before = successes(two.client())
    sent = 0
    for _ in range(40):  # a client per connection: the kernel spreads them over the front ends
        client = two.client()
        infer_classifier(client, IMAGES[:1])
        client.close()
        sent += 1
    assert successes(two.client()) - before == sent
    text = two.metrics()
    per_frontend = [metric_value(text, "frontend_requests_total", frontend=str(i)) for i in (0, 1)]
    assert all(count > 0 for count in per_frontend), per_frontend  # both front ends served
    assert metric_value(text, "frontends_running") == 2


def test_repository_api_through_a_front_end(two: ServerProcess) -> None:
    client = two.client()
    client.unload_model("classifier")
    wait_for(lambda: not client.is_model_ready("classifier"), 10, "classifier unloaded")
    index = {m.name: m.state for m in client.get_model_repository_index().models}
    assert index["classifier"] == "UNAVAILABLE"
    client.load_model("classifier")
    assert client.is_model_ready("classifier")
    assert infer_classifier(client, IMAGES[:1]).as_numpy("probs").shape == (1, 10)


def test_a_killed_front_end_fails_its_clients_cleanly_and_comes_back(two: ServerProcess) -> None:
    victim = min(frontends(two))
    with Traffic(two.url, clients=8, deadline_s=60) as traffic:
        traffic.wait_ok(50)
        two_before = traffic.ok
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(frontends(two) - {victim}) == 2, 20, "a new front end")
        traffic.wait_ok(100, timeout=30)
    assert traffic.ok > two_before
    print(f"killed front end {victim}: {traffic.ok} OK, errors {traffic.errors[:3]} "
          f"({len(traffic.errors)})")  # fmt: skip
    codes = {code for code, _ in traffic.errors}
    assert codes <= {grpc.StatusCode.UNAVAILABLE}, traffic.errors[:5]
    assert not alive(victim)
    assert metric_value(two.metrics(), "frontend_restarts_total") >= 1
    assert two.is_ready()


def test_sigterm_stops_every_process(repo: Path, tmp_path: Path) -> None:
    server = start_server(repo, tmp_path, "--frontends", "3")
    pids = frontends(server)
    private = Path(PRIVATE.search(server.log())[1])  # type: ignore[index]
    assert len(pids) == 3 and private.is_dir()
    assert oct(private.stat().st_mode & 0o777) == "0o700"
    assert not list(private.glob("pool-*"))  # each pool unlinked once the engine mapped it
    server.signal(signal.SIGTERM)
    assert server.wait_exit(30) == 0
    wait_for(lambda: not any(alive(pid) for pid in pids), 10, "every front end gone")
    assert not private.exists()
    assert "front ends stopped: 0=code 0, 1=code 0, 2=code 0" in server.log()


def test_drain_is_the_engines_through_its_front_ends(repo: Path, tmp_path: Path) -> None:
    server = start_server(repo, tmp_path, "--frontends", "2", "--drain-delay", "1.0")
    pids = frontends(server)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert server.health() == serving
    with Traffic(server.url, clients=4, deadline_s=30, leave_when_draining=True) as traffic:
        traffic.wait_ok(20)
        server.signal(signal.SIGTERM)
        wait_for(lambda: server.health() != serving, 5, "NOT_SERVING through a front end")
        assert server.wait_exit(30) == 0
    assert {code for code, _ in traffic.errors} <= {grpc.StatusCode.UNAVAILABLE}
    assert not any(alive(pid) for pid in pids)
    assert "drain 3/3" in server.log()


def test_sigterm_to_the_process_group_leaves_the_drain_to_the_engine(
    repo: Path, tmp_path: Path
) -> None:
    """systemd's control-group kill and ``kill -TERM -- -PGID`` signal every process at once.
    Before, each front end quit on it (its clients cut, the public port closed) and the
    engine, not yet stopping, restarted them mid-drain; now they serve until the engine
    stops them at the drain's end."""
    server = start_server(repo, tmp_path, "--frontends", "2", "--drain-delay", "2.0",
                          own_group=True)  # fmt: skip
    pids = frontends(server)
    with Traffic(server.url, clients=2, deadline_s=30, leave_when_draining=True) as traffic:
        traffic.wait_ok(20)
        os.killpg(server.proc.pid, signal.SIGTERM)
        wait_for(lambda: "drain 1/3" in server.log(), 10, "the engine draining")
        traffic.wait_ok(20, timeout=10)  # through the same front ends, mid-drain
        assert frontends(server) == pids and all(alive(pid) for pid in pids)
        assert server.wait_exit(30) == 0
    assert "restarting" not in server.log()
    assert "front ends stopped: 0=code 0, 1=code 0" in server.log()
    assert not any(alive(pid) for pid in pids)


def test_a_killed_engine_takes_its_front_ends(repo: Path, tmp_path: Path) -> None:
    server = start_server(repo, tmp_path, "--frontends", "2")
    pids = frontends(server)
    try:
        server.signal(signal.SIGKILL)
        server.wait_exit(10)
        wait_for(lambda: not any(alive(pid) for pid in pids), 10, "front ends gone (pdeathsig)")
    finally:
        server.stop()
        private = PRIVATE.search(server.log())
        if private:  # a killed engine cannot remove it: the one leftover, documented
            shutil.rmtree(private[1], ignore_errors=True)


def test_a_text_generation_reports_its_tokens_through_a_front_end(tmp_path: Path) -> None:
    """The edge's token limits settle each reservation with x-infermesh-tokens-used: a front
    end passes it on as the single process sends it (ModelInfer, refusals, streams). Before,
    every generation through a front end kept its whole reservation charged."""
    repo = tmp_path / "models"
    build_demo_lm(repo)
    server = start_server(repo, tmp_path / "logs", "--frontends", "2", "--models", MODEL)
    try:
        with grpc.insecure_channel(server.url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            response, call = stub.ModelInfer.with_call(text_request("Once ", max_tokens=8))
            used = dict(call.trailing_metadata() or ())[TOKENS_USED_HEADER]
            assert int(used) == 1 + len("Once ") + completion_tokens([response])
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(text_request("Once ", max_tokens=0))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert dict(refused.value.trailing_metadata() or ())[TOKENS_USED_HEADER] == "0"
            stream = stub.ModelStreamInfer(iter([text_request("Once ", max_tokens=4)]))
            answers = [r.infer_response for r in stream]
            used = dict(stream.trailing_metadata() or ())[TOKENS_USED_HEADER]
            assert int(used) == 1 + len("Once ") + completion_tokens(answers)
    finally:
        server.stop()
