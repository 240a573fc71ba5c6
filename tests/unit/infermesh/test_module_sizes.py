"""Modules stay small enough to read in one sitting: one over MAX_LINES says at its top why it
is one module (issue 27's rule), checked here."""

from __future__ import annotations

import ast

from tests.support import ROOT

MAX_LINES = 400
PACKAGES = ("control_plane", "model_server", "infermesh")
REASON = "Why it is one module of this length:"


def long_modules() -> dict[str, int]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = path.read_text(encoding="utf-8").count("\n")
            if lines > MAX_LINES:
                found[str(path.relative_to(ROOT))] = lines
    return found


def test_every_long_module_says_why_at_its_top() -> None:
    long = long_modules()
    assert len(list((ROOT / "control_plane").rglob("*.py"))) > 20  # the walk sees the code
    unexplained = [
        f"{name} ({lines} lines)"
        for name, lines in long.items()
        if REASON not in (ast.get_docstring(ast.parse((ROOT / name).read_text())) or "")
    ]
    assert not unexplained, f"over {MAX_LINES} lines with no {REASON!r} in the docstring"
