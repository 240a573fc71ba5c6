"""Filling the edge's Lua scripts, one way for every script.

A placeholder is an upper-case name in braces, ``{NAME}``. ``fill`` replaces every one in one
pass, so the order of the values does not matter and a value is never scanned again: a model
named ``{HEADER}`` or ``HEADER`` stays itself. The template's placeholders and the values must
match exactly, so a typo fails when the control plane builds the script, not in Envoy.
Lua's own braces (table constructors such as ``{}`` or ``{grpc = 1}``) never look like one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

PLACEHOLDER = re.compile(r"\{([A-Z][A-Z0-9_]*)\}")


def placeholders(template: str) -> set[str]:
    """The names of ``template``'s placeholders."""
    return set(PLACEHOLDER.findall(template))


def fill(template: str, **values: str) -> str:
    """``template`` with each ``{NAME}`` replaced by ``values[NAME]``, in one pass."""
    wanted = placeholders(template)
    missing, unused = sorted(wanted - values.keys()), sorted(values.keys() - wanted)
    if missing or unused:
        raise ValueError(f"Lua template: no value for {missing}, no placeholder for {unused}")
    return PLACEHOLDER.sub(lambda m: values[m[1]], template)


def lua_string(value: str) -> str:
    """``value`` as a Lua string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def lua_strings(values: Iterable[str]) -> str:
    """``values`` as a Lua list constructor of string literals."""
    return "{" + ", ".join(lua_string(v) for v in values) + "}"
