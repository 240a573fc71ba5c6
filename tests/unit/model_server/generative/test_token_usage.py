"""The tokens a text generation used, as the model server reports them to the edge."""

from __future__ import annotations

from tritonclient.grpc import service_pb2

from model_server.generative.text import completion_tokens, prompt_tokens, text_response
from tests.support import text_request


def test_prompt_tokens_are_bos_and_one_per_byte_and_none_for_other_models() -> None:
    assert prompt_tokens(text_request("héllo")) == 1 + len("héllo".encode())
    request = text_request("abc")
    request.raw_input_contents.pop()
    request.inputs[0].contents.bytes_contents.append(b"abc")
    assert prompt_tokens(request) == 4
    other = service_pb2.ModelInferRequest(model_name="classifier")
    other.inputs.add(name="input", datatype="FP32")
    assert prompt_tokens(other) is None


def test_completion_tokens_count_bytes_and_the_eos_that_ended_it() -> None:
    request = text_request("x")
    streamed = [
        text_response(request, "demo_lm", 1, b"ab", False),
        text_response(request, "demo_lm", 1, b"c", True, "eos"),
    ]
    assert completion_tokens(streamed) == 4
    assert completion_tokens([text_response(request, "demo_lm", 1, b"abc", True, "length")]) == 3
