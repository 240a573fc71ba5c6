"""Token limits per tenant and model through the real Envoy, the real control plane (its token
limiter) and a real model server with the demo LM.

Admission reserves each request's bound (max_tokens plus the prompt's bound) and the end of the
request refunds what it did not use, so: a tenant over its budget gets RESOURCE_EXHAUSTED / 429
with retry-after and a message naming the limit; short completions let it go on; another
tenant is unaffected; concurrent requests never admit more than the burst. Hostile requests
(huge or negative max_tokens, forged x-infermesh-* headers) change none of it.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import itertools
import json
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from control_plane.xds.bootstrap import TOKEN_LIMITER_CLUSTER, XdsTls
from infermesh import pki
from infermesh.api_keys import add_key, basic_authorization, new_key
from model_server.demo_lm import build_demo_lm
from tests.edge_mesh_support import OFFSET
from tests.envoy_support import free_port, free_port_pair
from tests.integration.test_mtls_mesh import NODE, start_tls_server
from tests.mesh_support import ControlPlaneThread, start_ads_envoy, write_topology
from tests.support import MODEL, ROOT, metric_value, start_server, text_request, wait_for

pytestmark = pytest.mark.integration

BURST = 300
# 60 tokens a minute: one a second, so the refill is small next to what the tests spend.
LIMIT = {"tokens_per_minute": 60, "burst": BURST}
TENANTS = (
    "team-a",
    "team-b",
    "team-c",
    "team-d",
    "team-e",
    "team-f",
    "team-g",
    "team-h",
    "team-i",
    "team-j",
)


@dataclass
class TokenMesh:
    plane: ControlPlaneThread
    port: int
    keys: dict[str, str]
    server: Any  # the model server's process (tests/support.ServerProcess)

    def metadata(self, who: str, **more: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", basic_authorization(self.keys[who])), *more.items())

    def generate(self, who: str, max_tokens: int, **more: str) -> tuple[str, Any]:
        """One ModelInfer: ("OK", tokens used) or (status name, the error)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            request = text_request("Once ", max_tokens=max_tokens)
            try:
                _, call = stub.ModelInfer.with_call(
                    request, metadata=self.metadata(who, **more), timeout=60
                )
            except grpc.RpcError as error:
                return error.code().name, error
            used = dict(call.trailing_metadata() or ()).get("x-infermesh-tokens-used")
            return "OK", int(used) if used is not None else None

    def available(self, who: str) -> float | None:
        return self.plane.plane.token_limiter.ledger.available(who, MODEL)

    def counted(self, who: str, event: str) -> float:
        text = self.plane.admin_get("/metrics")
        return metric_value(text, "tenant_tokens_total", tenant=who, model=MODEL, event=event)

    def settled(self, who: str, tokens: float) -> None:
        """Waits (bounded) for the settlement Envoy sends once the stream is done."""
        wait_for(lambda: self.counted(who, "used") >= tokens, 10, f"{who}'s settlement")


def stop_once(plane: ControlPlaneThread) -> None:
    if plane.thread.is_alive():
        plane.stop()


