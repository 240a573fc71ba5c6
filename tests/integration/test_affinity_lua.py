"""The affinity Lua through a real Envoy: the key it puts in x-infermesh-affinity for each
body the edge reads (gRPC raw and typed contents, header-less or not, one-request streams,
KServe REST JSON, OpenAI completions and chat), session keys, and what gets no key.

The model's endpoint is a port nothing listens on: every request fails upstream, and the
access log (``affinity``: the header's first 80 characters) shows the key Envoy hashed."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from control_plane.model.mesh import (
    SERVERS_CLUSTER,
    Affinity,
    EndpointAddress,
    EndpointAssignment,
    ListenerOptions,
    MeshState,
    ModelRoute,
    model_cluster,
    rest_cluster,
)
from control_plane.xds.resources import build_resources
from tests.envoy_support import Envoy, free_port, start_envoy
from tests.support import text_request, wait_for
from tests.unit.control_plane.xds.test_resources import static_bootstrap

pytestmark = pytest.mark.integration

LM, CHAT = "demo_lm", "chat"
BLOCKS = 2  # 32 bytes: the whole key fits the access log's 80 characters


@pytest.fixture(scope="module")
def envoy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Envoy, Path]]:
    workdir = tmp_path_factory.mktemp("affinity-lua")
    port, admin_port, dead = free_port(), free_port(), free_port()
    log = workdir / "access.log"
    nowhere = (EndpointAssignment(EndpointAddress("127.0.0.1", dead)),)
    lm = Affinity("prefix", prefix_blocks=BLOCKS, one_request_streams=True)
    state = MeshState(
        listener=ListenerOptions(port=port, access_log=str(log), health_check_interval_s=30),
        models=(
            ModelRoute(LM, 1000, 5, affinity=lm),
            ModelRoute(CHAT, 1000, 5, affinity=Affinity("session", session_header="x-chat")),
        ),
        clusters={
            name: nowhere for name in (SERVERS_CLUSTER, model_cluster(LM), model_cluster(CHAT))
        },
    )
    config = static_bootstrap(build_resources(state), admin_port)
    started = start_envoy(config, workdir, admin_port, port)
    try:
        yield started, log
    finally:
        started.stop()


def last_entry(log: Path, count: int) -> dict[str, Any]:
    """The access log's line number ``count`` (Envoy flushes the file about once a second)."""

    def lines() -> list[str] | None:
        found = log.read_text().splitlines() if log.exists() else []
        return found if len(found) >= count else None

    entry: dict[str, Any] = json.loads(wait_for(lines, 15, f"access log line {count}")[-1])
    return entry


class Sender:
    def __init__(self, envoy: Envoy, log: Path) -> None:
        self.envoy, self.log, self.sent = envoy, log, 0

    def key(self, send: Any) -> str | None:
        """Sends one request (its failure is expected) and returns the key Envoy logged."""
        with contextlib.suppress(grpc.RpcError, urllib.error.URLError):
            send(f"127.0.0.1:{self.envoy.port}")
        self.sent += 1
        value = last_entry(self.log, self.sent)["affinity"]
        return None if value in (None, "-", "") else str(value)


@pytest.fixture
def sender(envoy: tuple[Envoy, Path]) -> Sender:
    made = Sender(*envoy)
    made.sent = len(envoy[1].read_text().splitlines()) if envoy[1].exists() else 0
    return made


