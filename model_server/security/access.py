"""Who may call what on a model server: Triton's API groups and restricted APIs.

Triton names its endpoints in groups (``--grpc-restricted-protocol`` / ``--http-restricted-api``)
and lets an operator require a header with a shared credential on some of them. Here one
``--restricted-api GROUPS:HEADER=@FILE`` flag covers gRPC and REST alike; the credential is
read from FILE (never from the command line, where ``ps`` would show it). A call to a
restricted group without the right header is refused with PERMISSION_DENIED (gRPC) or 403
(REST), naming the group and the header, never the expected value.

``protocol.service`` keeps the model-control *mode* (Triton's ``--model-control-mode``);
this module only says whether a caller proved it may use a group at all.
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from infermesh.secrets import SecretError, read_secret, split_header_secret
from infermesh.wire import OPENAI_GENERATION_PATHS, OPENAI_MODELS_PATH

GRPC_SERVICE = "/inference.GRPCInferenceService/"

# Triton's API groups and the gRPC methods in each (src/grpc/grpc_server.cc's categories).
GRPC_GROUPS: Mapping[str, tuple[str, ...]] = {
    "health": ("ServerLive", "ServerReady", "ModelReady"),
    "metadata": ("ServerMetadata", "ModelMetadata"),
    "inference": ("ModelInfer", "ModelStreamInfer"),
    "shared-memory": (
        "SystemSharedMemoryStatus",
        "SystemSharedMemoryRegister",
        "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus",
        "CudaSharedMemoryRegister",
        "CudaSharedMemoryUnregister",
    ),
    "model-config": ("ModelConfig",),
    "model-repository": ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"),
    "statistics": ("ModelStatistics",),
    "trace": ("TraceSetting",),
    "logging": ("LogSettings",),
}
GROUPS = tuple(GRPC_GROUPS)
# grpc.health.v1 is how load balancers probe: Triton counts it as health too.
GROUP_OF_METHOD: Mapping[str, str] = {
    "/grpc.health.v1.Health/Check": "health",
    "/grpc.health.v1.Health/Watch": "health",
    **{GRPC_SERVICE + m: group for group, methods in GRPC_GROUPS.items() for m in methods},
}


def rest_group(path: str) -> str | None:
    """The API group of a KServe v2 REST path, or of the OpenAI API's (generation: inference,
    ``/v1/models``: metadata); None: neither, so no group."""
    if path in OPENAI_GENERATION_PATHS:
        return "inference"
    if path == OPENAI_MODELS_PATH or path.startswith(OPENAI_MODELS_PATH + "/"):
        return "metadata"
    parts = [part for part in path.split("/") if part]
    if not parts or parts[0] != "v2":
        return None
    rest = parts[1:]
    if not rest:
        return "metadata"  # GET /v2
    head = rest[0]
    if head == "health":
        return "health"
    if head == "repository":
        return "model-repository"
    if head in ("systemsharedmemory", "cudasharedmemory"):
        return "shared-memory"
    if head == "logging":
        return "logging"
    if head == "trace":
        return "trace"
    if head == "models":
        if rest[1:2] == ["stats"]:
            return "statistics"
        tail = rest[2:]
        if len(tail) >= 2 and tail[0] == "versions":
            tail = tail[2:]
        last = tail[0] if tail else ""
        return {
            "": "metadata",
            "ready": "health",
            "config": "model-config",
            "stats": "statistics",
            "infer": "inference",
            "generate": "inference",
            "generate_stream": "inference",
            "trace": "trace",
        }.get(last, "metadata")
    return None


@dataclass(frozen=True)
class Restriction:
    """Calls to ``groups`` must carry ``header`` with ``value`` (compared in constant time)."""

    groups: frozenset[str]
    header: str  # lower case, as gRPC metadata keys are
    value: str

    def allows(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.value.encode())

    def __repr__(self) -> str:  # never the credential, whoever prints this
        return f"Restriction(groups={sorted(self.groups)}, header={self.header!r})"


class RestrictionError(ValueError):
    """A ``--restricted-api`` value that cannot be used; the message names what is wrong."""


@dataclass(frozen=True)
class RestrictionSpec:
    """A ``--restricted-api`` value as written: checked, its credential file not read yet
    (the command line is parsed before the server starts, e.g. by manifest tests)."""

    groups: frozenset[str]
    header: str
    path: Path

    def load(self) -> Restriction:
        try:
            value = read_secret(self.path, "--restricted-api")
        except SecretError as exc:
            raise RestrictionError(str(exc)) from None
        return Restriction(self.groups, self.header, value)


def parse_restriction_spec(text: str) -> RestrictionSpec:
    """``GROUP[,GROUP...]:HEADER=@FILE``."""
    groups_text, sep, assignment = text.partition(":")
    if not sep or not groups_text or "=" not in assignment:
        raise RestrictionError(f"expected GROUP[,GROUP...]:HEADER=@FILE, got {groups_text!r}")
    groups = frozenset(g.strip() for g in groups_text.split(",") if g.strip())
    unknown = sorted(groups - set(GROUPS))
    if unknown:
        raise RestrictionError(f"unknown API group(s) {unknown}; expected some of {list(GROUPS)}")
    try:
        header, path = split_header_secret(assignment, "--restricted-api")
    except SecretError as exc:
        raise RestrictionError(str(exc)) from None
    return RestrictionSpec(groups, header, path)


def parse_restriction(text: str) -> Restriction:
    """``GROUP[,GROUP...]:HEADER=@FILE``, FILE read (its surrounding space dropped)."""
    return parse_restriction_spec(text).load()


def restriction_table(restrictions: Sequence[Restriction]) -> dict[str, Restriction]:
    """Group -> its restriction; a group named by two flags is a configuration error."""
    table: dict[str, Restriction] = {}
    for item in restrictions:
        for group in item.groups:
            if group in table:
                raise RestrictionError(f"API group {group!r} is restricted twice")
            table[group] = item
    return table


def denial(group: str, header: str) -> str:
    return (
        f"the {group} API is restricted on this server: send the {header!r} header with its "
        "credential (operators only)"
    )


def check_metadata(
    table: Mapping[str, Restriction], group: str | None, metadata: Sequence[tuple[str, Any]]
) -> str | None:
    """None when the call may go on, else why not."""
    item = table.get(group or "")
    if item is None:
        return None
    given = next((str(v) for k, v in metadata if k == item.header), None)
    return None if item.allows(given) else denial(group or "", item.header)


class RestrictedApiInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to restricted groups that lack the credential, before any handler runs."""

    def __init__(self, table: Mapping[str, Restriction]) -> None:
        self.table = dict(table)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        group = GROUP_OF_METHOD.get(details.method)
        if group not in self.table:
            return await continuation(details)
        refused = check_metadata(self.table, group, details.invocation_metadata or ())
        if refused is None:
            return await continuation(details)
        handler = await continuation(details)
        return _denying(handler, refused)


