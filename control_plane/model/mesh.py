"""The mesh as the control plane sees it: plain frozen values, no Envoy types.

``MeshState`` is what the topology and the placement poller produce and what
``control_plane.xds.resources`` turns into Envoy listeners, routes, clusters and endpoints.

Why it is one module of this length: it is the vocabulary every stage shares, many small frozen
values and the cluster-naming rules; one place to read them beats a package of tiny modules.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from control_plane.scoring.types import LabelRule
from infermesh.wire import MODEL_HEADER, PRIORITY_HEADER, VERSION_HEADER

# Request header that selects a model's cluster; the Lua filter sets it from the request body
# for clients that do not send it (stock tritonclient).
# Cluster for server-level calls (ServerLive, ServerReady, ServerMetadata, RepositoryIndex).
SERVERS_CLUSTER = "servers"
LISTENER_NAME = "infermesh"
# Envoy load-balancing policies a topology may choose for the model clusters.
LB_POLICIES = ("least_request", "round_robin")
# Which clusters health-check their members (listener.health_checks): Envoy checks per
# cluster, and a server is in several (servers, its model's, its versions', REST twins).
HEALTH_CHECK_SCOPES = ("all", "model")
ROUTE_CONFIG_NAME = "infermesh-routes"


def model_cluster(model: str, version: str | None = None) -> str:
    """Envoy cluster name of a model (every version) or of one version of it."""
    return f"model:{model}" if version is None else f"model:{model}:v{version}"


def cluster_model(cluster: str) -> str | None:
    """The model a ``model_cluster`` name (or its REST twin) belongs to (None for others)."""
    kind, _, rest = base_cluster(cluster).partition(":")
    return rest.split(":")[0] if kind == "model" and rest else None


REST_CLUSTER_PREFIX = "rest:"


def rest_cluster(cluster: str) -> str:
    """The KServe v2 REST twin of a cluster: the same endpoints, ports shifted by the REST
    offset (``fallback:X`` -> ``fallback:rest:X``, other names ``rest:`` prefixed)."""
    kind, _, rest = cluster.partition(":")
    if kind == "fallback":
        return f"fallback:{REST_CLUSTER_PREFIX}{rest}"
    return REST_CLUSTER_PREFIX + cluster


def base_cluster(cluster: str) -> str:
    """The gRPC cluster a REST twin mirrors (any other name as it is)."""
    if cluster.startswith("fallback:" + REST_CLUSTER_PREFIX):
        return "fallback:" + cluster.removeprefix("fallback:" + REST_CLUSTER_PREFIX)
    return cluster.removeprefix(REST_CLUSTER_PREFIX)


def is_rest_cluster(cluster: str) -> bool:
    return base_cluster(cluster) != cluster


def checks_health(options: ListenerOptions, cluster: str) -> bool:
    """Whether Envoy health-checks the members of ``cluster``: every cluster, or (scope
    "model") only each model's own cluster and its SLA lanes (an endpoint reserved for a class
    is in no other cluster of the model), and their REST twins. An Envoy then holds one check
    connection per server and model (two with REST) rather than one per cluster the server
    is in; the model's other clusters follow what these checks find (``checked_down`` in
    ``placement.build_mesh_state``)."""
    if options.health_checks == "all":
        return True
    return is_checked_in_model_scope(base_cluster(cluster))


def is_checked_in_model_scope(cluster: str) -> bool:
    """A model's own gRPC cluster or one of its SLA lanes (``lanes.sla_cluster``)."""
    model = cluster_model(cluster)
    own = model_cluster(model) if model is not None else None
    return own is not None and (cluster == own or cluster.startswith(f"{own}:sla:"))


@dataclass(frozen=True, order=True)
class EndpointAddress:
    host: str
    port: int
    # Computed once: addresses key every per-endpoint map, and at fleet scale a rebuild hashes
    # them hundreds of thousands of times (a dataclass re-hashes its fields on every call).
    _hash: int = field(init=False, repr=False, compare=False)
    # "HOST:PORT", made once likewise: routing looks telemetry up by it for every endpoint at
    # every tick (a third of a recompute at rest, formatted each time: 20 -> 13 ms at 10,000).
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.host, self.port)))
        object.__setattr__(self, "key", f"{self.host}:{self.port}")

    def __hash__(self) -> int:
        return self._hash


class EndpointHealth(enum.StrEnum):
    HEALTHY = "HEALTHY"
    DRAINING = "DRAINING"  # finishing its work: Envoy sends it no new requests
    UNHEALTHY = "UNHEALTHY"  # ejected


