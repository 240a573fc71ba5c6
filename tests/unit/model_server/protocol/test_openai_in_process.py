"""The OpenAI API over the REST server in process (aiohttp's test server, no subprocess): it
takes the one request path, so injected faults, the drain gate and a route's fallback apply
to it as to ModelInfer; an error once a stream has begun is one SSE error event and the end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from infermesh.wire import FALLBACK_HEADER, MODEL_HEADER
from model_server.protocol.rest import RestServer
from model_server.protocol.service import InferenceService

BODY = {"model": "demo_lm", "prompt": "hello", "max_tokens": 8}


@pytest.fixture
async def api(
    lm_service: InferenceService,
) -> AsyncIterator[tuple[TestClient[Any, Any], InferenceService]]:
    rest = RestServer(lm_service, 1 << 20)
    async with TestClient(TestServer(rest.app)) as client:
        yield client, lm_service


def _events(raw: str) -> list[Any]:
    return [
        line[6:] if line == "data: [DONE]" else json.loads(line[6:])
        for line in raw.split("\n\n")
        if line.startswith("data: ")
    ]


def fail_after_two_steps(service: InferenceService) -> list[int]:
    """The demo LM's decoder fails ("device lost") after the prefill and one decode step: two
    tokens made. Returns its call count, which a test clears to start a generation over."""
    engine: Any = service.repository.resolve("demo_lm", "").scheduler
    decode: Callable[[Mapping[str, np.ndarray]], Any] = engine.engine._decoder
    calls: list[int] = []

    def failing(feeds: Mapping[str, np.ndarray]) -> Any:
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("device lost")
        return decode(feeds)

    engine.engine._decoder = failing
    return calls


async def test_an_error_mid_stream_is_one_error_event_then_the_end(
    api: tuple[TestClient[Any, Any], InferenceService],
) -> None:
    client, service = api
    fail_after_two_steps(service)
    response = await client.post("/v1/completions", json={**BODY, "stream": True})
    assert response.status == 200
    events = _events(await response.text())
    assert all("choices" in e for e in events[:-1])
    assert events[-1]["error"]["type"] == "server_error"
    assert "device lost" in events[-1]["error"]["message"]
    assert "[DONE]" not in events


async def test_a_whole_answer_cut_off_charges_the_tokens_it_made(
    api: tuple[TestClient[Any, Any], InferenceService],
) -> None:
    """Cut off after two tokens (a model failing, or unloading: UNAVAILABLE, which before any
    work means a full refund), the edge is told what was made: the prompt and two tokens."""
    client, service = api
    chat = {"model": "demo_lm", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    chat_prompt = (await (await client.post("/v1/chat/completions", json=chat)).json())["usage"]
    calls = fail_after_two_steps(service)
    for path, body, prompt in (
        ("/v1/completions", BODY, 6),  # BOS and "hello"
        ("/v1/chat/completions", chat, chat_prompt["prompt_tokens"]),
    ):
        calls.clear()
        response = await client.post(path, json=body)
        assert response.status == 500, await response.text()
        assert response.headers["x-infermesh-tokens-used"] == str(prompt + 2), path


async def test_faults_and_the_drain_apply_as_on_every_path(
    api: tuple[TestClient[Any, Any], InferenceService],
) -> None:
    client, service = api
    service.faults.apply({"error_rate": 1.0})
    for stream in (False, True):  # before the first token: a plain error, not a stream
        response = await client.post("/v1/completions", json={**BODY, "stream": stream})
        assert response.status == 503
        assert (await response.json())["error"]["message"] == "injected fault"
    service.faults.apply({"reset": True})
    service.gate.refusing = True
    response = await client.post("/v1/chat/completions", json={
        "model": "demo_lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
    })  # fmt: skip
    assert response.status == 503 and "draining" in (await response.json())["error"]["message"]
    assert service.gate.in_flight == 0


async def test_a_fallback_generates_and_the_model_header_must_match_the_body(
    api: tuple[TestClient[Any, Any], InferenceService],
) -> None:
    client, _ = api
    response = await client.post(
        "/v1/completions", json={**BODY, "model": "demo_lm_large"},
        headers={FALLBACK_HEADER: "demo_lm"},
    )  # fmt: skip
    assert response.status == 200 and (await response.json())["model"] == "demo_lm"
    response = await client.post("/v1/completions", json=BODY, headers={MODEL_HEADER: "other"})
    assert response.status == 400  # Envoy routed and authorised by the header: they must agree
    assert MODEL_HEADER in (await response.json())["error"]["message"]


async def test_paths_and_methods_outside_the_api_answer_in_its_shape(
    api: tuple[TestClient[Any, Any], InferenceService],
) -> None:
    client, _ = api
    response = await client.get("/v1/completions")
    assert response.status == 405 and "error" in await response.json()
    response = await client.get("/v1/embeddings")
    body = await response.json()
    assert response.status == 404 and body["error"]["type"] == "not_found_error"
    response = await client.post("/v1/completions", data=b"x" * (2 << 20))
    assert response.status == 413 and "limit" in (await response.json())["error"]["message"]


async def test_a_chat_without_a_usable_model_name_is_400_naming_it(
    api: tuple[TestClient[Any, Any], InferenceService],
) -> None:
    client, _ = api
    for model in ("", 7, None):
        body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status == 400 and (await response.json())["error"]["param"] == "model"
