"""Admin: the control plane's HTTP for operators and the live view.

``http`` is the server (tokens, exposure checks, routes), ``api`` what each route does for an
operator (status, overrides, splits, canaries), ``live_view`` the frames the page at ``/ui``
(static files in ``ui/``) draws. Nothing below this layer imports it (import-linter).
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded when first asked for, like the other stage packages.
_PUBLIC = {
    "AdminError": "http",
    "AdminServer": "http",
    "AdminTokens": "http",
    "LiveFeed": "live_view",
    "OperatorApi": "api",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
