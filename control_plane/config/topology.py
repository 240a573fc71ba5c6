"""The topology file: which models the mesh routes, and where the model servers are.

Loaded in two layers: the external schema (plain YAML, read with a loader that also reports
duplicate keys) is checked against defaults and rules, collecting *every* error with its path
(``models[1].sla_p99_ms: must be > 0, got -5``); any error raises one ``TopologyError`` that
lists them all. A valid file becomes a frozen ``Topology`` built from ``control_plane.model.mesh``
values. Schema (every section but ``models`` is optional; defaults shown)::

    listener:                       # the Envoy listener; options shared by all model clusters
      host: 127.0.0.1               # an IP address (Envoy binds it)
      port: 8080                    # 1..65535
      health_check_interval_s: 1.0  # > 0
      health_checks: all            # or model: only each model's gRPC cluster checks its
                                    # servers (one connection per server and model per Envoy)
      connect_timeout_s: 1.0        # > 0
      max_retries: 3                # integer >= 0
      retry_budget_percent: 25      # 0..100
      body_routing: true            # Lua filter reads the model name from the request body
      lb_policy: least_request      # or round_robin: how Envoy picks within a model's pool
      access_log: ""                # a file for Envoy's JSON access log, one line per request
      rest:                         # KServe v2 REST (/v2/...) through the listener
        enabled: true
        port_offset: 2000           # non-zero integer: REST port = gRPC endpoint port + offset
      grpc_web: true                # Envoy's gRPC-Web filter
      cors:                         # optional (absent: no CORS); allow_origins required
        allow_origins: ["https://app.example.com"]   # exact origins, or "*" for any
        allow_headers: [content-type, x-grpc-web, x-user-agent, grpc-timeout, x-model-name,
                        x-model-version, x-priority, inference-header-content-length,
                        authorization]
        expose_headers: [grpc-status, grpc-message, retry-after]
        max_age_s: 86400            # integer >= 0
      expose: [inference, metadata, health]   # API groups the listener serves (Envoy's RBAC
                                    # refuses the rest); also model-config, statistics,
                                    # repository-index. Model control is never exposed.
      limits:                       # what one client may hold (control_plane.xds.edge_limits)
        max_request_headers_kb: 60  # 1..8192: all request headers together
        max_headers_count: 100      # >= 1
        request_headers_timeout_s: 10    # > 0: headers must arrive within it (slowloris)
        stream_idle_timeout_s: 300       # > 0: a stream idle this long is reset
        max_stream_duration_s: 120       # > 0: a unary request in all (streams are exempt)
        max_connection_duration_s: 3600  # > 0: then the connection is drained
        max_concurrent_streams: 100      # >= 1: HTTP/2 streams per connection
        per_connection_buffer_limit_kb: 32     # >= 1: read from a connection before pausing
      auth:                         # REQUIRED in a topology file: who may call the listener
        mode: api_keys              # api_keys | jwt | off (config.tenants has the rest)
        api_keys_file: ../.infermesh/api-keys   # hashed keys, relative to this file
      tls:                          # optional: TLS for clients, h2 by ALPN (xds.edge_tls)
        cert_file: edge.crt         # the chain clients see (leaf first), relative to this file
        key_file: edge.key          # its key (EC or RSA); renewed files reach Envoy over SDS
      upstream_tls:                 # optional: mTLS to the servers (xds.upstream_tls)
        pki_dir: ../.infermesh/pki  # infermesh certs' dir; xds.host on loopback or xds.tls
    tenants:                        # optional: what each tenant may do (config.tenants)
      team-a: {models: [classifier], rate_limit: {requests_per_s: 50}}
    xds: {host: 127.0.0.1, port: 18000}      # where the control plane serves ADS; tls: true
                                             # for mTLS (needs listener.upstream_tls)
    admin: {host: 127.0.0.1, port: 19000}    # the control plane's status HTTP
    placement:                      # model server polling (control_plane.discovery.placement)
      poll_interval_s: 1.0          # > 0: each endpoint probed once per interval, staggered
      timeout_s: 1.0                # > 0: deadline of each probe RPC
      max_probes_per_s: 100         # > 0: probe budget; more endpoints stretch the interval
      max_concurrent_probes: 200    # integer >= 1: probes in flight at most
      unreachable_after: 2          # integer >= 1: failed probes in a row before a reachable
                                    # endpoint leaves its clusters
    telemetry:                      # the OTLP/gRPC metrics receiver (control_plane.telemetry.store)
      host: 127.0.0.1               # a host name or IP to bind
      port: 14317                   # 1..65535
      window_s: 10                  # > 0: the sliding window of rates and percentiles
      stale_after_intervals: 3      # > 0: stale after this many missed reporting intervals
      forget_after_s: 300           # > 0: forget an endpoint unseen this long
      decoder_processes: 0          # integer >= 0: OTLP decoding in processes (0: a thread)
      shards: 0                     # integer >= 0: receiver and store in N processes sharing
                                    # the port (0: in the control plane; see telemetry_shards)
      push_tolerance: 0.02          # 0..1: a shard resends an endpoint's telemetry when a
                                    # number moved more than this (relative); lowered to the
                                    # smallest routing.recompute_tolerance of any pool
      shard_nice: 5                 # 0..19: shards' CPU priority below the control plane's
                                    # (os.nice): decisions and Envoy's updates come first
      scrape_interval_s: 2.0        # > 0: scrapes of kind-triton endpoints' /metrics
      insecure_plaintext: false     # without tls: true takes plaintext on a host that is
                                    # not loopback (development; /status warns)
      tls: false                    # mutual TLS, each report bound to the sender's identity
                                    # (needs listener.upstream_tls; Envoy's stats: needs
                                    # xds.tls, whose certificate its stat sink presents)
    models:                         # required, at least one
      - name: classifier            # letters, digits, '_', '.', '-'; unique
        sla_p99_ms: 50              # required, > 0
        capacity_qps: 1000          # required, > 0
        timeout_s: 5                # optional, > 0; default max(1.0, 20 * sla_p99_ms / 1000)
        version_split: {"1": 90, "2": 10}   # optional; version -> weight (int >= 0), sum > 0
        routing: {...}              # optional: telemetry-driven routing (PoolPolicy's fields;
                                    # examples/topology.yaml lists each with its default)
        rate_limit: {requests_per_s: 500, burst: 500}   # optional: Envoy token bucket per route
        circuit_breaker: {max_requests: 256, max_pending_requests: 64}   # optional, each >= 1
        fallback: classifier-small  # optional: another model (without a fallback of its own)
        generative: false           # true: default score weights favour KV cache and queue
        idempotent: true            # false: never hedged (a hedge runs a request twice), and
                                    # never retried after a reset (it may have run)
        hedging:                    # optional: hedged unary requests (routing.hedging)
          enabled: false            # true: hedge; off by default (docs/control-plane.md)
          multiplier: 2             # > 0: per-try timeout = multiplier x the pool's healthy P99
          floor_ms: 5               # > 0: never below it (and never above sla_p99_ms)
          budget_percent: 10        # 0..100: retries and hedges in flight, share of requests
          hysteresis: 0.25          # 0..1: moves only by more than this share of the value
          stalled_try: 0.5          # 0..1, on even with enabled false: a try unanswered at
                                    # this share of timeout_s races another host (0: off;
                                    # never for generative or non-idempotent models)
        canary:                     # optional: how a canary started by an operator progresses
          steps: [10, 25, 50, 100]  # percent on the canary; rising, ends at 100
          dwell_s: 30               # >= 0: at least this long on each step
          max_error_rate: 0.01      # 0..1: above it the canary rolls back at once
          p99_margin: 1.25          # >= 1: canary P99 <= margin x the stable version's
          error_margin: 0.01        # 0..1: canary error rate <= the stable's + margin
          min_requests: 20          # >= 1: canary requests in the window before judging
    endpoints:                      # optional, default none; each item has exactly one key
      - address: 127.0.0.1:8001     # a static IP:port ([::1]:8001 for IPv6); unique
        labels: {zone: a}           # optional (address only), with kind: infermesh | triton,
                                    # metrics_url (triton), rest_port (see examples/) and
                                    # tls: false (a plaintext member under upstream_tls)
      - dns: model-servers.local:8001   # a name re-resolved to all its A/AAAA records
      - kubernetes: {service: infermesh-model-server, namespace: infermesh, port: grpc}
                                    # a Service's ready pods, watched through its EndpointSlices
                                    # (control_plane.discovery.kubernetes); namespace: the pod's own

Unknown keys, duplicate keys, duplicate model names and duplicate endpoints are errors. A file
(``load_topology``) must say ``listener.auth``, even ``mode: off``; a topology built in code
(``parse_topology``) is "off" without it.
Versions are decimal numbers ("1" or 1). Static addresses must be IP literals (Envoy does not
resolve EDS endpoint addresses): use ``dns:`` for names. ``load_topology`` and
``topology_fingerprint`` block (async callers use ``asyncio.to_thread``); a watcher takes the
fingerprint *before* loading, so a write in between only costs one more reload. The
``models:`` section is checked in ``control_plane.config.models``; the endpoint sources are
resolved to addresses by ``control_plane.discovery.resolver``.

Why it is one module of this length: about a third of it is this docstring, the reference of the
topology file; the parser checks the whole file in one pass so that every error, with its
field's path, is reported at once.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from control_plane.config import tenants
from control_plane.config.kubernetes_source import KubernetesEndpoint, parse_source
from control_plane.config.models import parse_models
from control_plane.model import lanes
from control_plane.model.canary import CanaryPolicy
from control_plane.model.mesh import EndpointAddress, ListenerOptions, ModelRoute
from control_plane.model.schema import Checker, UniqueKeyLoader, show
from control_plane.scoring.types import Labels, PoolPolicy
from control_plane.xds import edge, edge_limits, edge_tls, exposure, upstream_tls
from infermesh.addresses import is_loopback

DEFAULT_XDS = EndpointAddress("127.0.0.1", 18000)
DEFAULT_ADMIN = EndpointAddress("127.0.0.1", 19000)


class TopologyError(Exception):
    """An unreadable or invalid topology; ``errors`` lists every problem found."""

    def __init__(self, source: str, errors: Iterable[str]) -> None:
        self.source = source
        self.errors = tuple(errors)
        listed = "".join(f"\n  - {e}" for e in self.errors)
        super().__init__(f"{source}: {len(self.errors)} topology error(s):{listed}")


@dataclass(frozen=True)
class PlacementOptions:
    poll_interval_s: float = 1.0  # seconds between two probes of each model server
    timeout_s: float = 1.0  # deadline of each probe RPC
    max_probes_per_s: float = 100.0  # probe budget: above it the interval stretches
    max_concurrent_probes: int = 200  # probes in flight at most
    unreachable_after: int = 2  # failed probes in a row before a reachable endpoint is not


@dataclass(frozen=True)
class TelemetryOptions:
    host: str = "127.0.0.1"  # where the OTLP/gRPC metrics receiver binds
    port: int = 14317
    window_s: float = 10.0  # sliding window of rates and percentiles
    stale_after_intervals: float = 3.0  # stale after this many observed reporting intervals
    forget_after_s: float = 300.0  # an endpoint unseen this long is forgotten
    decoder_processes: int = 0  # OTLP decoding in this many processes (0: a worker thread)
    shards: int = 0  # receiver and store in this many processes sharing the port (0: none)
    # A shard sends an endpoint again only when a number moved by more than this (relative),
    # else only that it reported (control_plane.telemetry.moved).
    push_tolerance: float = 0.02
    # Shards run this much nicer than the control plane's process (os.nice): on a host short
    # of CPU, Envoy's updates come first and ingest falls behind (telemetry_shard_delay_seconds).
    shard_nice: int = 5
    scrape_interval_s: float = 2.0  # Prometheus scrapes of kind-triton endpoints
    # Mutual TLS on the OTLP port: a report is taken only from the identity it reports for
    # (control_plane.telemetry.identity); needs listener.upstream_tls
    tls: bool = False
    # Without tls, telemetry is plaintext: taken on a loopback host only (development), unless
    # this says to take it from the network; /status and the live view warn either way.
    insecure_plaintext: bool = False


ENDPOINT_KINDS = ("infermesh", "triton")  # how the control plane reads an endpoint's signals


@dataclass(frozen=True)
class StaticEndpoint:
    address: EndpointAddress
    labels: Labels = ()  # over the labels the server reports
    kind: str = "infermesh"  # "triton": its Prometheus metrics are scraped (no OTLP)
    metrics_url: str = ""  # kind triton: where (default http://HOST:PORT+1/metrics)
    rest_port: int = 0  # its KServe v2 REST port (0: PORT + listener.rest.port_offset)
    tls: bool = True  # with listener.upstream_tls; false: a plaintext member, flagged

    @property
    def key(self) -> str:
        return self.address.key


@dataclass(frozen=True)
class DnsEndpoint:
    name: str  # lower case
    port: int

    @property
    def key(self) -> str:
        return f"{self.name}:{self.port}"


EndpointSource = StaticEndpoint | DnsEndpoint | KubernetesEndpoint


@dataclass(frozen=True)
class Topology:
    listener: ListenerOptions
    xds: EndpointAddress = DEFAULT_XDS
    admin: EndpointAddress = DEFAULT_ADMIN
    placement: PlacementOptions = PlacementOptions()
    models: tuple[ModelRoute, ...] = ()  # file order, timeout_s filled in
    endpoints: tuple[EndpointSource, ...] = ()  # file order
    capacity_qps: tuple[tuple[str, float], ...] = ()  # (model name, capacity), file order
    source: str = ""
    telemetry: TelemetryOptions = TelemetryOptions()
    policies: tuple[tuple[str, PoolPolicy], ...] = ()  # (model name, routing policy)
    canaries: tuple[tuple[str, CanaryPolicy], ...] = ()  # (model name, canary progression)
    # xds.tls: ADS over mutual TLS, each Envoy held to the node id its certificate names
    xds_tls: bool = False

    # Derived once per topology (it is immutable): routing reads the labels every recompute and
    # every snapshot build reads the REST ports, over every endpoint of a fleet.
    @functools.cached_property
    def endpoint_labels(self) -> Mapping[str, Labels]:
        """The labels the topology gives endpoints, by endpoint key (labelled ones only)."""
        return {
            e.key: e.labels for e in self.endpoints if isinstance(e, StaticEndpoint) and e.labels
        }

    @functools.cached_property
    def rest_ports(self) -> tuple[tuple[EndpointAddress, int], ...]:
        """(address, REST port) of the endpoints with a REST port of their own, sorted."""
        return tuple(sorted(
            (e.address, e.rest_port) for e in self.endpoints
            if isinstance(e, StaticEndpoint) and e.rest_port
        ))  # fmt: skip

    @functools.cached_property
    def scrape_targets(self) -> Mapping[str, str]:
        """Endpoint key -> metrics URL, for the endpoints whose signals are scraped."""
        return {
            e.key: e.metrics_url
            for e in self.endpoints
            if isinstance(e, StaticEndpoint) and e.kind == "triton"
        }

    def canary_policy(self, model: str) -> CanaryPolicy:
        """How a canary of the model progresses (the defaults unless the topology says)."""
        return dict(self.canaries).get(model, CanaryPolicy())

    def capacity(self, model: str) -> float:
        """The model's declared capacity in queries per second; KeyError if not a model."""
        return dict(self.capacity_qps)[model]

    def policy(self, model: str) -> PoolPolicy:
        """How telemetry-driven routing treats the model's pool (KeyError if not a model)."""
        found = dict(self.policies).get(model)
        if found is not None:
            return found
        route = next(m for m in self.models if m.name == model)
        return PoolPolicy(capacity_qps=self.capacity(model), sla_p99_ms=route.sla_p99_ms)


