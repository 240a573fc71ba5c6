"""The OpenAI API of a real model server, with the official ``openai`` client unchanged: the
demo LM's completions and chat, streamed and whole, equal the numpy reference's greedy
decoding; refusals are OpenAI's errors naming the field; a client gone mid-stream frees its
sequence."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from model_server.demo_lm import DEMO_CHAT_TEMPLATE, DEMO_GENERATION_PROMPT, build_demo_lm
from model_server.generative.lm_reference import BOS_ID, init_weights
from model_server.generative.lm_reference import generate_greedy as reference_greedy
from tests.support import MODEL, ServerProcess, metric_value, start_server, wait_for

pytestmark = pytest.mark.integration
PROMPT = "The mesh "
MAX_REQUEST_BYTES = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("lm-repo")
    build_demo_lm(repo)
    server = start_server(
        repo, tmp_path_factory.mktemp("lm-logs"), "--models", MODEL,
        "--max-request-bytes", str(MAX_REQUEST_BYTES),
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0,
        timeout=30,
    ) as client:  # fmt: skip
        yield client


def expected(prompt: str, max_tokens: int) -> str:
    ids = reference_greedy(init_weights(), [BOS_ID, *prompt.encode()], max_tokens)
    return bytes(i for i in ids if i < 256).decode("utf-8", "replace")


def chat_prompt(*messages: tuple[str, str]) -> str:
    parts = [DEMO_CHAT_TEMPLATE.replace("{role}", r).replace("{content}", c) for r, c in messages]
    return "".join(parts) + DEMO_GENERATION_PROMPT


def test_completion_is_the_reference_greedy_text_with_usage(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    choice = answer.choices[0]
    assert answer.object == "text_completion" and answer.model == MODEL
    assert choice.text == expected(PROMPT, 12)
    assert choice.finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == 1 + len(PROMPT.encode())  # BOS + one per byte
    assert answer.usage.completion_tokens == 12
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12


def test_streamed_completion_equals_the_whole_one_with_usage_last(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected(PROMPT, 12)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and reasons.count("length") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_goes_through_the_models_template(client: openai.OpenAI) -> None:
    messages: Any = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    prompt = chat_prompt(("system", "Be brief."), ("user", "Hello"))
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected(prompt, 10)
    assert answer.usage is not None and answer.usage.prompt_tokens == 1 + len(prompt.encode())
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, stream=True
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected(prompt, 10)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_sequences_end_the_text_before_them(client: openai.OpenAI) -> None:
    prompt = "abcabcabc"  # the demo LM's greedy text: "ccccccccc" then "N"s (ASCII)
    full = expected(prompt, 24)
    assert full.startswith("cccccccccNNN"), full
    answer = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, stop=["never", "cN"]
    )
    assert answer.choices[0].text == "cccccccc"
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage is not None and answer.usage.completion_tokens == 10
    chunks = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, stop="ccN", stream=True
    )  # "cc" is held back until it is known not to begin the stop sequence
    assert "".join(c.choices[0].text for c in chunks) == "ccccccc"


def test_sampling_is_seeded_and_a_tiny_top_p_is_greedy(client: openai.OpenAI) -> None:
    def sample(**extra: Any) -> str:
        answer = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.5, **extra
        )
        return answer.choices[0].text

    assert sample(seed=7) == sample(seed=7)
    assert sample(seed=7, top_p=1e-9) == expected(PROMPT, 16)
    assert sample(seed=7, extra_body={"top_k": 1}) == expected(PROMPT, 16)


def test_models_lists_the_generative_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "infermesh"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logprobs": 2}, "logprobs"),
        ({"n": 2}, "n"),
        ({"echo": True}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"seed": -1}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": "x" * 300}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"mystery": 1}, "mystery"),
    ],
)
def test_refusals_name_the_field(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and param in error["message"]


def test_unknown_model_is_404_in_openais_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt=PROMPT)
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "model_not_found"


def test_the_routed_model_is_checked_before_the_body_model_is_looked_up(
    server: ServerProcess,
) -> None:
    """The edge routed by the header's model: a body naming another one is refused the same way
    whether that model exists or not, so a tenant cannot probe for models it may not use."""
    answers = []
    for other in ("nope", "classifier", MODEL + "-missing"):
        body = json.dumps({"model": other, "prompt": "x", "max_tokens": 1}).encode()
        for path in ("/v1/completions", "/v1/chat/completions"):
            answers.append(_post(server, path, body, {"x-model-name": MODEL}))
    assert {code for code, _ in answers} == {400}, answers
    assert all("header x-model-name: names model" in a["error"]["message"] for _, a in answers)


def _post(
    server: ServerProcess, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.http_port}{path}", data=body,
        headers={"Content-Type": "application/json", **(headers or {})},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "nests too deeply"),
        # The edge reserves tokens from the first max_tokens; the parser would keep the last.
        (
            b'{"model": "demo_lm", "prompt": "x", "max_tokens": 1, "max_tokens": null}',
            400,
            "key 'max_tokens' appears more than once",
        ),
        # UTF-16 hides max_tokens from the edge's byte patterns; json.loads(bytes) took it.
        (
            '{"model": "demo_lm", "prompt": "x", "max_tokens": 480}'.encode("utf-16-le"),
            400,
            "not valid JSON",
        ),
        (
            '{"model": "demo_lm", "prompt": "\u00e9"}'.encode("latin-1"),
            400,
            "JSON must be UTF-8; byte 32 is not",
        ),
        (b'{"model": "demo_lm", "prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}', 413, "limit"),
        (b'{"model": 5, "prompt": "x"}', 400, "model"),
        (b'{"model": "demo_lm", "prompt": [1, 2, 3]}', 400, "token ids"),
        (b'{"model": "demo_lm", "prompt": "' + b"a" * 600 + b'"}', 400, "context length"),
        (b'{"model": "demo_lm", "prompt": "\\ud800"}', 400, "prompt: a string holds a lone"),
        (
            b'{"model": "demo_lm", "messages": [{"role": "user", "content": "\\udfff"}]}',
            400,
            "messages[0].content",
        ),
        (
            b'{"model": "demo_lm", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}",
            400,
            "temperature: must be",
        ),
    ],
)
def test_hostile_bodies_get_openai_errors(
    server: ServerProcess, body: bytes, status: int, words: str
) -> None:
    code, answer = _post(server, "/v1/completions", body)
    assert code == status, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert words in answer["error"]["message"], answer


def test_chat_refuses_what_the_template_cannot_say(server: ServerProcess) -> None:
    for messages, param in [
        ([{"role": "tool", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x", "name": "bob"}], "messages[0].name"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
        ([], "messages"),
    ]:
        body = json.dumps({"model": MODEL, "messages": messages}).encode()
        code, answer = _post(server, "/v1/chat/completions", body)
        assert code == 400 and answer["error"]["param"] == param, answer


def _counted(server: ServerProcess, code: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        metrics = r.read().decode()
    return metric_value(metrics, "inference_requests_total", model=MODEL, code=code)


def test_a_finished_stream_is_counted_ok(client: openai.OpenAI, server: ServerProcess) -> None:
    ok, cancelled = _counted(server, "OK"), _counted(server, "CANCELLED")
    for stream in (True, False):
        list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True))
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, stream=stream
        )
    assert _counted(server, "OK") == ok + 4 and _counted(server, "CANCELLED") == cancelled


def test_a_client_gone_mid_stream_frees_its_sequence(server: ServerProcess) -> None:
    cancelled_before = _counted(server, "CANCELLED")
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
    # The connection is closed: the sequence leaves the engine and is counted CANCELLED.

    def freed() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
            metrics = r.read().decode()
        running = metric_value(metrics, "generation_sequences", model=MODEL, state="running")
        used = metric_value(metrics, "kv_cache_blocks_used", model=MODEL)
        cancelled = metric_value(metrics, "inference_requests_total", model=MODEL,
                                 code="CANCELLED")  # fmt: skip
        return running == 0 and used == 0 and cancelled == cancelled_before + 1

    wait_for(freed, 20, "the cancelled stream's sequence to leave the engine")