@dataclass(frozen=True)
class EndpointAssignment:
    """One endpoint in one cluster, with its EDS load_balancing_weight (>= 1) and health."""

    address: EndpointAddress
    weight: int = 1
    health: EndpointHealth = EndpointHealth.HEALTHY
    priority: int = 0  # Envoy's priority level: 1 takes traffic only when 0 cannot (lanes)
    # The server's own (gRPC) port where ``address`` is its REST twin's (0: address.port):
    # its certificate names that one (control_plane.xds.upstream_tls).
    server_port: int = 0
    # Computed once, like EndpointAddress's: the caches of made assignments and EDS entries
    # (placement, clusters, edge) hash every member of `servers` at every rebuild.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = (self.address, self.weight, self.health, self.priority, self.server_port)
        object.__setattr__(self, "_hash", hash(fields))

    @property
    def server_address(self) -> str:
        """``host:port`` the server is known by (its gRPC address, also for a REST twin)."""
        return f"{self.address.host}:{self.server_port or self.address.port}"

    def __hash__(self) -> int:
        return self._hash


def fallback_cluster(cluster: str) -> str:
    """The aggregate cluster that tries ``cluster`` first and the model's fallback after."""
    return f"fallback:{cluster}"


@dataclass(frozen=True)
class RateLimit:
    """A token bucket in Envoy on a model's routes: ``requests_per_s`` refill, ``burst`` size."""

    requests_per_s: float
    burst: int


@dataclass(frozen=True)
class TokenLimit:
    """A tenant's token budget on a model (prompt plus completion tokens): a bucket that holds
    ``burst`` tokens and refills ``tokens_per_s`` (a topology's ``tokens_per_minute`` / 60).
    Admission reserves a request's bound and the settlement refunds what it did not use
    (``control_plane.model.tokens``)."""

    tokens_per_s: float
    burst: int

    def describe(self) -> str:
        """The limit in the words a refusal uses: per minute, as operators write it."""
        return f"{self.tokens_per_s * 60:g} tokens/min, burst {self.burst}"


@dataclass(frozen=True)
class CircuitBreaker:
    """Envoy's limits per model cluster; past them Envoy answers UNAVAILABLE at once."""

    max_requests: int = 1_000_000  # in flight to the cluster
    max_pending_requests: int = 1_000_000  # waiting for a connection or stream


@dataclass(frozen=True)
class HedgingPolicy:
    """A model's hedged requests (control_plane.routing.hedging): a unary try that has not
    answered within ``multiplier`` x the pool's healthy P99 (clamped to ``floor_ms`` and the
    SLA P99) races a second try on another host; at most ``budget_percent`` of the requests in
    flight to the model's clusters may be retries or hedges."""

    multiplier: float = 2.0
    floor_ms: float = 5.0
    budget_percent: float = 10.0
    hysteresis: float = 0.25  # the per-try timeout moves when it would change by more


@dataclass(frozen=True)
class SlaClass:
    """How requests of one SLA class are routed: their own deadline and retries."""

    name: str
    timeout_s: float
    max_retries: int | None = None  # None: the listener's max_retries
    per_try_timeout_s: float | None = None  # None: one try may use the whole timeout


@dataclass(frozen=True)
class LargeInputs:
    """Requests whose declared size is at least ``min_bytes`` prefer endpoints with labels."""

    min_bytes: int
    prefer: LabelRule


AFFINITY_MODES = ("none", "prefix", "session")
KV_BLOCK_TOKENS = 16  # the model servers' KV block (the demo LM: 1 token = 1 byte)


@dataclass(frozen=True)
class Affinity:
    """Which requests of a model share a server (``control_plane.xds.affinity``): a key from
    the prompt's first ``prefix_blocks`` KV blocks (``prefix``) or from the client's
    ``session_header`` / OpenAI ``user`` field, scoped by tenant (``session``), drives Envoy's
    Maglev with bounded load: no server above ``hash_balance_factor`` % of the mean."""

    mode: str = "prefix"  # "prefix" or "session" (mode "none" is no Affinity)
    prefix_blocks: int = 8
    block_bytes: int = KV_BLOCK_TOKENS
    session_header: str = "x-session-id"
    hash_balance_factor: int = 125
    # ModelStreamInfer: wait for the stream's request side to end and key on its first
    # message. Only for clients that send one request per stream (a long-lived stream would
    # wait for its end); otherwise streams are keyed by the session header only.
    one_request_streams: bool = False

    @property
    def prefix_bytes(self) -> int:
        return self.prefix_blocks * self.block_bytes


