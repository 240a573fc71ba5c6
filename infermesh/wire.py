"""The wire contract: every name that crosses a process boundary, spelled once.

Both sides of each boundary import their names from here: clients and Envoy (the routing
headers), Envoy and the model servers (the headers the edge sets once it has authenticated a
caller), the model servers and the control plane (the metric names and kinds of their OTLP
telemetry, the latency buckets, the resource attribute that names the server), Envoy's stat
sink and the control plane (the node tag). A rename on one side only is then impossible, and
``tests/unit/infermesh/test_wire.py`` checks that what the model server exports is what the
control plane reads.
"""

from __future__ import annotations

# --- headers a client sends; Envoy routes on them -------------------------------------------
MODEL_HEADER = "x-model-name"  # routes without decoding the body
VERSION_HEADER = "x-model-version"  # a pinned version (tenants with may_pick_version)
PRIORITY_HEADER = "x-priority"  # 0 (highest) .. (tenants with may_set_priority)

# --- the OpenAI-compatible API: the model servers' REST port, and Envoy's listener -----------
# POST bodies of the generation paths name their model in the JSON field "model" (Envoy's Lua
# reads it into MODEL_HEADER: control_plane.xds.lua_openai); GET /v1/models lists models.
OPENAI_ROOT = "/v1"
OPENAI_COMPLETIONS_PATH = "/v1/completions"
OPENAI_CHAT_PATH = "/v1/chat/completions"
OPENAI_MODELS_PATH = "/v1/models"
OPENAI_GENERATION_PATHS = (OPENAI_COMPLETIONS_PATH, OPENAI_CHAT_PATH)
# Set by the edge on GET /v1/models for a tenant limited to some models: those models, comma
# separated (empty: none). It only narrows the server's list, so a sender cannot widen anything.
VISIBLE_MODELS_HEADER = "x-infermesh-visible-models"

# --- headers the edge sets for the model servers ---------------------------------------------
# A client's own copies are removed at the edge (every header with this prefix): only Envoy,
# after authenticating the caller, can set them.
INTERNAL_PREFIX = "x-infermesh-"
TENANT_HEADER = "x-infermesh-tenant"  # the authenticated tenant
TENANT_LABEL_HEADER = "x-infermesh-tenant-label"  # the tenant as counted ("other" if unlisted)
KEY_ID_HEADER = "x-infermesh-key-id"  # which API key authenticated the caller
JWT_TENANT_HEADER = "x-infermesh-jwt-tenant"  # jwt_authn's claim, read into metadata, removed
PRIORITY_PERMISSION_HEADER = "x-infermesh-priority"  # "allowed" | "denied"
VERSION_PERMISSION_HEADER = "x-infermesh-version"  # "allowed" | "denied"
RATE_LIMITED_HEADER = "x-infermesh-rate-limited"  # on a local rate limiter's refusal
FALLBACK_HEADER = "x-infermesh-fallback"  # the request reached a fallback model's cluster
AFFINITY_HEADER = "x-infermesh-affinity"  # the edge's key for an affinity model's hashing
# A model server's answer (header, or gRPC trailer): the prompt plus completion tokens a text
# generation used, which Envoy settles the tenant's token reservation with.
TOKENS_USED_HEADER = "x-infermesh-tokens-used"

# --- model servers' restricted API ------------------------------------------------------------
OPERATOR_HEADER = "infermesh-operator-key"  # the --restricted-api credential of compose and k8s

# --- telemetry: model servers (OTLP) -> control plane -----------------------------------------
INSTANCE_ID_ATTRIBUTE = "service.instance.id"  # the server's advertised HOST:PORT
REQUESTS = "inference_requests"
REQUEST_DURATION = "inference_request_duration_seconds"
QUEUE_DEPTH = "inference_queue_depth"
IN_FLIGHT = "inference_in_flight_requests"
MEMORY_USED = "accelerator_memory_used_bytes"
MEMORY_TOTAL = "accelerator_memory_total_bytes"
KV_BLOCKS_USED = "kv_cache_blocks_used"
KV_BLOCKS_TOTAL = "kv_cache_blocks_total"
PREFIX_HIT_TOKENS = "prefix_cache_hit_tokens"  # prompt tokens the prefix cache held
PREFIX_LOOKUP_TOKENS = "prefix_cache_lookup_tokens"  # prompt tokens looked up
MODEL_STATE = "model_state"
SERVER_DRAINING = "server_draining"
SERVER_LABEL = "server_label"  # routing labels a server reports (name, value)
# What the control plane reads, with its kind, and nothing else: a metric kept and never read
# costs every report its decoding, storing and memory.
TELEMETRY_KINDS = {
    REQUEST_DURATION: "histogram",
    REQUESTS: "counter",
    QUEUE_DEPTH: "gauge",
    IN_FLIGHT: "gauge",
    MEMORY_USED: "gauge",
    MEMORY_TOTAL: "gauge",
    KV_BLOCKS_USED: "gauge",
    KV_BLOCKS_TOTAL: "gauge",
    PREFIX_HIT_TOKENS: "counter",
    PREFIX_LOOKUP_TOKENS: "counter",
    MODEL_STATE: "gauge",
    SERVER_DRAINING: "gauge",
    SERVER_LABEL: "gauge",
}
# Fine enough for a P99 of sub-millisecond calls and wide enough for multi-second ones. Between
# 1 ms and 100 ms, where SLAs live, neighbouring bounds are at most 15% apart, so a P99
# interpolated inside a bucket is within 15% of the truth; the control plane weights on it, and
# maps Triton's cumulative latency onto the same bounds.
_LATENCY_BUCKETS_MS = (
    0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9,
    1, 1.15, 1.3, 1.5, 1.75, 2, 2.3, 2.6, 3, 3.5, 4, 4.5, 5, 5.75, 6.5, 7.5, 8.5,
    10, 11.5, 13, 15, 17.5, 20, 23, 26, 30, 35, 40, 45, 50, 57.5, 65, 75, 85,
    100, 125, 150, 200, 250, 300, 400, 500, 650, 800,
    1000, 1250, 1500, 2000, 2500, 3000, 4000, 5000, 6500, 8000, 10000,
)  # fmt: skip
LATENCY_BUCKETS_S = tuple(round(ms / 1000, 7) for ms in _LATENCY_BUCKETS_MS)

# --- telemetry: Envoy's stat sink -> control plane --------------------------------------------
ENVOY_NODE_TAG = "infermesh.envoy_node"  # a fixed stats tag: the reporting Envoy's node id
