"""What the public listener exposes, and the header hygiene that goes with it.

The listener serves only the API groups named in ``listener.expose`` (Triton's group names;
default: inference, metadata and health, which includes readiness). Everything else is
refused by Envoy's RBAC filter, first in the chain, before any other filter reads the body and
before any upstream sees the call: gRPC callers get PERMISSION_DENIED, REST callers 403 with
``{"error": ...}``. The model-control APIs (RepositoryModelLoad/Unload, ``/v2/repository/*``
but the index), shared memory, trace and logging can never be exposed: operators use the model
servers' own ports with their credential (``infermesh models``).

The allowlist is one list of path rules (``EXPOSABLE``), used both by the RBAC policy and by
the local reply mapper that words the refusal, so the two cannot disagree. Paths are
normalised first (``normalize_path``, ``merge_slashes``; escaped slashes are refused), so
``//``, ``/./`` and percent-encoded letters cannot slip past it.

Header hygiene: ``early_header_mutation`` removes, before routing and before any filter,
every request header a client must not control (``STRIPPED_PREFIXES``): the mesh's own
``x-infermesh-*`` (the fallback a route sets, and the tenant Envoy will set) and Envoy's
``x-envoy-*`` (retry counts, timeouts, forced tracing).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.core.v3 import extension_pb2, substitution_format_string_pb2
from envoy.config.rbac.v3 import rbac_pb2
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.filters.http.rbac.v3 import rbac_pb2 as rbac_filter_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.http.early_header_mutation.header_mutation.v3 import (
    header_mutation_pb2,
)
from envoy.type.matcher.v3 import path_pb2, regex_pb2, string_pb2

from control_plane.model.mesh import ListenerOptions
from control_plane.model.schema import Checker
from control_plane.xds import edge
from control_plane.xds.envoy_values import packed
from infermesh.wire import INTERNAL_PREFIX, OPENAI_GENERATION_PATHS, OPENAI_MODELS_PATH

RBAC_FILTER = "envoy.filters.http.rbac"
GRPC = "/inference.GRPCInferenceService/"
HEALTH = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class PathRule:
    """One allowed path: ``exact``, or an RE2 ``regex`` over the whole path (kept small:
    Envoy refuses programs over 100 by default)."""

    exact: str = ""
    regex: str = ""

    def matcher(self, query: bool) -> string_pb2.StringMatcher:
        """``query``: also match the path with a query string (the ``:path`` header has it,
        RBAC's url_path does not)."""
        if self.exact and not query:
            return string_pb2.StringMatcher(exact=self.exact)
        pattern = self.regex or re.escape(self.exact)
        suffix = "(\\?.*)?" if query else ""
        return string_pb2.StringMatcher(safe_regex=regex_pb2.RegexMatcher(regex=pattern + suffix))


def _grpc(*methods: str) -> tuple[PathRule, ...]:
    return tuple(PathRule(exact=GRPC + m) for m in methods)


def _model(tail: str) -> PathRule:
    """A KServe v2 REST path of one model (and optionally one version), then ``tail``."""
    return PathRule(regex="/v2/models/[^/]+(/versions/[^/]+)?" + tail)


# Group -> the paths it covers at the listener.
EXPOSABLE: dict[str, tuple[PathRule, ...]] = {
    "health": (
        *_grpc("ServerLive", "ServerReady", "ModelReady"),
        PathRule(exact=HEALTH + "Check"),
        PathRule(exact=HEALTH + "Watch"),
        PathRule(exact="/v2/health/live"),
        PathRule(exact="/v2/health/ready"),
        _model("/ready"),
    ),
    "metadata": (
        *_grpc("ServerMetadata", "ModelMetadata"),
        PathRule(exact="/v2"),
        _model(""),
        PathRule(exact=OPENAI_MODELS_PATH),
        PathRule(regex=OPENAI_MODELS_PATH + "/[^/]+"),
    ),
    "inference": (
        *_grpc("ModelInfer", "ModelStreamInfer"),
        _model("/infer"),  # Triton's generate extension is not served
        *(PathRule(exact=path) for path in OPENAI_GENERATION_PATHS),
    ),
    "model-config": (*_grpc("ModelConfig"), _model("/config")),
    "statistics": (*_grpc("ModelStatistics"), PathRule(exact="/v2/models/stats"), _model("/stats")),
    "repository-index": (*_grpc("RepositoryIndex"), PathRule(exact="/v2/repository/index")),
}
DEFAULT_EXPOSE = ListenerOptions().expose  # inference, metadata, health
# Never at the public listener, whatever the topology says (named in the refusal).
NEVER_EXPOSED = ("model-repository", "shared-memory", "trace", "logging")
# Triton's GET /v2/models/stats would also match the metadata path of a model named "stats".
STATS = PathRule(exact="/v2/models/stats")
STRIPPED_PREFIXES = (INTERNAL_PREFIX, "x-envoy-")


def exposed_rules(expose: Iterable[str]) -> list[PathRule]:
    return [rule for group in expose for rule in EXPOSABLE[group]]


def _stats_hidden(expose: tuple[str, ...]) -> bool:
    return "statistics" not in expose


def _url_path(rule: PathRule) -> rbac_pb2.Permission:
    return rbac_pb2.Permission(url_path=path_pb2.PathMatcher(path=rule.matcher(query=False)))


def rbac_filter(expose: tuple[str, ...]) -> hcm_pb2.HttpFilter:
    """ALLOW only the exposed paths, for every principal."""
    allowed = rbac_pb2.Permission.Set(rules=[_url_path(r) for r in exposed_rules(expose)])
    permission = rbac_pb2.Permission(or_rules=allowed)
    if _stats_hidden(expose):
        both = rbac_pb2.Permission.Set(
            rules=[permission, rbac_pb2.Permission(not_rule=_url_path(STATS))]
        )
        permission = rbac_pb2.Permission(and_rules=both)
    policy = rbac_pb2.Policy(permissions=[permission], principals=[rbac_pb2.Principal(any=True)])
    rules = rbac_pb2.RBAC(action=rbac_pb2.RBAC.ALLOW, policies={"exposed-apis": policy})
    config = rbac_filter_pb2.RBAC(rules=rules, rules_stat_prefix="exposure.")
    return hcm_pb2.HttpFilter(name=RBAC_FILTER, typed_config=packed(config))


def refusal_message(expose: tuple[str, ...]) -> str:
    exposed = ", ".join(expose)
    return (
        f"%REQ(:PATH)% is not exposed on this listener (it serves: {exposed}); model "
        "control, shared memory, trace and logging are for operators, on the model servers' "
        "own ports"
    )


def _path_header(matcher: string_pb2.StringMatcher, invert: bool) -> accesslog_pb2.AccessLogFilter:
    header = rc_pb2.HeaderMatcher(name=":path", string_match=matcher, invert_match=invert)
    return accesslog_pb2.AccessLogFilter(header_filter=accesslog_pb2.HeaderFilter(header=header))


def refused_request(expose: tuple[str, ...]) -> accesslog_pb2.AccessLogFilter:
    """A request whose path RBAC refuses (the policy's own condition, over ``:path``)."""
    unexposed = [_path_header(r.matcher(query=True), invert=True) for r in exposed_rules(expose)]
    refused = edge.all_of(unexposed)
    if not _stats_hidden(expose):
        return refused
    stats = _path_header(STATS.matcher(query=True), invert=False)
    return accesslog_pb2.AccessLogFilter(or_filter=accesslog_pb2.OrFilter(filters=[refused, stats]))


def refusal_mappers(expose: tuple[str, ...]) -> list[hcm_pb2.ResponseMapper]:
    """The local reply mappers that word a refusal: JSON for REST paths, plain text (which
    Envoy sends as grpc-message, with grpc-status PERMISSION_DENIED) for everything else."""
    message = refusal_message(expose)
    text = substitution_format_string_pb2.SubstitutionFormatString()
    text.text_format_source.inline_string = message
    refused = [edge.status_filter(403), refused_request(expose)]
    on_rest = [*refused, edge.rest_request()]
    return [
        hcm_pb2.ResponseMapper(
            filter=edge.all_of(on_rest), body_format_override=edge.json_error(message)
        ),
        hcm_pb2.ResponseMapper(filter=edge.all_of(refused), body_format_override=text),
    ]


def harden(manager: hcm_pb2.HttpConnectionManager) -> None:
    """Path normalisation and the early removal of headers a client must not control."""
    manager.normalize_path.value = True
    manager.merge_slashes = True
    manager.path_with_escaped_slashes_action = hcm_pb2.HttpConnectionManager.REJECT_REQUEST
    mutations = [
        mutation_rules_pb2.HeaderMutation(
            remove_on_match=mutation_rules_pb2.HeaderMutation.RemoveOnMatch(
                key_matcher=string_pb2.StringMatcher(prefix=prefix, ignore_case=True)
            )
        )
        for prefix in STRIPPED_PREFIXES
    ]
    early = header_mutation_pb2.HeaderMutation(mutations=mutations)
    manager.early_header_mutation_extensions.append(
        extension_pb2.TypedExtensionConfig(
            name="envoy.http.early_header_mutation.header_mutation", typed_config=packed(early)
        )
    )


# --- topology -------------------------------------------------------------------------------


def parse_expose(c: Checker, value: object, path: str) -> tuple[str, ...]:
    if value is None:
        return DEFAULT_EXPOSE
    items = c.sequence(value, path)
    if items is None:
        return DEFAULT_EXPOSE
    result = []
    for index, item in enumerate(items):
        if isinstance(item, str) and item in EXPOSABLE:
            result.append(item)
        elif isinstance(item, str) and item in NEVER_EXPOSED:
            c.fail(
                f"{path}[{index}]",
                "is never exposed on the public listener (operators use the model servers' "
                "own ports)",
                item,
            )
        else:
            c.fail(f"{path}[{index}]", f"must be one of {', '.join(EXPOSABLE)}", item)
    if not result and not c.errors:
        c.fail(path, "must name at least one API group", value)
    return tuple(dict.fromkeys(result))