def _denying(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """``handler`` answering PERMISSION_DENIED with ``message`` (a unary one without one)."""
    if handler is not None:
        return guarded(handler, lambda _context: message)

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

    return grpc.unary_unary_rpc_method_handler(deny)


def guarded(
    handler: grpc.RpcMethodHandler, check: Callable[[grpc.aio.ServicerContext], str | None]
) -> grpc.RpcMethodHandler:
    """``handler`` with ``check`` first: PERMISSION_DENIED with its message when it refuses."""
    decode, encode = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            refused = check(context)
            if refused is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
            result = inner(request, context)
            return await result if inspect.isawaitable(result) else result

        make = (
            grpc.unary_unary_rpc_method_handler
            if handler.unary_unary
            else grpc.stream_unary_rpc_method_handler
        )
        return make(unary, decode, encode)
    inner = handler.unary_stream or handler.stream_stream
    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.unary_stream
        else grpc.stream_stream_rpc_method_handler
    )
    if inspect.isasyncgenfunction(inner):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            refused = check(context)
            if refused is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
            async for item in inner(request, context):
                yield item

        return make(stream, decode, encode)

    async def writing(request: Any, context: grpc.aio.ServicerContext) -> Any:
        # Handlers that answer with context.write() (grpc's aio health Watch) stay that way.
        refused = check(context)
        if refused is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
        return await inner(request, context)

    return make(writing, decode, encode)
