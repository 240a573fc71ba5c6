"""The OpenAI API's request bodies, checked: what the demo LM can honour, and nothing else.

Pure functions, no I/O (``model_server.protocol.openai`` serves them). A body becomes a
``Generation``: the prompt (text completions' ``prompt``, or chat ``messages`` through the
model's chat template, ``model_server.generative.chat``) and the engine's parameters. Every
field is either honoured, accepted only at the value that changes nothing (``echo: false``,
``frequency_penalty: 0`` ...), or refused with 400 naming it: a parameter is never silently
ignored. JSON ``null`` means "not given", as in OpenAI's own API.

Errors are ``OpenAIError`` (``model_server.protocol.openai_errors``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from model_server.generative.chat import ROLES, ChatTemplate
from model_server.generative.sampling import ignored_at_greedy
from model_server.generative.text import MAX_STOP_BYTES, MAX_STOPS
from model_server.protocol.openai_errors import OpenAIError

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0
MAX_MESSAGES = 1024
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Generation:
    """One request's generation: what ``protocol.openai`` turns into a ModelInferRequest."""

    model: str
    prompt: str
    chat: bool
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None  # None: the endpoint's default
    parameters: dict[str, int | float | str] = field(default_factory=dict)
    stops: tuple[str, ...] = ()


# -- field checks -----------------------------------------------------------------------------


def _kind(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else "a number"
    )


def _bad(name: str, expected: str, value: object) -> OpenAIError:
    return OpenAIError(f"{name}: expected {expected}, got {_kind(value)}", name, "invalid_type")


def integer(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, "an integer", value)
    if not low <= value <= high:
        raise OpenAIError(
            f"{name}: must be between {low} and {high}, got {value}", name, "invalid_value"
        )
    return value


def number(
    body: Mapping[str, Any], name: str, low: float, high: float, low_open: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, "a number", value)
    if isinstance(value, float) and not math.isfinite(value):  # an int of 400 digits is
        raise _bad(name, "a finite number", value)  # finite: the range check below refuses it
    if not (low < value if low_open else low <= value) or value > high:
        bound = f"greater than {low}" if low_open else f"at least {low}"
        raise OpenAIError(
            f"{name}: must be {bound} and at most {high}, got {value}", name, "invalid_value"
        )
    return float(value)