@dataclass(frozen=True)
class ModelRoute:
    """How requests for one model are routed.

    ``version_split`` holds (version, weight) pairs: requests without a version header are
    split across those versions' clusters by weight. Empty: one cluster for all versions.
    ``rate_limit``, ``circuit_breaker`` and ``fallback`` protect the model (None: off).
    """

    name: str
    sla_p99_ms: float
    timeout_s: float
    version_split: tuple[tuple[str, int], ...] = ()
    rate_limit: RateLimit | None = None
    circuit_breaker: CircuitBreaker | None = None
    fallback: str | None = None  # a model whose pool serves when this one's has no healthy host
    fallback_active: bool = False  # the circuit is open: every request goes to the fallback
    sla_classes: tuple[SlaClass, ...] = ()  # x-sla-class values with their own route (lanes)
    large_inputs: LargeInputs | None = None  # a lane for requests with large declared inputs
    # Hedging (None: off, the default; never for non-idempotent models)
    hedging: HedgingPolicy | None = None
    hedge_per_try_s: float | None = None  # the per-try timeout telemetry set (None: not yet)
    # A try not answered within this share of the timeout races a second try on another host
    # (hedging.stalled_try; 0: off). It covers what no P99 describes: a stalled process, a
    # host that vanished mid-connect. Off for generative and non-idempotent models.
    stalled_try_share: float = 0.0
    affinity: Affinity | None = None  # None: mode "none", the listener's lb_policy
    # False (``idempotent: false``): a request must not run twice, so it is retried only when
    # it never reached a server (refused connection or stream, UNAVAILABLE), not on a reset.
    idempotent: bool = True


@dataclass(frozen=True)
class ListenerLimits:
    """What one client may hold or send at the public listener (control_plane.xds.edge_limits)."""

    max_request_headers_kb: int = 60
    max_headers_count: int = 100
    request_headers_timeout_s: float = 10.0
    stream_idle_timeout_s: float = 300.0
    max_stream_duration_s: float = 120.0  # unary requests; ModelStreamInfer routes are exempt
    max_connection_duration_s: float = 3600.0
    max_concurrent_streams: int = 100  # HTTP/2 streams per connection
    # Envoy's edge advice. It is also what Envoy reads from a connection per read: with 1 MiB a
    # client flooding HTTP/2 frames made each read a long stretch of work that good requests
    # waited behind (bench_hostile: P99 2.3x quiet at 1 MiB, 1.3-1.6x at 32 KiB). gRPC bodies a
    # filter buffers are bounded by the HTTP/2 stream window instead, not by this.
    per_connection_buffer_limit_kb: int = 32
    # New connections the listener takes a second (0: no limit); more are closed at once
    max_new_connections_per_s: int = 0


@dataclass(frozen=True)
class RestOptions:
    """KServe v2 REST through the listener: ``/v2/...`` paths go to each cluster's REST twin,
    whose endpoints are the gRPC ones with the port + ``port_offset`` (the model server's
    default --http-port is its gRPC port + 2000)."""

    enabled: bool = True
    port_offset: int = 2000


# What a browser may send (gRPC-Web's own headers and the mesh's routing headers) and read.
CORS_ALLOW_HEADERS = (
    "content-type", "x-grpc-web", "x-user-agent", "grpc-timeout", MODEL_HEADER,
    VERSION_HEADER, PRIORITY_HEADER, "inference-header-content-length", "authorization",
)  # fmt: skip
CORS_EXPOSE_HEADERS = ("grpc-status", "grpc-message", "retry-after")


@dataclass(frozen=True)
class CorsOptions:
    """CORS on the listener's virtual host; ``allow_origins`` exact origins, "*" for any."""

    allow_origins: tuple[str, ...]
    allow_headers: tuple[str, ...] = CORS_ALLOW_HEADERS
    expose_headers: tuple[str, ...] = CORS_EXPOSE_HEADERS
    max_age_s: int = 86400


@dataclass(frozen=True)
class ApiKey:
    """One API key as the edge stores it: ``TENANT.KEYID`` and the SHA-1 of the secret
    (base64, htpasswd's ``{SHA}`` form; the secret itself is never stored)."""

    key_id: str  # TENANT.KEYID, the user name the client sends with HTTP Basic
    tenant: str
    sha1_b64: str


@dataclass(frozen=True)
class JwtAuth:
    """JWTs verified by Envoy's jwt_authn against a local JWKS (``jwks``: its JSON text)."""

    issuer: str
    audiences: tuple[str, ...]
    jwks: str
    tenant_claim: str = "sub"
    jwks_file: str = ""  # where ``jwks`` was read (watched for changes)


