"""Checks of a parsed JSON body that Python's parser does not make.

``json.loads`` accepts a lone surrogate escape (``"\\ud800"``): the string it gives cannot be
UTF-8, and the ``encode()`` that follows (a prompt, a BYTES tensor, a stop sequence) would fail
as a 500. ``check_unicode`` refuses it first, naming where it is.
"""

from __future__ import annotations

import re
from typing import Any

from model_server.core.errors import InvalidInput


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