def grpc_call(request: service_pb2.ModelInferRequest, stream: bool = False,
              headers: tuple[tuple[str, str], ...] = ()) -> Any:  # fmt: skip
    def send(url: str) -> None:
        with grpc.insecure_channel(url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            if stream:
                list(stub.ModelStreamInfer(iter([request]), metadata=headers, timeout=10))
            else:
                stub.ModelInfer(request, metadata=headers, timeout=10)

    return send


def post(path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    def send(url: str) -> None:
        request = urllib.request.Request(
            f"http://{url}{path}", json.dumps(body).encode(),
            {"content-type": "application/json", **(headers or {})},
        )  # fmt: skip
        urllib.request.urlopen(request, timeout=10).read()

    return send


PROMPT = "You are a helpful assistant. Answer briefly and kindly, please."
KEY = "p" + PROMPT.encode()[: 16 * BLOCKS].hex()


def test_grpc_bodies_raw_or_typed_with_or_without_the_model_header(sender: Sender) -> None:
    assert sender.key(grpc_call(text_request(PROMPT))) == KEY  # header-less: routed by body
    typed = service_pb2.ModelInferRequest(model_name=LM)
    tensor = typed.inputs.add(name="other", datatype="FP32")
    tensor.shape.append(1)
    tensor = typed.inputs.add(name="text_input", datatype="BYTES")
    tensor.shape.append(1)
    tensor.contents.bytes_contents.append(PROMPT.encode())
    assert sender.key(grpc_call(typed, headers=(("x-model-name", LM),))) == KEY
    # raw contents: the second raw entry belongs to the second input, text_input
    raw = service_pb2.ModelInferRequest(model_name=LM)
    raw.inputs.add(name="other", datatype="FP32").shape.append(1)
    raw.inputs.add(name="text_input", datatype="BYTES").shape.append(1)
    raw.raw_input_contents.append(b"\0\0\0\0")
    raw.raw_input_contents.append(len(PROMPT).to_bytes(4, "little") + PROMPT.encode())
    assert sender.key(grpc_call(raw)) == KEY


def test_a_one_request_stream_is_keyed_on_its_message(sender: Sender) -> None:
    request = text_request(PROMPT)
    assert sender.key(grpc_call(request, stream=True, headers=(("x-model-name", LM),))) == KEY


def test_rest_and_openai_json_bodies(sender: Sender) -> None:
    rest = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                        "data": [PROMPT]}]}  # fmt: skip
    assert sender.key(post(f"/v2/models/{LM}/infer", rest)) == KEY
    completion = {"model": LM, "prompt": PROMPT, "max_tokens": 4}
    assert sender.key(post("/v1/completions", completion, {"x-model-name": LM})) == KEY
    assert sender.key(post("/v1/completions", completion)) == KEY  # model from the body
    escaped = {"model": LM, "prompt": [PROMPT.replace("a", "\u00e9")]}  # JSON \u escapes
    want = "p" + PROMPT.replace("a", "\u00e9").encode()[: 16 * BLOCKS].hex()
    assert sender.key(post("/v1/completions", escaped)) == want
    chat = {"model": LM, "messages": [{"role": "system", "content": PROMPT},
                                      {"role": "user", "content": "hi"}]}  # fmt: skip
    text = f"system\n{PROMPT}\nuser\nhi\n".encode()
    assert sender.key(post("/v1/chat/completions", chat)) == "p" + text[: 16 * BLOCKS].hex()


def test_session_keys_and_what_gets_no_key(sender: Sender) -> None:
    chat = (("x-model-name", CHAT), ("x-chat", "conversation-7"))
    assert sender.key(grpc_call(text_request(PROMPT), headers=chat)) == (
        "s." + b"conversation-7".hex()  # no tenant: auth is off here
    )
    # a stream of a model without one_request_streams: keyed by its header, never held
    stream = grpc_call(text_request(PROMPT), stream=True, headers=chat)
    assert sender.key(stream) == "s." + b"conversation-7".hex()
    body = {"model": CHAT, "prompt": PROMPT, "user": "alice"}
    assert sender.key(post("/v1/completions", body)) == "s." + b"alice".hex()
    # A prompt shorter than one block, a client's forged key: none
    forged = (("x-model-name", LM), ("x-infermesh-affinity", "p00"))
    assert sender.key(grpc_call(text_request("short"), headers=forged)) is None
    # A prefix model's request with no prompt to read falls back to the session header
    session = (("x-model-name", LM), ("x-session-id", "s1"))
    assert sender.key(grpc_call(text_request("tiny"), headers=session)) == "s." + b"s1".hex()
    assert sender.key(post(f"/v2/models/{LM}/infer", {"not": "kserve"})) is None
    assert sender.key(post("/v1/completions", {"model": LM, "prompt": "[broken"})) is None


def test_clusters_hash_with_bounded_load(envoy: tuple[Envoy, Path]) -> None:
    dump = json.loads(envoy[0].admin("/config_dump"))
    clusters = {
        c["cluster"]["name"]: c["cluster"]
        for config in dump["configs"]
        if config["@type"].endswith("ClustersConfigDump")
        for c in config["static_clusters"]
    }
    for name in (model_cluster(LM), rest_cluster(model_cluster(LM))):
        assert clusters[name]["lb_policy"] == "MAGLEV"
        bounded = clusters[name]["common_lb_config"]["consistent_hashing_lb_config"]
        assert bounded["hash_balance_factor"] == 125
    assert clusters[SERVERS_CLUSTER].get("lb_policy", "ROUND_ROBIN") != "MAGLEV"
