"""KV-aware routing for real: one of two servers has its KV cache filled by long sequences;
new streams through Envoy go mostly to the other."""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2_grpc

from model_server.demo_lm import build_demo_lm
from tests.envoy_support import free_port
from tests.mesh_support import ControlPlaneThread, start_plane_and_envoy, write_topology
from tests.support import MODEL, ServerProcess, metric_value, start_server, text_request, wait_for

pytestmark = pytest.mark.integration


FILLER_PROMPT = "Once upon a time, " * 25  # 450 tokens of the demo LM's byte vocabulary


def small_cache_repo(target: Path, blocks: int) -> Path:
    build_demo_lm(target)
    config = target / MODEL / "config.pbtxt"
    config.write_text(
        config.read_text()
        + f'parameters {{ key: "kv_cache_blocks" value {{ string_value: "{blocks}" }} }}\n'
    )
    return target


def requests_served(server: ServerProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        return metric_value(r.read().decode(), "inference_requests_total", model=MODEL)


def stream(url: str, max_tokens: int, header: bool, prompt: str = "Once ") -> None:
    metadata = (("x-model-name", MODEL),) if header else ()
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = text_request(prompt, max_tokens=max_tokens)
        for _ in stub.ModelStreamInfer(iter([request]), metadata=metadata, timeout=120):
            pass


@pytest.fixture(scope="module")
def mesh(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[list[ServerProcess], ControlPlaneThread, int]]:
    workdir = tmp_path_factory.mktemp("kv-routing")
    otlp, listener = free_port(), free_port()
    with contextlib.ExitStack() as stops:
        servers = []
        for name in ("a", "b"):
            repo = small_cache_repo(workdir / f"repo-{name}", blocks=32)
            server = start_server(
                repo, workdir / name, "--models", MODEL,
                "--otlp-endpoint", f"127.0.0.1:{otlp}", "--telemetry-interval", "0.2",
            )  # fmt: skip
            stops.callback(server.stop)
            servers.append(server)
        lm = {"name": MODEL, "sla_p99_ms": 5000, "capacity_qps": 50, "generative": True,
              "routing": {"ewma_alpha": 1.0, "max_step": 1.0, "hysteresis": 0.05}}  # fmt: skip
        topology = write_topology(
            workdir / "t.yaml", listener, [s.url for s in servers], more_models=[lm],
            top={"telemetry": {"window_s": 3}},
        )  # fmt: skip
        plane, _ = start_plane_and_envoy(stops, workdir, topology, listener, 4, otlp)
        yield servers, plane, listener


def test_new_streams_avoid_the_server_whose_kv_cache_is_full(
    mesh: tuple[list[ServerProcess], ControlPlaneThread, int],
) -> None:
    (full, free), plane, listener = mesh
    stop = threading.Event()

    def keep_full() -> None:  # long sequences straight to one server, one after another
        # A long prompt: each sequence holds 28-31 of the 32 blocks from its first step to its
        # last. (A short one with 480 tokens to generate grew from one block, and the cache's
        # use, so the full server's weight, swung with where its sequences stood.)
        while not stop.is_set():
            stream(full.url, 40, header=False, prompt=FILLER_PROMPT)

    fillers = [threading.Thread(target=keep_full, daemon=True) for _ in range(3)]
    for thread in fillers:
        thread.start()
    try:

        def endpoints() -> dict[str, dict[str, Any]]:
            found: dict[str, dict[str, Any]] = (
                plane.admin_get("/status")["routing"].get(MODEL, {}).get("endpoints", {})
            )
            return found

        def weights(pool: dict[str, dict[str, Any]]) -> dict[str, int]:
            return {ep: int(e["weight"] or 0) for ep, e in pool.items()}

        last: list[dict[str, int]] = [{}]  # the weights at the last poll, for a failure's message

        def full_under_half() -> bool:
            last[0] = w = weights(endpoints())
            return bool(w) and w.get(full.url, 0) * 2 < w.get(free.url, 0)

        try:
            wait_for(full_under_half, 20, "the full server's weight to fall under half", 0.2)
        except TimeoutError as e:
            raise AssertionError(f"{e}; weights at the end {last[0]}, full {full.url}") from e
        before = {s.url: requests_served(s) for s in (full, free)}
        seen = []  # the weights in force as the streams went, for a failure's message
        reasons = []  # why the full server had its weight, as an operator reads it
        for _ in range(30):
            stream(f"127.0.0.1:{listener}", 4, header=True)
            pool = endpoints()
            now = weights(pool)
            seen.append((now.get(full.url), now.get(free.url)))
            reasons.append(pool[full.url]["reason"])
        served = {s.url: requests_served(s) - before[s.url] for s in (full, free)}
    finally:
        stop.set()
        for thread in fillers:
            thread.join(timeout=60)
    # The full server's counter also counts its long sequences (a few end meanwhile): judge
    # by the free one. With its weight under half the other's, it should get two thirds.
    print(f"\nserved {served}; weights (full, free) after each stream: {seen}")
    assert served[free.url] >= 0.6 * 30, (served, seen)
    # The decision explains itself: the nearly full cache's factor is named in the reason.
    assert any("kv_full 0." in reason for reason in reasons), reasons[-3:]