def boolean(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    """``stop``: a string or an array of up to ``MAX_STOPS`` non-empty strings."""
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise _bad("stop", "a string or an array of strings", value)
    if len(items) > MAX_STOPS:
        raise OpenAIError(
            f"stop: at most {MAX_STOPS} stop sequences, got {len(items)}", "stop", "invalid_value"
        )
    for item in items:
        if not item or len(item.encode()) > MAX_STOP_BYTES:
            raise OpenAIError(
                f"stop: each stop sequence must be 1 to {MAX_STOP_BYTES} bytes, got "
                f"{len(item.encode())}", "stop", "invalid_value",
            )  # fmt: skip
    return tuple(dict.fromkeys(items))


def _neutral(*accepted: object) -> Callable[[object], bool]:
    """A value check: one of ``accepted`` (numbers compared as numbers, never a boolean)."""

    def check(value: object) -> bool:
        for good in accepted:
            if isinstance(good, bool) or isinstance(value, bool):
                if value is good:
                    return True
            elif value == good and type(value) in (type(good), int, float):
                return True
        return False

    return check


_NO_PENALTY = _neutral(0, 0.0)
# Fields accepted only at the value that changes nothing; anything else is refused, named.
COMPLETION_NEUTRAL: dict[str, Callable[[object], bool]] = {
    "echo": _neutral(False),
    "best_of": _neutral(1),
    "frequency_penalty": _NO_PENALTY,
    "presence_penalty": _NO_PENALTY,
    "logit_bias": lambda v: v == {},
    "suffix": lambda v: v == "",
}
CHAT_NEUTRAL: dict[str, Callable[[object], bool]] = {
    "frequency_penalty": _NO_PENALTY,
    "presence_penalty": _NO_PENALTY,
    "logit_bias": lambda v: v == {},
    "logprobs": _neutral(False),
    "response_format": lambda v: v == {"type": "text"},
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "parallel_tool_calls": lambda v: isinstance(v, bool),  # moot without tools
    "store": _neutral(False),
    "metadata": lambda v: v == {},
    "modalities": lambda v: v == ["text"],
    "service_tier": lambda v: v in ("auto", "default"),
}
# OpenAI's own parameters that this server has no way to honour (any other name is unknown).
UNSUPPORTED = ("logprobs", "top_logprobs", "functions", "function_call", "audio", "prediction",
               "reasoning_effort", "web_search_options", "verbosity")  # fmt: skip
# Honoured by both endpoints (``user`` is accepted and not used: documented).
COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_options", "n", "user")  # fmt: skip
COMPLETION_FIELDS = (*COMMON, "prompt")
CHAT_FIELDS = (*COMMON, "messages", "max_completion_tokens")


def _check_fields(
    body: Mapping[str, Any], honoured: tuple[str, ...], neutral: Mapping[str, Any]
) -> None:
    for name, value in body.items():
        if name in honoured or value is None:
            continue
        if name in neutral:
            if not neutral[name](value):
                raise OpenAIError(
                    f"{name}: not supported by this server (only its default is accepted, "
                    f"got {json.dumps(value)[:60]})", name, "unsupported_parameter",
                )  # fmt: skip
            continue
        if name in UNSUPPORTED:
            raise OpenAIError(
                f"{name}: not supported by this server", name, "unsupported_parameter"
            )
        raise OpenAIError(
            f"Unrecognized request argument supplied: {name[:64]}", name[:64],
            "unsupported_parameter",
        )  # fmt: skip


def model_name(body: Mapping[str, Any]) -> str:
    value = body.get("model")
    if not isinstance(value, str) or not value:
        if value is None:
            raise OpenAIError("model: required (the model to use)", "model", "missing_required")
        raise _bad("model", "a model name (a non-empty string)", value)
    return value


def _common(body: Mapping[str, Any], chat: bool, prompt: str) -> Generation:
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise OpenAIError(
                "stream_options: only allowed when stream is true", "stream_options",
                "invalid_value",
            )  # fmt: skip
        if not isinstance(options, dict):
            raise _bad("stream_options", "an object", options)
        unknown = [k for k in options if k != "include_usage"]
        if unknown:
            raise OpenAIError(
                f"stream_options.{unknown[0][:64]}: not supported (only include_usage is)",
                f"stream_options.{unknown[0][:64]}", "unsupported_parameter",
            )  # fmt: skip
        include_usage = boolean(options, "include_usage")
    n = integer(body, "n", 1, 128)
    if n is not None and n != 1:
        raise OpenAIError(
            f"n: only 1 choice per request is supported, got {n}", "n", "unsupported_value"
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", "a string", user)
    max_tokens = integer(body, "max_tokens", 1, MAX_SEED)
    if chat:
        newer = integer(body, "max_completion_tokens", 1, MAX_SEED)
        if newer is not None and max_tokens is not None and newer != max_tokens:
            raise OpenAIError(
                "max_tokens and max_completion_tokens differ: send one of them",
                "max_completion_tokens", "invalid_value",
            )  # fmt: skip
        max_tokens = newer if newer is not None else max_tokens
    parameters: dict[str, int | float | str] = {}
    for name, value in (
        ("temperature", number(body, "temperature", 0.0, MAX_TEMPERATURE)),
        ("top_p", number(body, "top_p", 0.0, 1.0, low_open=True)),
        ("top_k", integer(body, "top_k", 0, MAX_SEED)),
        ("seed", integer(body, "seed", 0, MAX_SEED)),
    ):
        if value is not None:
            parameters[name] = value
    ignored = ignored_at_greedy(
        float(parameters.get("temperature", 0.0)),
        float(parameters.get("top_p", 1.0)),
        int(parameters.get("top_k", 0)),
    )
    if ignored is not None:  # the engine refuses it too; here OpenAI's error names the param
        raise OpenAIError(
            f"{ignored}: has no effect at temperature 0 (greedy, the default here; OpenAI's "
            "is 1): set temperature above 0", ignored, "unsupported_value",
        )  # fmt: skip
    return Generation(
        model_name(body), prompt, chat, stream, include_usage, max_tokens, parameters, stops(body)
    )


def parse_completion(body: Mapping[str, Any]) -> Generation:
    """A ``POST /v1/completions`` body."""
    _check_fields(body, COMPLETION_FIELDS, COMPLETION_NEUTRAL)
    model_name(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise OpenAIError("prompt: required (the text to complete)", "prompt", "missing_required")
    if not isinstance(prompt, str):
        raise _bad("prompt", "a string (or an array of one string; token ids are not accepted)",
                   prompt)  # fmt: skip
    return _common(body, False, prompt)


def parse_messages(value: object) -> list[tuple[str, str]]:
    """``messages``: (role, text) pairs; content as a string or text parts."""
    if not isinstance(value, list) or not value:
        if value is None:
            raise OpenAIError("messages: required", "messages", "missing_required")
        raise _bad("messages", "a non-empty array of messages", value)
    if len(value) > MAX_MESSAGES:
        raise OpenAIError(
            f"messages: at most {MAX_MESSAGES}, got {len(value)}", "messages", "invalid_value"
        )
    result = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _bad(where, "an object", message)
        extra = [k for k in message if k not in ("role", "content")]
        if extra:
            raise OpenAIError(
                f"{where}.{extra[0][:64]}: not supported (a message has role and content)",
                f"{where}.{extra[0][:64]}", "unsupported_parameter",
            )  # fmt: skip
        role = message.get("role")
        if role not in ROLES:
            raise OpenAIError(
                f"{where}.role: expected one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}",
                f"{where}.role", "invalid_value",
            )  # fmt: skip
        result.append((str(role), _content(message.get("content"), f"{where}.content")))
    return result


def _content(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise OpenAIError(
                    f"{where}[{index}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                    "are supported", f"{where}[{index}]", "unsupported_value",
                )  # fmt: skip
            text = part.get("text")
            if not isinstance(text, str) or set(part) - {"type", "text"}:
                raise _bad(f"{where}[{index}]", 'a part {"type": "text", "text": "..."}', part)
            texts.append(text)
        return "".join(texts)
    raise _bad(where, "a string or an array of text parts", value)


def parse_chat(body: Mapping[str, Any], template: ChatTemplate | None) -> Generation:
    """A ``POST /v1/chat/completions`` body, its messages through ``template``."""
    _check_fields(body, CHAT_FIELDS, CHAT_NEUTRAL)
    name = model_name(body)
    messages = parse_messages(body.get("messages"))
    if template is None:
        raise OpenAIError(
            f"model {name!r} states no chat template (config parameter chat_template): use "
            "/v1/completions", "model", "no_chat_template",
        )  # fmt: skip
    return _common(body, True, template.render(messages))


def check_context(generation: Generation, max_positions: int) -> tuple[int, int]:
    """(prompt tokens, max_tokens): the byte-level prompt after BOS, and the completion's
    budget (the default: 16 for completions, the rest of the context for chat); 400 naming
    ``max_tokens`` when they do not fit the model's positions."""
    prompt_tokens = 1 + len(generation.prompt.encode())
    room = max_positions - prompt_tokens
    wanted = generation.max_tokens
    if wanted is None:
        wanted = max(1, room) if generation.chat else DEFAULT_COMPLETION_TOKENS
    if wanted > room:
        name = "max_completion_tokens" if generation.chat else "max_tokens"
        raise OpenAIError(
            f"{name}: this model's maximum context length is {max_positions} tokens; you "
            f"requested {prompt_tokens + wanted} tokens ({prompt_tokens} in the prompt, "
            f"{wanted} for the completion); the model is byte level: a token is a byte of "
            "UTF-8, plus one for the start of text", name, "context_length_exceeded",
        )  # fmt: skip
    return prompt_tokens, wanted
