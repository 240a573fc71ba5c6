"""The public surface of a stage package, loaded when first asked for.

A package's ``__init__`` names what it offers and in which of its modules each name lives;
importing the package (or one module of it: ``values`` in a decoder process, say) then loads
nothing else. Eager imports there made cycles: the topology imports ``discovery.kubernetes``,
and a ``discovery/__init__`` that imported ``placement`` imported the topology back.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, public: Mapping[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """(the package's ``__getattr__``, its ``__all__``) for ``public``: name -> module."""

    def attribute(name: str) -> Any:
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{public[name]}"), name)

    return attribute, sorted(public)
