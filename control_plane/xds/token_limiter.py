"""The token limiter: Envoy's rate limit service (envoy.service.ratelimit.v3), served by the
control plane on its xDS port, over the same mTLS and for mesh Envoys only.

Envoy's ratelimit filter (``control_plane.xds.token_admission``) calls it twice per request:

- **reserve**, before the request goes upstream: the descriptor (tenant label, model, phase
  ``reserve``, kind ``unary`` or ``stream``, request id) with ``hits_addend`` = the request's
  token bound (``max_tokens`` plus the prompt's bound, computed by the admission Lua script; a
  stream's, at most the burst). OVER_LIMIT refuses the request: Envoy answers 429 /
  RESOURCE_EXHAUSTED with ``retry-after`` and the message naming the limit.
- **settle**, when the stream ends (``apply_on_stream_done``): the same descriptor with phase
  ``settle`` and ``hits_addend`` = the tokens the model server reported it used (its
  ``x-infermesh-tokens-used`` header or trailer). The ledger refunds the difference. A request
  whose usage never came back (an upstream reset) sends no settlement: its reservation stays
  charged.

The identity is what Envoy proved: the tenant label is the tenants RBAC filter's shadow result
(named tenant, else ``other``), the model the route's metadata; nothing a client sends is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import struct_pb2

from control_plane.metrics import ControlPlaneMetrics
from control_plane.model.mesh import OTHER_TENANT, EdgeAuth
from control_plane.model.tokens import Admission, TokenLedger
from infermesh import pki
from infermesh.wire import RATE_LIMITED_HEADER

log = logging.getLogger(__name__)

DOMAIN = "infermesh.tokens"
RESERVE, SETTLE = "reserve", "settle"
# Descriptor entry keys (control_plane.xds.token_admission builds them in this order).
TENANT_KEY, MODEL_KEY, PHASE_KEY, REQUEST_KEY = "tenant", "model", "phase", "request"
KIND_KEY, UNARY, STREAM = "kind", "unary", "stream"  # a stream's bound is unknown when it opens
TOKENS_LIMITED = "tokens"  # x-infermesh-rate-limited on a token limit's 429
MESSAGE_KEY = "token_limit"  # the refusal's words, in the ratelimit filter's dynamic metadata
OK, OVER = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT


def refusal(tenant: str, model: str, answer: Admission, limit_words: str) -> str:
    what = f"tenant {tenant!r} on model {model!r} ({limit_words})"
    if answer.retry_after_s == 0:
        return (
            f"token limit: this request reserves {answer.tokens} tokens (max_tokens plus the "
            f"prompt), more than the burst of {what}; ask for fewer max_tokens"
        )
    return (
        f"token limit: {what} has {max(0, int(answer.available))} tokens left and this request "
        f"reserves {answer.tokens}; retry after {answer.retry_after_s} s"
    )


class TokenLimiter(rls_pb2_grpc.RateLimitServiceServicer):
    """``auth``: the current tenants (read per call, so a new topology applies at once);
    ``models``: the topology's model names (the only model labels of the counters);
    ``trust_domain``: with xDS mTLS, only a mesh Envoy's certificate may call."""

    def __init__(
        self,
        auth: Callable[[], EdgeAuth],
        models: Callable[[], frozenset[str]],
        metrics: ControlPlaneMetrics,
        trust_domain: str | None = None,
        ledger: TokenLedger | None = None,
    ) -> None:
        self.auth = auth
        self.models = models
        self.metrics = metrics
        self.trust_domain = trust_domain
        self.ledger = ledger or TokenLedger()

    async def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest, context: Any
    ) -> rls_pb2.RateLimitResponse:
        if self.trust_domain is not None:
            peer = pki.peer_spiffe_id(context.auth_context()) or ""
            who = pki.mesh_peer(peer, self.trust_domain)
            if who is None or who.kind != "envoy":
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED, f"{peer or 'this peer'} is not a mesh Envoy"
                )
        return self.decide(request)

    def decide(self, request: rls_pb2.RateLimitRequest) -> rls_pb2.RateLimitResponse:
        """The answer to one call (every descriptor; OVER_LIMIT if any is refused)."""
        response = rls_pb2.RateLimitResponse(overall_code=OK)
        if request.domain != DOMAIN:
            return response
        for descriptor in request.descriptors:
            entries = {e.key: e.value for e in descriptor.entries}
            hits = (
                descriptor.hits_addend.value
                if descriptor.HasField("hits_addend")
                else request.hits_addend or 1
            )
            status = self._one(entries, int(hits), response)
            response.statuses.append(rls_pb2.RateLimitResponse.DescriptorStatus(code=status))
            if status == OVER:
                response.overall_code = OVER
        return response

    def _labels(self, entries: dict[str, str]) -> tuple[str, str]:
        auth = self.auth()
        tenant = entries.get(TENANT_KEY, OTHER_TENANT)
        if auth.tenant(tenant) is None:
            tenant = OTHER_TENANT
        model = entries.get(MODEL_KEY, "")
        return tenant, model if model in self.models() else "other"

    def _one(self, entries: dict[str, str], hits: int, response: Any) -> Any:
        tenant, model = self._labels(entries)
        limit = self.auth().token_limit(tenant, model) if model != "other" else None
        if limit is None:
            return OK
        request_id = entries.get(REQUEST_KEY, "")
        tokens = self.metrics.tenant_tokens
        if entries.get(PHASE_KEY) == SETTLE:
            refund = self.ledger.settle(tenant, model, limit, hits, request_id)
            tokens.labels(tenant, model, "used").inc(hits)
            if refund > 0:
                tokens.labels(tenant, model, "refunded").inc(refund)
            return OK
        if entries.get(KIND_KEY) == STREAM:
            # Its requests come later on the stream: reserve what the bucket may hold, and
            # the settlement charges the rest (debt the next requests wait out).
            hits = min(hits, limit.burst)
        answer = self.ledger.reserve(tenant, model, limit, hits, request_id)
        if answer.admitted:
            tokens.labels(tenant, model, "reserved").inc(answer.tokens)
            return OK
        self.metrics.tenant_token_refusals.labels(tenant, model).inc()
        message = refusal(tenant, model, answer, limit.describe())
        wait = answer.retry_after_s or max(1, round(limit.burst / limit.tokens_per_s))
        response.response_headers_to_add.extend(
            [
                base_pb2.HeaderValue(key="retry-after", value=str(wait)),
                base_pb2.HeaderValue(key=RATE_LIMITED_HEADER, value=TOKENS_LIMITED),
            ]
        )
        response.raw_body = message.encode()
        response.dynamic_metadata.CopyFrom(
            struct_pb2.Struct(fields={MESSAGE_KEY: struct_pb2.Value(string_value=message)})
        )
        return OVER
