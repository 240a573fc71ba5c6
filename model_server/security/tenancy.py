"""Who a request is for, as the edge proved it, and what that lets it do here.

Envoy authenticates clients at the public listener (``control_plane.xds.identity``) and sets three
headers upstream, having removed any copy a client sent: ``x-infermesh-tenant`` (the identity),
``x-infermesh-tenant-label`` (the tenant's name when the topology names it),
``x-infermesh-priority`` and ``x-infermesh-version`` ("allowed" or "denied"). A request with
none of them did not come through an authenticating edge (authentication off, or a caller on
the server's own port: issue 26 puts mutual TLS there); it is ``anonymous`` and keeps what it
could always do. With any of them, a permission not stated "allowed" is denied.

What the server enforces with them, since Envoy cannot read a request body:
- a request priority (the "priority" parameter or ``x-priority``) from a tenant that may not
  set one is refused with PERMISSION_DENIED;
- so is a model version named in the body by a tenant that may not choose one, unless it is
  the version Envoy's split chose (``x-model-version``);
- ``x-model-name`` must name the model the body asks for (INVALID_ARGUMENT otherwise): Envoy
  routes and authorises by the header, so a body naming another model would slip past both.

Metrics carry the label, bounded: a label that is not a tenant name, or any beyond the first
``MAX_LABELS`` seen, counts as ``other``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from infermesh.wire import (
    MODEL_HEADER,
    PRIORITY_PERMISSION_HEADER,
    TENANT_HEADER,
    TENANT_LABEL_HEADER,
    VERSION_PERMISSION_HEADER,
)
from model_server.core.errors import InferenceError, InvalidInput

EDGE_HEADERS = (TENANT_HEADER, PRIORITY_PERMISSION_HEADER, VERSION_PERMISSION_HEADER)
ANONYMOUS = "anonymous"
OTHER = "other"
MAX_LABELS = 64
_LABEL = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class EdgeIdentity:
    tenant: str  # "" when the request did not come through an authenticating edge
    label: str  # a named tenant, "other" or "anonymous"
    may_set_priority: bool
    may_pick_version: bool = True


ANONYMOUS_IDENTITY = EdgeIdentity("", ANONYMOUS, True, True)


def header_value(metadata: Sequence[tuple[str, Any]], name: str) -> str:
    """Request header ``name`` (gRPC metadata keys are lower case), "" when absent."""
    return next((str(value) for key, value in metadata if key == name), "")


class TenantLabels:
    """The labels metrics may carry: at most ``MAX_LABELS`` distinct tenant names."""

    def __init__(self, limit: int = MAX_LABELS) -> None:
        self.limit = limit
        self.seen: set[str] = set()

    def bounded(self, label: str) -> str:
        if label in self.seen or label in (OTHER, ANONYMOUS):
            return label
        if not _LABEL.fullmatch(label) or len(self.seen) >= self.limit:
            return OTHER
        self.seen.add(label)
        return label


def edge_identity(metadata: Sequence[tuple[str, Any]], labels: TenantLabels) -> EdgeIdentity:
    if not any(header_value(metadata, name) for name in EDGE_HEADERS):
        return ANONYMOUS_IDENTITY
    label = labels.bounded(header_value(metadata, TENANT_LABEL_HEADER) or OTHER)
    return EdgeIdentity(
        header_value(metadata, TENANT_HEADER),
        label,
        header_value(metadata, PRIORITY_PERMISSION_HEADER) == "allowed",
        header_value(metadata, VERSION_PERMISSION_HEADER) == "allowed",
    )


def check_model_header(metadata: Sequence[tuple[str, Any]], model_name: str) -> None:
    """The routing header and the body name one model (a missing header is fine)."""
    header = header_value(metadata, MODEL_HEADER)
    if header and header != model_name:
        raise InvalidInput(
            f"header {MODEL_HEADER}: names model {header!r} but the request is for "
            f"{model_name!r}; send the same name in both (or no header)"
        )


def check_priority(identity: EdgeIdentity, priority: int) -> None:
    if priority and not identity.may_set_priority:
        raise InferenceError(
            f"priority: tenant {identity.tenant!r} may not set a request priority (got "
            f"{priority}); the topology's tenants.{identity.label}.may_set_priority allows it",
            grpc.StatusCode.PERMISSION_DENIED,
        )


def check_version(identity: EdgeIdentity, version: str, routed: str) -> None:
    """A version named in the body: only a tenant that may choose one, or the split's own."""
    if version and version != routed and not identity.may_pick_version:
        raise InferenceError(
            f"model_version: tenant {identity.tenant!r} may not choose a model version (got "
            f"{version!r}); the topology's tenants.{identity.label}.may_pick_version allows it",
            grpc.StatusCode.PERMISSION_DENIED,
        )


def check_inference(
    metadata: Sequence[tuple[str, Any]],
    identity: EdgeIdentity,
    request: service_pb2.ModelInferRequest,
    routed: str,
) -> None:
    """What an inference request must pass before it is served: the routing header names its
    model, and a version in it is one the tenant may choose (or the split's own)."""
    check_model_header(metadata, request.model_name)
    check_version(identity, request.model_version, routed)