@contextlib.contextmanager
def token_mesh(
    workdir: Path, replicas: int = 1, tls: bool = False
) -> Iterator[tuple[TokenMesh, list[Any]]]:
    """One demo LM server, ``replicas`` control planes (the first Envoy's token limiter), Envoy;
    ``tls``: mutual TLS to the server and on the xDS port (the token limiter's too)."""
    repo = workdir / "models"
    built = ROOT / "models" / MODEL
    if (built / "1" / "model.onnx").exists():
        shutil.copytree(built, repo / MODEL)
    else:
        build_demo_lm(repo)
    keys = {who: new_key(who) for who in TENANTS}
    for key in keys.values():
        add_key(workdir / "api-keys", key)
    with contextlib.ExitStack() as stops:
        port = free_port_pair(OFFSET)
        top: dict[str, Any] = {}
        envoy_tls = None
        if tls:  # ready once Envoy finds it healthy (a plaintext probe cannot ask it)
            pki_dir = workdir / "pki"
            authority = pki.init_authority(pki_dir)
            address = f"127.0.0.1:{port}"
            for who in (pki.envoy(NODE), pki.control_plane(), pki.model_server(address)):
                pki.issue(authority, who, pki_dir)
            server = start_tls_server(pki_dir, repo, workdir / "s1", address)
            top = {
                "listener": {"upstream_tls": {"pki_dir": str(pki_dir)}},
                "xds": {"host": "127.0.0.1", "port": 18000, "tls": True},
                "telemetry": {"tls": True},
            }
            envoy_tls = XdsTls(str(pki_dir), authority.trust_domain)
        else:
            server = start_server(
                repo, workdir / "s1", "--models", MODEL, "--port", str(port),
                "--http-port", str(port + OFFSET),
            )  # fmt: skip
        stops.callback(server.stop)
        listener_port = free_port()
        lm = {"name": MODEL, "sla_p99_ms": 5000, "capacity_qps": 50, "generative": True}
        tenants = {who: {"model_token_limits": {MODEL: LIMIT}} for who in TENANTS}
        auth = {"mode": "api_keys", "api_keys_file": str(workdir / "api-keys")}
        topology = write_topology(
            workdir / "topology.yaml", listener_port, [server.url], more_models=[lm],
            top={**top, "listener": {**top.get("listener", {}), "auth": auth},
                 "tenants": tenants},
        )  # fmt: skip
        planes = []
        for _ in range(replicas):
            plane = ControlPlaneThread(topology, otlp_port=free_port())
            stops.callback(stop_once, plane)  # a test may stop one itself
            planes.append(plane)
        envoy = start_ads_envoy(
            workdir,
            [p.plane.xds_port for p in planes],
            listener_port,
            False,
            xds_tls=envoy_tls,
        )
        stops.callback(envoy.stop)
        # The model's own cluster: the token limiter's static cluster reads healthy from the
        # start. (Probes Envoy answers itself settle 0 now, but each still costs a round trip
        # to the limiter and a refused call.)
        wait_for(
            lambda: "healthy" in envoy.host_stats(f"model:{MODEL}", "health_flags").values(),
            30,
            "a healthy server",
        )
        mesh = TokenMesh(planes[0], listener_port, keys, server)
        last: list[tuple[str, Any]] = []

        def answered() -> bool:
            last[:] = [mesh.generate("team-d", 1)]
            return last[0][0] == "OK"

        try:
            wait_for(answered, 30, "the demo LM through Envoy", interval=0.5)
        except TimeoutError as exc:  # say what Envoy answered and how it saw the limiter
            limiter = [line for line in envoy.admin("/clusters").splitlines()
                       if line.startswith(TOKEN_LIMITER_CLUSTER) and "::cx_" in line]  # fmt: skip
            raise TimeoutError(f"{exc}; last answer {last}; limiter {limiter}") from None
        yield mesh, planes


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenMesh]:
    with token_mesh(tmp_path_factory.mktemp("edge-tokens")) as (mesh, _):
        yield mesh


def test_refunds_let_a_tenant_go_on_after_short_completions(mesh: TokenMesh) -> None:
    """Ten requests reserving about 80 tokens each (800 > the burst of 300) all pass: each
    refunds what it did not use."""
    total = 0
    for _ in range(10):
        outcome, used = mesh.generate("team-a", 8)
        assert outcome == "OK", used
        assert used is not None and 1 + len("Once ") <= used <= 1 + len("Once ") + 9
        total += used
    mesh.settled("team-a", total)
    assert mesh.counted("team-a", "reserved") > BURST  # reserved more than the burst in all
    assert mesh.counted("team-a", "refunded") > 0


def test_over_the_budget_is_refused_with_retry_after_naming_the_limit(mesh: TokenMesh) -> None:
    outcome, first = mesh.generate("team-b", 200)  # reserves about 270 of 300, uses ~206
    assert outcome == "OK", first
    mesh.settled("team-b", first)
    outcome, error = mesh.generate("team-b", 200)  # about 94 left: refused before it runs
    assert outcome == "RESOURCE_EXHAUSTED", error
    trailers = dict(error.trailing_metadata() or ())
    assert int(trailers["retry-after"]) >= 1
    assert trailers["x-infermesh-rate-limited"] == "tokens"
    message = error.details()
    assert "token limit" in message and "'team-b'" in message and f"'{MODEL}'" in message
    assert "60 tokens/min" in message
    # REST: 429, JSON, the same words.
    body = json.dumps(
        {
            "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                        "data": ["Once "]}],
            "parameters": {"max_tokens": 200},
        }
    ).encode()  # fmt: skip
    status, headers, reply = rest(mesh, "team-b", body)
    assert status == 429, reply
    assert int(headers["retry-after"]) >= 1
    assert "60 tokens/min" in json.loads(reply)["error"]
    # Another tenant with the same limit is unaffected.
    assert mesh.generate("team-a", 8)[0] == "OK"