def load_topology(path: str | os.PathLike[str]) -> Topology:
    """Reads and validates a topology file (blocking I/O). Raises TopologyError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(str(path), [f"cannot read the file: {exc}"]) from exc
    return parse_topology_text(text, str(path), require_auth=True)


def parse_topology_text(
    text: str, source: str = "<topology>", require_auth: bool = False
) -> Topology:
    """Parses YAML text and validates it. Raises TopologyError. ``require_auth``: a missing
    ``listener.auth`` is an error (every file the control plane loads), not "off"."""
    loader = UniqueKeyLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise TopologyError(source, [f"invalid YAML: {exc}"]) from exc
    finally:
        loader.dispose()
    return _build(data, source, loader.duplicate_keys, require_auth)


def parse_topology(data: object, source: str = "<topology>") -> Topology:
    """Validates a plain structure (as ``yaml.safe_load`` returns). Raises TopologyError."""
    return _build(data, source, [])


_LISTENER = {
    "host": "ip", "port": "port", "health_check_interval_s": "positive",
    "health_checks": "health_checks", "connect_timeout_s": "positive", "max_retries": "count",
    "retry_budget_percent": "percent",
    "body_routing": "bool", "lb_policy": "lb_policy", "access_log": "path", "rest": "mapping",
    "grpc_web": "bool", "cors": "mapping", "expose": "list", "limits": "mapping",
    "auth": "mapping", "upstream_tls": "mapping", "tls": "mapping",
}  # fmt: skip
_BIND = {"host": "host", "port": "port"}
_XDS = {**_BIND, "tls": "bool"}
_PLACEMENT = {
    "poll_interval_s": "positive", "timeout_s": "positive", "max_probes_per_s": "positive",
    "max_concurrent_probes": "count", "unreachable_after": "count",
}  # fmt: skip
_TELEMETRY = {
    "host": "host", "port": "port", "window_s": "positive",
    "stale_after_intervals": "positive", "forget_after_s": "positive", "decoder_processes": "count",
    "shards": "count", "push_tolerance": "fraction", "shard_nice": "nice",
    "scrape_interval_s": "positive", "tls": "bool", "insecure_plaintext": "bool",
}  # fmt: skip
_TOP = (
    "listener", "xds", "admin", "placement", "telemetry", "models", "endpoints", "tenants",
)  # fmt: skip


def _folder(source: str) -> Path:
    """Where a topology's relative paths start: its file's folder (else the working one)."""
    path = Path(source)
    return path.parent if path.is_file() else Path.cwd()


def _build(
    data: object, source: str, early_errors: list[str], require_auth: bool = False
) -> Topology:
    c = Checker(list(early_errors))
    root = c.mapping(data, "")
    if root is None:
        raise TopologyError(source, c.errors)
    c.keys(root, "", _TOP, required=("models",))
    d = Topology(ListenerOptions())
    fields = c.section(root, "listener", _LISTENER, d.listener)
    given = root.get("listener")
    given = given if isinstance(given, dict) else {}
    nested = {k: v if isinstance(v, dict) else None for k, v in given.items()}  # else reported
    fields["rest"] = edge.parse_rest(c, nested.get("rest"), "listener.rest")
    fields["cors"] = edge.parse_cors(c, nested.get("cors"), "listener.cors")
    fields["expose"] = exposure.parse_expose(c, given.get("expose"), "listener.expose")
    fields["limits"] = edge_limits.parse_limits(c, nested.get("limits"), "listener.limits")
    fields["auth"] = tenants.parse_auth(c, given, "listener.auth", _folder(source), require_auth)
    fields["upstream_tls"] = upstream_tls.parse_upstream_tls(
        c, given.get("upstream_tls"), "listener.upstream_tls", _folder(source)
    )
    fields["tls"] = edge_tls.parse_edge_tls(c, given.get("tls"), "listener.tls", _folder(source))
    listener = ListenerOptions(**fields)
    xds_default = types.SimpleNamespace(host=d.xds.host, port=d.xds.port, tls=False)
    xds_fields = c.section(root, "xds", _XDS, xds_default)
    xds_tls = bool(xds_fields.pop("tls"))
    xds = EndpointAddress(**xds_fields)
    if xds_tls and listener.upstream_tls is None:
        c.errors.append("xds.tls: needs listener.upstream_tls (its pki_dir holds the certificates)")
    if listener.upstream_tls is not None and not xds_tls and not is_loopback(xds.host):
        # Envoy's key goes out over SDS: only to clients that proved they are that Envoy.
        c.errors.append(
            f"listener.upstream_tls: serves each Envoy's private key over xDS: with xds.host "
            f"{xds.host} (not loopback) set xds.tls: true, so only a proven Envoy gets its own"
        )
    admin = EndpointAddress(**c.section(root, "admin", _BIND, d.admin))
    placement = PlacementOptions(**c.section(root, "placement", _PLACEMENT, d.placement))
    for name in ("max_concurrent_probes", "unreachable_after"):
        if getattr(placement, name) == 0:
            c.errors.append(f"placement.{name}: must be >= 1, got 0")
    telemetry = TelemetryOptions(**c.section(root, "telemetry", _TELEMETRY, d.telemetry))
    if telemetry.tls and listener.upstream_tls is None:
        c.errors.append(
            "telemetry.tls: needs listener.upstream_tls (its pki_dir holds the control plane's "
            "certificate and the CA)"
        )
    if telemetry.tls and telemetry.insecure_plaintext:
        c.errors.append("telemetry: tls and insecure_plaintext contradict each other; pick one")
    if not telemetry.tls and not telemetry.insecure_plaintext and not is_loopback(telemetry.host):
        c.errors.append(
            f"telemetry.host {telemetry.host}: plaintext telemetry is taken on loopback only, "
            "since anyone who reaches the port could report for any server; set telemetry.tls: "
            "true (mesh certificates), or telemetry.insecure_plaintext: true to take it from "
            "the network anyway (development; /status warns)"
        )
    if telemetry.tls and listener.health_checks == "model" and not xds_tls:
        # Envoy's stat sink speaks TLS with the certificate its bootstrap names for xDS.
        c.errors.append(
            "telemetry.tls: with listener.health_checks: model (which reads Envoy's stats) "
            "needs xds.tls too: Envoy's stat sink presents the certificate of its xDS TLS"
        )
    if telemetry.shards and telemetry.decoder_processes:
        c.errors.append(
            "telemetry: set shards or decoder_processes, not both (shards decode in their "
            f"own processes), got shards={telemetry.shards}, "
            f"decoder_processes={telemetry.decoder_processes}"
        )
    models, capacity, policies, canaries = (
        parse_models(c, root["models"]) if "models" in root else ((), (), (), ())
    )
    policies_by_tenant = tenants.parse_tenants(c, root.get("tenants"), {m.name for m in models})
    auth = dataclasses.replace(listener.auth, tenants=policies_by_tenant)
    listener = dataclasses.replace(listener, auth=auth)
    # What a shard does not resend, routing must not need: no more than any pool ignores.
    lowest = min((p.recompute_tolerance for _, p in policies), default=telemetry.push_tolerance)
    if lowest < telemetry.push_tolerance:
        telemetry = dataclasses.replace(telemetry, push_tolerance=lowest)
    endpoints = _endpoints(c, root.get("endpoints", []))
    static = [(f"endpoints[{i}].address", e.address.port) for i, e in enumerate(endpoints)
              if isinstance(e, StaticEndpoint) and not e.rest_port]  # fmt: skip
    edge.check_rest_ports(c, listener.rest, static)
    plaintext = frozenset(e.key for e in endpoints if isinstance(e, StaticEndpoint) and not e.tls)
    if plaintext and listener.upstream_tls is None:
        c.errors.append(
            f"endpoints: tls: false ({', '.join(sorted(plaintext))}) only means something with "
            "listener.upstream_tls (without it every member is plaintext)"
        )
    elif plaintext and listener.upstream_tls is not None:
        tls = dataclasses.replace(listener.upstream_tls, plaintext=plaintext)
        listener = dataclasses.replace(listener, upstream_tls=tls)
    if c.errors:
        raise TopologyError(source, c.errors)
    return Topology(
        listener, xds, admin, placement, models, endpoints, capacity, source, telemetry, policies,
        canaries, xds_tls,
    )  # fmt: skip


_ENDPOINT_KINDS = ("address", "dns", "kubernetes")
_ENDPOINT_EXTRAS = ("labels", "kind", "metrics_url", "rest_port", "tls")  # on an "address"


def _endpoints(c: Checker, value: object) -> tuple[EndpointSource, ...]:
    result: dict[str, tuple[EndpointSource, int]] = {}
    for index, item in enumerate(c.sequence(value, "endpoints") or []):
        path = f"endpoints[{index}]"
        if (m := c.mapping(item, path)) is None:
            continue
        c.keys(m, path, _ENDPOINT_KINDS + _ENDPOINT_EXTRAS)
        kinds = [k for k in _ENDPOINT_KINDS if k in m]
        if len(kinds) != 1:
            if not set(m) - set(_ENDPOINT_KINDS + _ENDPOINT_EXTRAS):  # else already reported
                c.errors.append(f"{path}: needs exactly one of 'address', 'dns' or 'kubernetes'")
            continue
        kind = kinds[0]
        extras = [k for k in _ENDPOINT_EXTRAS if k in m]
        if extras and kind != "address":
            c.errors.append(f"{path}: {', '.join(extras)} only go with an 'address' endpoint")
        source: EndpointSource | None
        if kind == "kubernetes":
            source = parse_source(c, m[kind], f"{path}.{kind}")
        elif (host_port := c.host_port(m[kind], f"{path}.{kind}", kind == "address")) is None:
            source = None
        else:
            source = (
                _static(c, m, path, EndpointAddress(*host_port)) if kind == "address"
                else DnsEndpoint(*host_port)
            )  # fmt: skip
        if source is None:
            continue
        if source.key in result:
            c.errors.append(
                f"{path}.{kind}: duplicate endpoint {show(source.key)} "
                f"(first at endpoints[{result[source.key][1]}])"
            )
        result.setdefault(source.key, (source, index))
    return tuple(source for source, _ in result.values())


def _static(c: Checker, m: dict[str, Any], path: str, address: EndpointAddress) -> StaticEndpoint:
    labels = lanes.parse_labels(c, m["labels"], f"{path}.labels") if "labels" in m else ()
    kind = m.get("kind", "infermesh")
    if kind not in ENDPOINT_KINDS:
        c.fail(f"{path}.kind", f"must be one of {', '.join(ENDPOINT_KINDS)}", kind)
    host = f"[{address.host}]" if ":" in address.host else address.host
    url = m.get("metrics_url", f"http://{host}:{address.port + 1}/metrics")
    if "metrics_url" in m and kind != "triton":
        c.errors.append(f"{path}.metrics_url: only for kind triton (others push OTLP)")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        c.fail(f"{path}.metrics_url", "must be an http:// or https:// URL", url)
    # Triton's own layout puts HTTP just below gRPC (8000 next to 8001).
    rest_port = c.value(m, path, "rest_port", "port", address.port - 1 if kind == "triton" else 0)
    tls = c.value(m, path, "tls", "bool", True)
    return StaticEndpoint(address, labels, kind, url if kind == "triton" else "", rest_port, tls)


@dataclass(frozen=True)
class TopologyFingerprint:
    mtime_ns: int
    size: int
    sha256: str


def listing_fingerprint(directory: str, pattern: str) -> TopologyFingerprint:
    """The names in ``directory`` matching ``pattern``: a file added or removed there (a new
    Envoy node's certificate) is a change."""
    names = "\n".join(sorted(p.name for p in Path(directory).glob(pattern)))
    return TopologyFingerprint(0, len(names), hashlib.sha256(names.encode()).hexdigest())


def topology_fingerprint(path: str | os.PathLike[str]) -> TopologyFingerprint | None:
    """mtime, size and content hash (catches same-size rewrites within the mtime's resolution);
    None if the file cannot be read. Compare two to detect a change."""
    try:
        mtime_ns = os.stat(path).st_mtime_ns
        data = Path(path).read_bytes()
    except OSError:
        return None
    return TopologyFingerprint(mtime_ns, len(data), hashlib.sha256(data).hexdigest())
