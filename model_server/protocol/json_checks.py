"""Parsing a JSON request body strictly, with the checks Python's parser does not make.

The edge (Envoy's Lua) reads some fields of the same body (the model, ``max_tokens``) to route
and to reserve tokens, so the server must never read a body differently from it:

- UTF-8 only: ``json.loads`` on bytes also takes UTF-16 and UTF-32, which the edge's byte
  patterns cannot read (a ``max_tokens`` hidden from the token reservation);
- each key once per object: the parser keeps the last of a repeated key, the edge the first
  (``"max_tokens": 1, ..., "max_tokens": null`` reserved 1 token for a whole context);
- ``json.loads`` accepts a lone surrogate escape (``"\\ud800"``): the string it gives cannot be
  UTF-8, and the ``encode()`` that follows (a prompt, a BYTES tensor, a stop sequence) would
  fail as a 500. ``check_unicode`` refuses it first, naming where it is.
"""

from __future__ import annotations

import json
import re
from typing import Any

from model_server.core.errors import InvalidInput


def load_json_object(data: bytes) -> dict[str, Any]:
    """``data`` as a JSON object, or InvalidInput saying what is wrong with it and where."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(
            f"request body: JSON must be UTF-8; byte {exc.start} is not ({exc.reason})"
        ) from None
    try:
        document = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        hint = "" if data else " (it is empty)"
        raise InvalidInput(f"request body is not valid JSON{hint}: {exc}") from None
    except ValueError as exc:  # a repeated key; an integer of more digits than Python converts
        raise InvalidInput(f"request body: {exc}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise InvalidInput("request body: JSON nests too deeply") from None
    if not isinstance(document, dict):
        raise InvalidInput(f"request body: expected a JSON object, got {type(document).__name__}")
    check_unicode(data, document)
    return document


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"key {key!r} appears more than once in an object; send it once")
            seen.add(key)
    return document


def check_unicode(data: bytes, document: Any) -> None:
    """InvalidInput naming the field when ``document`` (parsed from ``data``) holds a string
    that cannot be UTF-8: Python's JSON parser accepts a lone ``\\ud800`` escape, and the
    ``encode()`` that follows would fail as a 500."""
    if not _SURROGATE_ESCAPE.search(data):  # only an escape can make one: UTF-8 bytes cannot
        return
    try:
        where = _lone_surrogate(document, "")
    except RecursionError:
        raise InvalidInput("request body: JSON nests too deeply") from None
    if where is not None:
        raise InvalidInput(
            f"{where or 'request body'}: a string holds a lone UTF-16 surrogate (an unpaired "
            "\\uD800-\\uDFFF escape); expected valid Unicode"
        )


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value: Any, where: str) -> str | None:
    """Where in ``value`` a string (or an object's key) cannot be UTF-8: None if nowhere."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _lone_surrogate(item, f"{where}[{index}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            if _lone_surrogate(key, where) is not None:
                return where  # the key itself: name the object that holds it
            found = _lone_surrogate(item, f"{where}.{key}" if where else key)
            if found is not None:
                return found
    return None