def rest(
    mesh: TokenMesh, who: str, body: bytes, path: str = f"/v2/models/{MODEL}/infer", **more: str
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", mesh.port, timeout=60)
    try:
        headers = {"content-type": "application/json",
                   "authorization": basic_authorization(mesh.keys[who]), **more}  # fmt: skip
        connection.request("POST", path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def test_a_bound_the_admission_script_cannot_read_reserves_the_whole_context(
    mesh: TokenMesh,
) -> None:
    """A max_tokens the script cannot read (a key spelled with a JSON escape, which the server's
    parser honours; a gzip body or a compressed gRPC message, which the server inflates) or a
    chat without one (the server's default is the rest of the context) reserves the model's
    context, 512 tokens: more than this burst of 300, so each is refused before any work.
    Before, each reserved the body plus 32 and could generate up to 200 (or 480) tokens."""
    kserve = json.dumps(
        {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Once "]}],
         "parameters": {"max_tokens": 200}}
    ).encode()  # fmt: skip
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Once"}]}
    cases = [
        ("/v1/completions", b'{"model": "demo_lm", "prompt": "Once ", "max_tok\\u0065ns": 200}',
         {}),
        ("/v1/chat/completions", json.dumps(chat).encode(), {}),
        (f"/v2/models/{MODEL}/infer", gzip.compress(kserve), {"content-encoding": "gzip"}),
    ]  # fmt: skip
    for path, body, more in cases:
        status, _, reply = rest(mesh, "team-c", body, path, **more)
        assert status == 429, (path, reply)
        assert b"more than the burst" in reply and b"burst 300" in reply, (path, reply)
    with grpc.insecure_channel(
        f"127.0.0.1:{mesh.port}", compression=grpc.Compression.Gzip
    ) as channel:  # a compressed gRPC message (sent plain unless gzip makes it smaller)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            request = text_request("a" * 100, max_tokens=200)
            named = mesh.metadata("team-c", **{"x-model-name": MODEL})  # the body is unread
            stub.ModelInfer(request, metadata=named, timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert "more than the burst" in (refused.value.details() or "")
    # An escape in a value, not a key, is read as before: 8 tokens asked, answered.
    body = b'{"model": "demo_lm", "prompt": "Caf\\u00e9 ", "max_tokens": 8}'
    status, _, reply = rest(mesh, "team-c", body, "/v1/completions")
    assert status == 200, reply
    assert json.loads(reply)["usage"]["completion_tokens"] <= 8


def _varint(value: int, width: int = 0) -> bytes:
    """``value`` as a protobuf varint, padded to ``width`` bytes when given."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if not value and len(out) + 1 >= width:
            return bytes(out + bytes([byte]))
        out.append(byte | 0x80)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_grpc_bodies_are_read_as_the_servers_parser_reads_them(mesh: TokenMesh) -> None:
    """Two messages protobuf parses one way and the script's walk read another, so 200 tokens
    ran against a reservation of the body plus 32 (a review found both; the server's parser
    reads max_tokens 200 from each): an unknown group before the parameters, where the walk
    stopped (now: unread, so the whole context, more than this burst), and a max_tokens
    varint padded to 10 bytes, whose bits past 64 protobuf drops and the script did not (now
    read as 200, and reserved so)."""
    plain = text_request("Once ")  # no max_tokens: each case adds it as it spells it
    assert "max_tokens" not in plain.parameters
    max_tokens = _field(1, b"max_tokens") + _field(2, b"\x10" + _varint(200))
    padded = _varint(200 + (1 << 65), 10)[:9] + b"\x02"  # bit 65 set: 200 to protobuf
    padded_tokens = _field(1, b"max_tokens") + _field(2, b"\x10" + padded)
    grouped = b"\x7b\x7c" + plain.SerializeToString() + _field(4, max_tokens)
    long_varint = plain.SerializeToString() + _field(4, padded_tokens)
    for body in (grouped, long_varint):
        assert (
            service_pb2.ModelInferRequest.FromString(body).parameters["max_tokens"].int64_param
            == 200
        )

    def infer(who: str, body: bytes) -> Any:
        with grpc.insecure_channel(f"127.0.0.1:{mesh.port}") as channel:
            call = channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=lambda raw: raw,
                response_deserializer=service_pb2.ModelInferResponse.FromString,
            )
            return call(body, metadata=mesh.metadata(who, **{"x-model-name": MODEL}), timeout=60)

    with pytest.raises(grpc.RpcError) as refused:
        infer("team-i", grouped)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    assert "more than the burst" in (refused.value.details() or "")
    infer("team-j", long_varint)
    assert mesh.counted("team-j", "reserved") >= 200 + len(long_varint)


def test_many_escapes_in_a_value_leave_max_tokens_readable(mesh: TokenMesh) -> None:
    """A prompt of 4,000 escapes (the listener buffers 32 KiB of body by default): the key
    check is one pass now (the Lua pattern it replaces backtracked, time quadratic in the
    body), and an escape in a value, not a key, still leaves max_tokens read."""
    prompt = "\\u0041" * 4_000
    body = b'{"model": "demo_lm", "max_tokens": 8, "prompt": "' + prompt.encode() + b'"}'
    status, _, reply = rest(mesh, "team-i", body, "/v1/completions")
    # The body's bytes bound its prompt tokens, more than this burst: refused, saying what it
    # reserved, which is the body plus the 8 asked (the context would be the body plus 512).
    assert status == 429, reply
    assert f"reserves {len(body) + 8} tokens".encode() in reply, reply


def test_the_openai_api_reserves_and_refunds_like_the_others(mesh: TokenMesh) -> None:
    """The openai client through Envoy (a Bearer key): a whole answer reports its tokens, so
    ten short completions (about 80 tokens reserved each, 800 > the burst) all pass; one that
    asks for more than is left is 429, which the client raises as RateLimitError."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{mesh.port}/v1", api_key=mesh.keys["team-f"],
        max_retries=0, timeout=60,
    )  # fmt: skip
    used = 0
    for _ in range(10):
        answer = client.completions.create(model=MODEL, prompt="Once ", max_tokens=8)
        assert answer.usage is not None
        used += answer.usage.total_tokens
    mesh.settled("team-f", used)
    assert mesh.counted("team-f", "refunded") > 0
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=MODEL, prompt="Once ", max_tokens=290)
    assert "60 tokens/min" in str(refused.value)


def test_a_token_limited_stream_is_not_held_back_by_the_admission_script(
    mesh: TokenMesh,
) -> None:
    """The admission script reads a response's trailers (a gRPC stream's usage) and a streamed
    OpenAI answer's usage comment: neither may hold the answer back. Tokens arrive one by one,
    and the stream's usage settles its reservation (the unused part is refunded)."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{mesh.port}/v1", api_key=mesh.keys["team-g"],
        max_retries=0, timeout=60,
    )  # fmt: skip
    arrivals: list[float] = []
    started = time.perf_counter()
    stream = client.completions.create(
        model=MODEL, prompt="Once ", max_tokens=160, stream=True, temperature=0,
        stream_options={"include_usage": True},
    )  # fmt: skip
    total = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter() - started)
        if chunk.usage is not None:
            total = chunk.usage.total_tokens
    assert len(arrivals) >= 100, len(arrivals)
    # Held back, the pieces would arrive together at the end, in one read of a few kB (microseconds
    # apart); streamed, they come as the ~160 tokens are generated, 0.25-1 ms apart by the host
    # (a reader that falls behind may take a few in one read).
    apart = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    spread = sum(1 for gap in apart if gap > 0.0001)
    print(f"\n{len(arrivals)} pieces over {arrivals[-1] - arrivals[0]:.3f} s, {spread} apart")
    assert spread >= 20, (arrivals[:3], arrivals[-3:])
    assert total > 0
    mesh.settled("team-g", total)
    assert mesh.counted("team-g", "refunded") > 0  # reserved 160 + the body, used fewer


def test_concurrent_requests_never_admit_more_than_the_burst(mesh: TokenMesh) -> None:
    """Twelve requests at once, each reserving about 130 tokens: two fit in the burst of 300;
    the tokens the admitted ones used stay within the burst plus the refill."""
    results: list[tuple[str, Any]] = []
    lock = threading.Lock()
    start = threading.Barrier(12)

    def one() -> None:
        start.wait()
        result = mesh.generate("team-c", 64)
        with lock:
            results.append(result)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    admitted = [used for outcome, used in results if outcome == "OK"]
    refused = [outcome for outcome, _ in results if outcome != "OK"]
    assert len(results) == 12
    assert set(refused) <= {"RESOURCE_EXHAUSTED"}
    assert 1 <= len(admitted) <= 3, results  # 2 fit; the refill may add one
    assert sum(admitted) <= BURST + 60


def test_hostile_max_tokens_and_forged_headers_change_nothing(mesh: TokenMesh) -> None:
    before = mesh.available("team-d")
    outcome, error = mesh.generate("team-d", 10**12)  # far past any burst
    assert outcome == "RESOURCE_EXHAUSTED", error
    assert "more than the burst" in error.details()
    outcome, error = mesh.generate("team-d", -5)  # reserved as 0 more; the server refuses it
    assert outcome == "INVALID_ARGUMENT", error
    wait_for(
        lambda: (mesh.available("team-d") or 0) >= (before or BURST) - 1,
        10,
        "the refused request's reservation refunded",
    )
    # The same over REST: the server's 400 says 0 tokens used, and the reservation comes back.
    body = json.dumps(
        {
            "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                        "data": ["Once "]}],
            "parameters": {"max_tokens": -5},
        }
    ).encode()  # fmt: skip
    status, headers, reply = rest(mesh, "team-d", body)
    assert status == 400 and headers["x-infermesh-tokens-used"] == "0", reply
    wait_for(
        lambda: (mesh.available("team-d") or 0) >= (before or BURST) - 1,
        10,
        "the refused REST request's reservation refunded",
    )
    # Forged identity and usage headers are dropped at the edge: the key's tenant pays.
    forged = {"x-infermesh-tenant-label": "team-a", "x-infermesh-tokens-used": "0"}
    spent = mesh.counted("team-d", "reserved")
    others = mesh.counted("team-a", "reserved")
    assert mesh.generate("team-d", 8, **forged)[0] == "OK"
    assert mesh.counted("team-d", "reserved") > spent
    assert mesh.counted("team-a", "reserved") == others


def test_a_stream_reserves_at_most_the_burst_and_settles_its_usage_when_it_closes(
    mesh: TokenMesh,
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{mesh.port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = (*mesh.metadata("team-e"), ("x-model-name", MODEL))
        requests = iter([text_request("Once ", max_tokens=8), text_request("Twice ", max_tokens=8)])
        call = stub.ModelStreamInfer(requests, metadata=metadata, timeout=60)
        answers = list(call)
        used = int(dict(call.trailing_metadata() or ())["x-infermesh-tokens-used"])
    assert answers and not any(a.error_message for a in answers)
    assert 1 + len("Once ") + 1 + len("Twice ") <= used <= 1 + len("Once Twice ") + 1 + 18
    mesh.settled("team-e", used)
    assert mesh.counted("team-e", "reserved") == BURST  # the stream bound, clamped to the burst
    wait_for(
        lambda: (mesh.available("team-e") or 0) >= BURST - used - 1,
        10,
        "the stream's unused reservation refunded",
    )


def test_a_stream_the_client_keeps_open_is_charged_what_it_used(mesh: TokenMesh) -> None:
    """An interactive client (tritonclient's start_stream) sends its next request after the
    first answer: the server's answer headers leave before the client's side is complete, so
    Envoy adds no x-envoy-upstream-service-time. On the code before, the script took that for
    a reply Envoy made itself and settled 0: every such stream was free."""
    answered = threading.Event()

    def interactive() -> Iterator[Any]:
        yield text_request("Once ", max_tokens=8)
        answered.wait(30)  # the side stays open until the first answer is back
        yield text_request("Twice ", max_tokens=8)

    before = mesh.counted("team-h", "used")
    with grpc.insecure_channel(f"127.0.0.1:{mesh.port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = (*mesh.metadata("team-h"), ("x-model-name", MODEL))
        call = stub.ModelStreamInfer(interactive(), metadata=metadata, timeout=60)
        answers = []
        for answer in call:
            answers.append(answer)
            answered.set()
        used = int(dict(call.trailing_metadata() or ())["x-infermesh-tokens-used"])
    assert answers and not any(a.error_message for a in answers)
    assert used > len("Once Twice ")
    mesh.settled("team-h", before + used)


def test_the_limiter_unreachable_refuses_by_default(mesh: TokenMesh) -> None:
    """listener.auth.token_limiter is closed by default: no answer, no admission (UNAVAILABLE)."""
    limiter = mesh.plane.plane.token_limiter

    def broken(request: Any) -> Any:
        raise RuntimeError("limiter down")

    original = limiter.decide
    limiter.decide = broken  # type: ignore[method-assign]
    try:
        outcome, error = mesh.generate("team-e", 8)
    finally:
        limiter.decide = original  # type: ignore[method-assign]
    assert outcome == "UNAVAILABLE", error
    assert mesh.generate("team-e", 8)[0] == "OK"


def test_a_request_no_model_server_answered_is_not_charged(tmp_path: Path) -> None:
    """With the only server stopped, Envoy answers every call itself (UNAVAILABLE): each one
    reserved more than half the burst and settles 0, so the next is not refused for tokens and
    the tenant's budget is whole again once the server is back. (Before, each such reservation
    stayed charged: the second call was RESOURCE_EXHAUSTED for tokens no model spent.)"""
    with token_mesh(tmp_path) as (mesh, _):
        mesh.server.stop()
        for call in range(1, 5):
            outcome, error = mesh.generate("team-f", 200)  # reserves 200 + the body's bytes
            assert outcome == "UNAVAILABLE", error
            wait_for(
                lambda: mesh.counted("team-f", "refunded") >= 200 * call,  # noqa: B023
                10,
                "the reservation of a call Envoy answered itself given back",
            )
        assert mesh.counted("team-f", "used") == 0
        available = mesh.available("team-f")
        assert available is not None and available > BURST - 200, available


def test_two_replicas_keep_one_ledger_and_the_second_takes_over(tmp_path: Path) -> None:
    """Envoy asks the first control-plane replica only, so a tenant's budget is one ledger; with
    the first one stopped, the second answers (its ledger starting full), after at most a few
    refusals (the limiter closed while the first is being ejected)."""
    with token_mesh(tmp_path, replicas=2) as (mesh, (first, second)):
        for _ in range(3):
            assert mesh.generate("team-a", 8)[0] == "OK"
        assert (first.plane.token_limiter.ledger.available("team-a", MODEL) or BURST) < BURST
        assert second.plane.token_limiter.ledger.available("team-a", MODEL) is None
        first.stop()
        outcomes: list[str] = []

        def served() -> bool:
            outcomes.append(mesh.generate("team-a", 8)[0])
            return outcomes[-1] == "OK"

        wait_for(served, 30, "the second replica answering for the token limit")
        assert set(outcomes) <= {"OK", "UNAVAILABLE"}, outcomes
        assert second.plane.token_limiter.ledger.available("team-a", MODEL) is not None


def test_over_mutual_tls_the_limiter_answers_the_mesh_envoy(tmp_path: Path) -> None:
    """xds.tls on: Envoy reaches the token limiter with its mesh certificate (an Envoy's, so it
    may reserve and settle); reservations, refunds and refusals work as in plaintext."""
    with token_mesh(tmp_path, tls=True) as (mesh, _):
        outcome, used = mesh.generate("team-b", 200)
        assert outcome == "OK", used
        mesh.settled("team-b", used)
        assert mesh.counted("team-b", "refunded") > 0
        outcome, error = mesh.generate("team-b", 200)
        assert outcome == "RESOURCE_EXHAUSTED", error
        assert "60 tokens/min" in error.details()
