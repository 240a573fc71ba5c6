"""Discovery: which servers exist and what they serve.

``resolver`` turns the topology's endpoint sources into addresses (static addresses, DNS
names re-resolved, Kubernetes Services through their EndpointSlices in ``kubernetes``), and
``placement`` asks every server, over mTLS as the control plane where the mesh has it, which
model versions are READY (RepositoryIndex, ServerReady). Routing and the xDS builders read
what it found; nothing here decides weights.
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded when first asked for: the topology imports ``kubernetes`` (its endpoint source's
# parser), and an eager import of ``placement`` here would import the topology back.
_PUBLIC = {"EndpointResolver": "resolver", "PlacementPoller": "placement"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
