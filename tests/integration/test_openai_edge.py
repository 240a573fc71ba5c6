"""The OpenAI API through the real Envoy, configured by the real control plane, with API keys:
the official ``openai`` client, unchanged, sends its key as ``Authorization: Bearer`` and its
model in the JSON body; Envoy routes by that body, and the same tenants' rules, rate limits
and identity apply as to KServe calls. Errors are OpenAI's, so the client raises its own
exceptions; no message holds a secret."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from infermesh.api_keys import add_key, new_key
from model_server.generative.lm_reference import BOS_ID, init_weights
from model_server.generative.lm_reference import generate_greedy as reference_greedy
from tests.edge_mesh_support import LM, EdgeMesh, edge_mesh
from tests.support import metric_value, wait_for

pytestmark = pytest.mark.integration
PROMPT = "The mesh "


class Edge:
    def __init__(self, mesh: EdgeMesh, keys: dict[str, str]) -> None:
        self.mesh = mesh
        self.keys = keys
        self.base = f"http://{mesh.url}/v1"

    def client(self, who: str) -> openai.OpenAI:
        key = self.keys.get(who, who)
        return openai.OpenAI(base_url=self.base, api_key=key, max_retries=0, timeout=30)

    def post(self, who: str, path: str, body: Any, **headers: str) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        auth = {"authorization": f"Bearer {self.keys[who]}", "content-type": "application/json"}
        return httpx.post(
            f"http://{self.mesh.url}{path}", content=content, headers={**auth, **headers},
            timeout=30,
        )  # fmt: skip


@pytest.fixture(scope="module")
def edge(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    workdir = tmp_path_factory.mktemp("openai-edge")
    keys = {name: new_key(name) for name in ("team-a", "team-b", "team-slow", "team-any")}
    for key in keys.values():
        add_key(workdir / "api-keys", key)
    listener = {"auth": {"mode": "api_keys", "api_keys_file": str(workdir / "api-keys")}}
    limit = {"requests_per_s": 0.1, "burst": 2}  # one token every 10 s: the third call waits
    top = {
        "tenants": {
            "team-a": {"models": [LM, "classifier"]},
            "team-b": {"models": ["classifier"]},
            "team-slow": {"models": [LM], "model_rate_limits": {LM: limit}},
            "team-any": {"models": ["*"]},
        }
    }
    with edge_mesh(demo_repo, workdir, listener, top, lm=True) as mesh:
        yield Edge(mesh, keys)


def expected(prompt: str, max_tokens: int) -> str:
    ids = reference_greedy(init_weights(), [BOS_ID, *prompt.encode()], max_tokens)
    return bytes(i for i in ids if i < 256).decode("utf-8", "replace")


def test_the_openai_client_completes_through_envoy_with_a_bearer_key(edge: Edge) -> None:
    before = edge.mesh.served_for("team-a", LM)
    with edge.client("team-a") as client:
        answer = client.completions.create(model=LM, prompt=PROMPT, max_tokens=8)
        assert answer.choices[0].text == expected(PROMPT, 8)
        assert answer.usage is not None and answer.usage.completion_tokens == 8
        chunks = list(
            client.completions.create(
                model=LM, prompt=PROMPT, max_tokens=8, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected(PROMPT, 8)
        assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 10 + 8
        messages: Any = [{"role": "user", "content": "hi"}]
        chat = client.chat.completions.create(model=LM, messages=messages, max_tokens=6)
        assert chat.choices[0].finish_reason == "length"
        streamed = client.chat.completions.create(
            model=LM, messages=messages, max_tokens=6, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == chat.choices[0].message.content
        assert [m.id for m in client.models.list()] == [LM]
        assert client.models.retrieve(LM).id == LM
    # The servers counted them for the tenant Envoy proved (4 generations).
    assert edge.mesh.served_for("team-a", LM) == before + 4


def test_a_tenant_without_the_model_is_refused_and_a_bad_key_unauthenticated(edge: Edge) -> None:
    with edge.client("team-b") as client, pytest.raises(openai.PermissionDeniedError) as denied:
        client.completions.create(model=LM, prompt=PROMPT, max_tokens=2)
    assert "team-b may not use this model" in denied.value.message.replace("_", " ")
    secret = edge.keys["team-a"].partition(":")[2]
    key_id = edge.keys["team-a"].partition(":")[0]
    for wrong in (f"{key_id}:{secret[:-1]}x", secret, "team-a.nokey:" + secret):
        with edge.client(wrong) as client, pytest.raises(openai.AuthenticationError) as failed:
            client.completions.create(model=LM, prompt=PROMPT, max_tokens=2)
        assert secret not in str(failed.value.body) and secret not in failed.value.message
    with edge.client("team-b") as client, pytest.raises(openai.PermissionDeniedError):
        client.models.retrieve(LM)  # the model's description is the model's too


def test_a_tenant_lists_only_the_models_it_may_use(edge: Edge) -> None:
    """GET /v1/models through Envoy: team-b (the classifier only, which generates no text)
    sees no model, and no header it sends widens its list; team-any and team-a see the LM."""
    for who, listed in (("team-a", [LM]), ("team-any", [LM]), ("team-b", []), ("team-slow", [LM])):
        with edge.client(who) as client:
            assert [m.id for m in client.models.list()] == listed, who
    widened = httpx.get(
        f"{edge.base}/models", timeout=30,
        headers={"authorization": f"Bearer {edge.keys['team-b']}",
                 "x-infermesh-visible-models": LM},
    )  # fmt: skip
    assert widened.status_code == 200 and widened.json()["data"] == []
    with edge.client("team-b") as client, pytest.raises(openai.PermissionDeniedError):
        client.models.retrieve(LM)


def test_refusals_are_openais_errors_naming_the_field(edge: Edge) -> None:
    with edge.client("team-a") as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=LM, prompt=PROMPT, frequency_penalty=0.5)
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["param"] == "frequency_penalty"
        with pytest.raises(openai.PermissionDeniedError):  # not one of team-a's models
            client.completions.create(model="no-such-model", prompt=PROMPT)
        with pytest.raises(openai.BadRequestError) as tensor:
            client.completions.create(model="classifier", prompt=PROMPT)
        assert "does not generate text" in tensor.value.message
    with edge.client("team-any") as client, pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert "does not exist" in unknown.value.message
    answer = edge.post("team-a", "/v1/completions", {"prompt": PROMPT})
    assert answer.status_code == 400 and "model parameter" in answer.json()["error"]["message"]
    answer = edge.post("team-a", "/v1/completions", b"{not json")
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"


def test_the_body_router_reads_only_the_top_level_model(edge: Edge) -> None:
    """A "model" inside a message, escapes in the name, the model field after the messages:
    the route is chosen by the top-level field; a header naming another model than the body
    is refused by the server (Envoy routed and authorised by the header)."""
    nested = {
        "messages": [{"role": "user", "content": '{"model": "classifier"} "model": "x"'}],
        "metadata": {}, "max_tokens": 2, "model": "demo\\u005flm",
    }  # fmt: skip
    body = json.dumps(nested).replace("demo\\\\u005flm", "demo\\u005flm").encode()
    answer = edge.post("team-a", "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == LM
    bypass = edge.post("team-b", "/v1/completions", {"model": LM, "prompt": "x"},
                       **{"x-model-name": "classifier"})  # fmt: skip
    assert bypass.status_code == 400 and "x-model-name" in bypass.json()["error"]["message"]


def test_the_tenants_rate_limit_applies_to_v1(edge: Edge) -> None:
    with edge.client("team-slow") as client:
        for _ in range(2):
            client.completions.create(model=LM, prompt=PROMPT, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model=LM, prompt=PROMPT, max_tokens=1)
    assert "rate limited" in limited.value.message
    assert limited.value.response.headers.get("retry-after")


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b'{"model": "demo_lm", "prompt": "' + b"a" * 100_000 + b'"}', 413, "Too Large"),
        (b'{"model": "demo lm", "prompt": "x"}', 400, "model parameter"),  # not header-safe
        (b'{"model": "demo\\u0001lm", "prompt": "x"}', 400, "model parameter"),
        (b'{"model": "' + b"m" * 300 + b'", "prompt": "x"}', 400, "model parameter"),
        (b'{"prompt": "x", "model": ["demo_lm"]}', 400, "model parameter"),
        (b'{"prompt": "x", "model": 12}', 400, "model parameter"),
        (b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b', "model": "demo_lm"}', 400, "too deeply"),
        (b'{"model": "demo_lm", "prompt": "x", "stop": ["a","b","c","d","e"]}', 400, "stop"),
        (b'{"model": "demo_lm", "prompt": "x", "max_tokens": -5}', 400, "max_tokens"),
    ],
)
def test_hostile_bodies_at_the_edge(edge: Edge, body: bytes, status: int, words: str) -> None:
    answer = edge.post("team-any", "/v1/completions", body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and words in error["message"]


def test_a_client_gone_mid_stream_through_envoy_frees_its_sequence(edge: Edge) -> None:
    def counted(code: str) -> float:
        return sum(metric_value(s.metrics(), "inference_requests_total", model=LM, code=code)
                   for s in edge.mesh.servers)  # fmt: skip

    before = counted("CANCELLED")
    body = {"model": LM, "prompt": PROMPT, "max_tokens": 450, "stream": True}
    headers = {"authorization": f"Bearer {edge.keys['team-a']}"}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{edge.base}/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        assert next(line for line in response.iter_lines() if line.startswith("data: "))

    def freed() -> bool:
        used = sum(metric_value(s.metrics(), "kv_cache_blocks_used", model=LM)
                   for s in edge.mesh.servers)  # fmt: skip
        return used == 0 and counted("CANCELLED") == before + 1

    wait_for(freed, 20, "the stream Envoy cut to leave the engine")


def test_without_body_routing_the_list_is_still_narrowed(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The narrowing step used to come with the body router: with body_routing off every tenant
    listed every generative model. Clients name the model in x-model-name there."""
    workdir = tmp_path_factory.mktemp("openai-edge-header-routed")
    keys = {name: new_key(name) for name in ("team-a", "team-b")}
    for key in keys.values():
        add_key(workdir / "api-keys", key)
    listener = {
        "auth": {"mode": "api_keys", "api_keys_file": str(workdir / "api-keys")},
        "body_routing": False,
    }
    top = {"tenants": {"team-a": {"models": [LM]}, "team-b": {"models": ["classifier"]}}}
    with edge_mesh(demo_repo, workdir, listener, top, lm=True) as mesh:
        edge = Edge(mesh, keys)
        for who, listed in (("team-a", [LM]), ("team-b", [])):
            with edge.client(who) as client:
                assert [m.id for m in client.models.list()] == listed, who
        with edge.client("team-a") as client:  # and the model still answers by its header
            answer = client.completions.create(
                model=LM, prompt=PROMPT, max_tokens=4, extra_headers={"x-model-name": LM}
            )
            assert answer.choices[0].text == expected(PROMPT, 4)
