"""Envoy dynamic-metadata namespaces that several filters' configurations name.

A leaf module: the Lua scripts (``affinity``, ``openai_edge``) and the authentication filters
(``identity``) all read the proven identity from ``AUTH_NAMESPACE``, and importing it from
``identity`` made a cycle (identity -> edge -> lua_routing -> affinity -> identity) that broke
whichever of them was imported first.
"""

from __future__ import annotations

AUTH_NAMESPACE = "infermesh.auth"  # dynamic metadata: {"tenant": identity}