@dataclass(frozen=True)
class TenantPolicy:
    """What one tenant may do at the edge. ``models``: the models it may use ("*": all);
    ``rate_limit``: its token bucket on each model, unless ``model_rate_limits`` names the
    model; ``may_set_priority`` / ``may_pick_version``: whether it may set a request priority
    or choose a model version (otherwise such a request is refused). The tenant ``other``
    applies to every authenticated identity not listed."""

    name: str
    models: tuple[str, ...] = ("*",)
    rate_limit: RateLimit | None = None
    model_rate_limits: tuple[tuple[str, RateLimit], ...] = ()
    may_set_priority: bool = False
    may_pick_version: bool = False
    token_limit: TokenLimit | None = None
    model_token_limits: tuple[tuple[str, TokenLimit], ...] = ()

    def may_use(self, model: str) -> bool:
        return "*" in self.models or model in self.models

    def limit_for(self, model: str) -> RateLimit | None:
        return dict(self.model_rate_limits).get(model, self.rate_limit)

    def token_limit_for(self, model: str) -> TokenLimit | None:
        """Its token budget on ``model``: the model's own, else the one for all its models."""
        if not self.may_use(model):
            return None
        return dict(self.model_token_limits).get(model, self.token_limit)


OTHER_TENANT = "other"  # the policy (and metrics label) of identities not listed
AUTH_MODES = ("api_keys", "jwt", "off")


@dataclass(frozen=True)
class EdgeAuth:
    """Who may call the public listener (control_plane.xds.identity). ``mode`` "off" serves
    everyone, and the control plane then warns in /status; a topology must say so explicitly.
    ``tenants``: the configured tenants' policies (with ``other``, if given, last)."""

    mode: str = "off"
    api_keys: tuple[ApiKey, ...] = ()
    api_keys_file: str = ""
    jwt: JwtAuth | None = None
    tenants: tuple[TenantPolicy, ...] = (TenantPolicy(OTHER_TENANT),)
    # The token limiter unreachable or slow: refuse (closed, the default) or admit (open).
    token_limiter_fail_open: bool = False

    @property
    def files(self) -> tuple[str, ...]:
        """The files this configuration was read from (the control plane watches them)."""
        found = (self.api_keys_file, self.jwt.jwks_file if self.jwt else "")
        return tuple(f for f in found if f)

    def tenant(self, name: str) -> TenantPolicy | None:
        return next((t for t in self.tenants if t.name == name), None)

    @property
    def rate_limited(self) -> bool:
        """Whether any tenant has a rate limit (the listener then names every model)."""
        return any(t.rate_limit or t.model_rate_limits for t in self.tenants)

    @property
    def token_limited(self) -> bool:
        """Whether any tenant has a token limit (Envoy then asks the token limiter)."""
        return self.mode != "off" and any(
            t.token_limit or t.model_token_limits for t in self.tenants
        )

    def token_limit(self, tenant: str, model: str) -> TokenLimit | None:
        """The budget of ``tenant`` (a label: a named tenant, or ``other``) on ``model``."""
        policy = self.tenant(tenant)
        return policy.token_limit_for(model) if policy is not None else None

    @property
    def named_tenants(self) -> tuple[TenantPolicy, ...]:
        """The tenants listed by name (``other`` excluded): the only metrics labels."""
        return tuple(t for t in self.tenants if t.name != OTHER_TENANT)


@dataclass(frozen=True)
class WorkloadKeys:
    """One workload's certificate and key (PEM): an Envoy node's, served to that node alone
    over SDS, or the control plane's own, for its probes of the model servers."""

    name: str  # the node id (Envoy) or the control plane's name
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)  # never in a repr, a log or /status
    not_after: float = 0.0  # Unix time


class ServerPods:
    """Which Kubernetes pod ("NAMESPACE/POD") serves at each discovered address ("HOST:PORT"),
    as the EndpointSlices' ``targetRef`` says: a pod's certificate names the pod, not its IP
    (``pki.model_server_pod``). Immutable; compared and hashed by identity, so the snapshot
    caches that key on it cost nothing until discovery replaces it (only on a change)."""

    __slots__ = ("_pods",)

    def __init__(self, pods: Mapping[str, str] | None = None) -> None:
        self._pods = dict(pods or {})

    def get(self, address: str) -> str:
        """``NAMESPACE/POD`` at ``address`` (HOST:PORT, or [V6]:PORT as a server names
        itself), or "" (then the address is the identity)."""
        found = self._pods.get(address, "")
        if not found and address.startswith("["):
            found = self._pods.get(address[1:].replace("]", "", 1), "")
        return found

    def as_dict(self) -> dict[str, str]:
        return dict(self._pods)

    def __len__(self) -> int:
        return len(self._pods)

    def __repr__(self) -> str:
        return f"ServerPods({len(self._pods)} pods)"


