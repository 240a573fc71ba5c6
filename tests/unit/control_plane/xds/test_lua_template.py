"""The edge's Lua scripts are filled one way: {NAME} placeholders, one pass, exact match."""

from __future__ import annotations

import pytest

import control_plane.xds.resources  # noqa: F401  (imports the xds modules in their order)
from control_plane.model.mesh import Affinity
from control_plane.xds import lua_routing, openai_edge, token_admission
from control_plane.xds.lua_template import fill, lua_string, lua_strings, placeholders


def test_a_value_that_spells_a_placeholder_is_not_filled_again() -> None:
    template = 'local A, B = "{FIRST}", "{SECOND}"'
    assert fill(template, FIRST="{SECOND}", SECOND="b") == 'local A, B = "{SECOND}", "b"'
    assert fill(template, SECOND="b", FIRST="{SECOND}") == 'local A, B = "{SECOND}", "b"'


def test_lua_tables_are_not_placeholders() -> None:
    template = "local t, u = {}, {grpc = 1, json = 2}\nlocal v = {N}"
    assert placeholders(template) == {"N"}
    assert fill(template, N="3").endswith("local v = 3")


@pytest.mark.parametrize(
    ("values", "named"),
    [({"HEADR": "x"}, "no value for ['HEADER'], no placeholder for ['HEADR']"),
     ({}, "no value for ['HEADER']")],
)  # fmt: skip
def test_a_missing_or_unused_value_fails_when_the_script_is_built(
    values: dict[str, str], named: str
) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        fill('headers:get("{HEADER}")', **values)


def test_lua_string_escapes_what_would_end_or_break_the_literal() -> None:
    assert lua_string('a"b\\c\nd') == r'"a\"b\\c\nd"'
    assert lua_strings(["x", "y"]) == '{"x", "y"}'


def test_every_shipped_script_is_filled_completely() -> None:
    scripts = [
        lua_routing.lua_source(),
        lua_routing.lua_source([("lm", Affinity(mode="prefix"))]),
        openai_edge.lua_source(),
        token_admission.lua_source(),
    ]
    for script in scripts:
        assert placeholders(script) == set()
        assert "HEADER" not in script.replace("AFFINITY_HEADER", "")
