"""The OpenAI API's bodies, checked without a server: what is honoured, what is accepted only
at its neutral value, what is refused (named), the chat template, the stream's text (stop
sequences held back, UTF-8 never split) and its events."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf import text_format
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2

from model_server.demo_lm import config_pbtxt
from model_server.generative.chat import ChatTemplate, chat_template
from model_server.generative.streaming_text import TextAssembler
from model_server.protocol.openai import DONE, infer_request, sse
from model_server.protocol.openai_errors import OpenAIError, error_document, exception_document
from model_server.protocol.openai_schema import check_context, parse_chat, parse_completion

TEMPLATE = ChatTemplate("<|{role}|>\n{content}\n", "<|assistant|>\n")


def _refused(body: dict[str, Any], chat: bool = False) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse_chat(body, TEMPLATE) if chat else parse_completion(body)
    return caught.value


def test_a_completion_body_becomes_the_engines_parameters() -> None:
    generation = parse_completion(
        {"model": "m", "prompt": ["hi"], "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
         "top_k": 3, "seed": 7, "stop": ["a", "b", "a"], "stream": True,
         "stream_options": {"include_usage": True}, "n": 1, "user": "u", "echo": False,
         "frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": None}
    )  # fmt: skip
    assert generation.prompt == "hi" and generation.max_tokens == 5
    assert generation.parameters == {"temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 7}
    assert generation.stops == ("a", "b") and generation.stream and generation.include_usage
    request = infer_request(generation, 5, "id-1")
    assert request.parameters["max_tokens"].int64_param == 5
    assert request.parameters["top_p"].double_param == 0.9
    assert json.loads(request.parameters["stop_sequences"].string_param) == ["a", "b"]
    assert request.inputs[0].contents.bytes_contents[0] == b"hi"


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"frequency_penalty": 0.1}, "frequency_penalty", "not supported"),
        ({"echo": 1}, "echo", "not supported"),  # 1 is not false
        ({"best_of": 2}, "best_of", "not supported"),
        ({"logit_bias": {"1": 2}}, "logit_bias", "not supported"),
        ({"suffix": "x"}, "suffix", "not supported"),
        ({"logprobs": 0}, "logprobs", "not supported"),
        ({"functionz": []}, "functionz", "Unrecognized"),
        ({"n": 3}, "n", "only 1"),
        ({"max_tokens": True}, "max_tokens", "an integer"),
        ({"max_tokens": 2.0}, "max_tokens", "an integer"),
        ({"max_tokens": -1}, "max_tokens", "between"),
        ({"temperature": 2.5}, "temperature", "at most"),
        ({"temperature": float("nan")}, "temperature", "a finite number"),
        ({"temperature": 10**400}, "temperature", "at most"),  # math.isfinite overflowed
        ({"top_p": -(10**400)}, "top_p", "greater than"),
        ({"top_p": 0}, "top_p", "greater than"),
        ({"top_p": 0.5}, "top_p", "no effect at temperature 0"),  # greedy: it would do nothing
        ({"top_k": 5, "temperature": 0}, "top_k", "no effect at temperature 0"),
        ({"seed": 2**63}, "seed", "between"),
        ({"stream": "yes"}, "stream", "true or false"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats", "not supported"),
        ({"stop": ""}, "stop", "1 to"),
        ({"stop": {"a": 1}}, "stop", "a string or an array"),
        ({"user": 5}, "user", "a string"),
        ({"prompt": None}, "prompt", "required"),
        ({"model": ""}, "model", "model name"),
    ],
)  # fmt: skip
def test_every_refusal_names_its_field(extra: dict[str, Any], param: str, words: str) -> None:
    error = _refused({"model": "m", "prompt": "p", **extra})
    assert error.param == param and words in error.message, error.message
    status, document = exception_document(error)
    assert status == 400 and document["error"]["param"] == param
    assert document["error"]["type"] == "invalid_request_error"


def test_chat_messages_go_through_the_template() -> None:
    generation = parse_chat(
        {"model": "m", "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                        "text": "b"}]},
        ], "max_completion_tokens": 4, "response_format": {"type": "text"}, "tools": []},
        TEMPLATE,
    )  # fmt: skip
    assert generation.prompt == "<|system|>\nS\n<|user|>\nab\n<|assistant|>\n"
    assert generation.chat and generation.max_tokens == 4
    assert _refused({"model": "m", "messages": [{"role": "user", "content": "x"}],
                     "max_tokens": 3, "max_completion_tokens": 4}, chat=True).param == (
        "max_completion_tokens"
    )  # fmt: skip
    assert _refused({"model": "m", "messages": "hi"}, chat=True).param == "messages"
    assert _refused({"model": "m", "messages": [{"role": "user", "content": None}]},
                    chat=True).param == "messages[0].content"  # fmt: skip
    with pytest.raises(OpenAIError) as no_template:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}, None)
    assert no_template.value.error_code == "no_chat_template"


def test_a_template_is_literal_so_braces_in_messages_stay() -> None:
    assert TEMPLATE.render([("user", "{role} {content} {0}")]) == (
        "<|user|>\n{role} {content} {0}\n<|assistant|>\n"
    )


def test_the_demo_lm_states_its_template_in_its_config() -> None:
    config = text_format.Parse(config_pbtxt(), model_config_pb2.ModelConfig())
    assert chat_template(config) == TEMPLATE
    assert chat_template(model_config_pb2.ModelConfig()) is None


def test_the_context_is_counted_in_bytes_plus_bos() -> None:
    completion = parse_completion({"model": "m", "prompt": "héllo"})  # é is two bytes
    assert check_context(completion, 512) == (7, 16)  # BOS + 6 bytes; OpenAI's default 16
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}, TEMPLATE)
    prompt_tokens, budget = check_context(chat, 512)
    assert prompt_tokens + budget == 512  # chat's default: the rest of the context
    too_long = parse_completion({"model": "m", "prompt": "p", "max_tokens": 511})
    with pytest.raises(OpenAIError) as caught:
        check_context(too_long, 512)
    assert caught.value.error_code == "context_length_exceeded"
    assert caught.value.param == "max_tokens"


def test_stream_events_are_openais() -> None:
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"
    assert error_document(401, "no")["error"]["type"] == "authentication_error"
    assert error_document(503, "x")["error"]["type"] == "server_error"


def test_stop_sequences_are_held_back_then_dropped() -> None:
    text = TextAssembler(("cN",))
    assert [text.push(b) for b in (b"c", b"c", b"c", b"N")] == ["", "c", "c", ""]
    assert text.finish(stopped=True) == ""
    kept = TextAssembler(("cN",))
    assert kept.push(b"cc") == "c"
    assert kept.finish(stopped=False) == "c"  # ended for length: nothing is dropped


@given(
    st.binary(max_size=40),
    st.lists(st.integers(1, 5), min_size=1, max_size=40),
    st.lists(st.binary(min_size=1, max_size=4), max_size=3),
)
def test_streamed_text_equals_the_whole_text(
    data: bytes, cuts: list[int], stops: list[bytes]
) -> None:
    """However the bytes are split into tokens, the streamed text is the whole text's decoding
    (UTF-8 characters are never split, invalid bytes replaced alike)."""
    names = tuple(s.decode("utf-8", "replace") for s in stops)
    text = TextAssembler(names)
    pieces, position = [], 0
    for cut in cuts * (len(data) // max(1, sum(cuts)) + 1):
        pieces.append(text.push(data[position : position + cut]))
        position += cut
        if position >= len(data):
            break
    pieces.append(text.push(data[position:]))
    pieces.append(text.finish(stopped=False))
    assert "".join(pieces) == data.decode("utf-8", "replace")