NO_PODS = ServerPods()


@dataclass(frozen=True)
class UpstreamTls:
    """Mutual TLS from Envoy and the control plane to the model servers
    (control_plane.xds.upstream_tls): the mesh CA and the identities, read from ``pki_dir``
    (``infermesh certs``)."""

    pki_dir: str
    trust_domain: str
    ca_pem: bytes = field(repr=False)
    envoys: tuple[WorkloadKeys, ...] = ()
    control_plane: WorkloadKeys | None = None
    # Members that speak plaintext ("tls: false" on the endpoint, e.g. a Triton server
    # without TLS): HOST:PORT of their gRPC address. Flagged in /status.
    plaintext: frozenset[str] = frozenset()
    # Kubernetes: the pod behind each discovered address, whose name its certificate carries
    # instead of the address (pki.model_server_pod). Set by the control plane from discovery.
    pods: ServerPods = field(default_factory=lambda: NO_PODS)

    @property
    def files(self) -> tuple[str, ...]:
        """What the control plane watches: a renewed file reaches Envoy without a restart."""
        stems = [f"envoy_{e.name}" for e in self.envoys]
        if self.control_plane is not None:
            stems.append(f"control-plane_{self.control_plane.name}")
        names = ["ca.crt"] + [f"{stem}.{ext}" for stem in stems for ext in ("crt", "key")]
        return tuple(f"{self.pki_dir}/{name}" for name in names)


@dataclass(frozen=True)
class EdgeTls:
    """TLS on the public listener (control_plane.xds.edge_tls): the certificate clients see, read
    from files and served to Envoy over SDS."""

    cert_file: str
    key_file: str
    cert_pem: bytes = field(repr=False)
    key_pem: bytes = field(repr=False)  # never in a repr, a log or /status
    not_after: float = 0.0  # Unix time
    names: tuple[str, ...] = ()  # the DNS and IP names the certificate carries
    not_before: float = 0.0  # Unix time

    @property
    def files(self) -> tuple[str, ...]:
        return (self.cert_file, self.key_file)


@dataclass(frozen=True)
class ListenerOptions:
    """The Envoy listener and the cluster options that apply to every model cluster."""

    host: str = "127.0.0.1"
    port: int = 8080
    health_check_interval_s: float = 1.0
    connect_timeout_s: float = 1.0
    max_retries: int = 3
    retry_budget_percent: float = 25.0
    body_routing: bool = True  # Lua filter reads the model name from unary request bodies
    lb_policy: str = "least_request"  # one of LB_POLICIES; EDS weights apply under both
    access_log: str = ""  # a file Envoy appends one JSON line per request to ("": none)
    rest: RestOptions = RestOptions()  # KServe v2 REST routes and clusters
    grpc_web: bool = True  # Envoy's gRPC-Web filter (browsers' framing, to plain gRPC)
    cors: CorsOptions | None = None  # None: no CORS
    health_checks: str = "all"  # one of HEALTH_CHECK_SCOPES: "model" checks once per model
    # API groups the listener serves (control_plane.xds.exposure); everything else is refused
    expose: tuple[str, ...] = ("inference", "metadata", "health")
    limits: ListenerLimits = ListenerLimits()
    auth: EdgeAuth = EdgeAuth()  # client identity and tenants (control_plane.xds.identity)
    upstream_tls: UpstreamTls | None = None  # mTLS to the model servers; None: plaintext
    tls: EdgeTls | None = None  # TLS for clients on the listener; None: plaintext


@dataclass(frozen=True)
class MeshState:
    """Everything the Envoy resources are built from.

    ``clusters`` maps each cluster name (``model_cluster(...)`` or ``SERVERS_CLUSTER``) to the
    endpoints that may serve it; a model whose model is READY nowhere has an empty cluster.
    """

    listener: ListenerOptions
    models: tuple[ModelRoute, ...]
    clusters: Mapping[str, tuple[EndpointAssignment, ...]] = field(default_factory=dict)
    # Endpoints whose REST port is not their gRPC port + listener.rest.port_offset (a Triton
    # member's HTTP port): (gRPC address, REST port), sorted.
    rest_ports: tuple[tuple[EndpointAddress, int], ...] = ()
