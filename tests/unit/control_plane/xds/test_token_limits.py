"""The token limiter's answers (envoy.service.ratelimit.v3) and the filters that ask it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.config.route.v3 import route_components_pb2 as rc_pb2
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf import wrappers_pb2

from control_plane.metrics import ControlPlaneMetrics
from control_plane.model.mesh import EdgeAuth, TenantPolicy, TokenLimit
from control_plane.model.tokens import TokenLedger
from control_plane.xds import identity, token_admission
from control_plane.xds.resources import ROUTER_FILTER as ROUTER
from control_plane.xds.resources import http_filters
from control_plane.xds.token_limiter import DOMAIN, OK, OVER, TokenLimiter

LIMIT = TokenLimit(1.0, 100)
AUTH = EdgeAuth(
    "api_keys",
    tenants=(
        TenantPolicy("team-a", model_token_limits=(("lm", LIMIT),)),
        TenantPolicy("other", token_limit=TokenLimit(1.0, 10)),
    ),
)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def limiter(auth: EdgeAuth = AUTH) -> TokenLimiter:
    return TokenLimiter(
        lambda: auth, lambda: frozenset({"lm", "classifier"}), ControlPlaneMetrics(),
        ledger=TokenLedger(Clock()),
    )  # fmt: skip


def call(
    who: str, model: str, phase: str, hits: int, request: str = "r1", domain: str = DOMAIN
) -> rls_pb2.RateLimitRequest:
    entries = [("tenant", who), ("model", model), ("phase", phase), ("request", request)]
    descriptor = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries],
        hits_addend=wrappers_pb2.UInt64Value(value=hits),
    )
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=[descriptor])


def test_reserve_then_settle_then_refuse_with_words_and_retry_after() -> None:
    service = limiter()
    assert service.decide(call("team-a", "lm", "reserve", 90)).overall_code == OK
    refused = service.decide(call("team-a", "lm", "reserve", 50, "r2"))
    assert refused.overall_code == OVER
    headers = {h.key: h.value for h in refused.response_headers_to_add}
    assert headers == {"retry-after": "40", "x-infermesh-rate-limited": "tokens"}
    message = refused.raw_body.decode()
    assert message == (
        "token limit: tenant 'team-a' on model 'lm' (60 tokens/min, burst 100) has 10 tokens "
        "left and this request reserves 50; retry after 40 s"
    )
    assert refused.dynamic_metadata.fields["token_limit"].string_value == message
    assert service.decide(call("team-a", "lm", "settle", 20)).overall_code == OK  # refunds 70
    assert service.decide(call("team-a", "lm", "reserve", 50, "r2")).overall_code == OK
    text = service.metrics.registry.get_sample_value
    labels = {"tenant": "team-a", "model": "lm"}
    assert text("tenant_tokens_total", {**labels, "event": "reserved"}) == 140
    assert text("tenant_tokens_total", {**labels, "event": "refunded"}) == 70
    assert text("tenant_tokens_total", {**labels, "event": "used"}) == 20
    assert text("tenant_token_refusals_total", labels) == 1


def test_labels_stay_bounded_and_unlimited_calls_pass() -> None:
    service = limiter()
    # A tenant not listed is `other` (limit 10); a model not in the topology is not limited.
    assert service.decide(call("stranger", "lm", "reserve", 11)).overall_code == OVER
    assert service.decide(call("stranger", "ghost", "reserve", 10**6)).overall_code == OK
    assert service.decide(call("team-a", "classifier", "reserve", 10**6)).overall_code == OK
    assert service.decide(call("team-a", "lm", "reserve", 10**6, domain="x")).overall_code == OK
    text = service.metrics.registry.get_sample_value
    assert text("tenant_token_refusals_total", {"tenant": "other", "model": "lm"}) == 1
    assert text("tenant_token_refusals_total", {"tenant": "stranger", "model": "lm"}) is None


def test_a_request_larger_than_the_burst_is_told_to_ask_for_fewer_tokens() -> None:
    refused = limiter().decide(call("team-a", "lm", "reserve", 10**9))
    assert refused.overall_code == OVER
    assert "more than the burst" in refused.raw_body.decode()
    assert {h.key: h.value for h in refused.response_headers_to_add}["retry-after"] == "100"


def _manager_filters(auth: EdgeAuth) -> list[str]:
    return [f.name for f in http_filters(True, auth=auth, models=("lm",))]


def test_the_token_filters_come_last_before_the_router_and_only_when_limited() -> None:
    names = _manager_filters(AUTH)
    assert names[-3:] == [
        token_admission.ADMISSION_FILTER, token_admission.LIMIT_FILTER, "envoy.filters.http.router"
    ]  # fmt: skip
    assert token_admission.ADMISSION_FILTER not in _manager_filters(EdgeAuth("api_keys"))
    assert token_admission.ADMISSION_FILTER not in _manager_filters(
        EdgeAuth("off", tenants=AUTH.tenants)
    )


def test_the_router_keeps_the_header_that_tells_an_upstream_answer_from_envoys_own() -> None:
    """The admission script settles 0 for an answer without x-envoy-upstream-service-time (no
    model ran). Suppressing Envoy's headers on the router would make every answer look like
    Envoy's own, and every generation free."""
    (router,) = [f for f in http_filters(True, auth=AUTH, models=("lm",)) if f.name == ROUTER]
    config = router_pb2.Router()
    assert router.typed_config.Unpack(config)
    assert not config.suppress_envoy_headers
    assert "x-envoy-upstream-service-time" in token_admission.lua_source()


def test_the_limiter_fails_closed_unless_the_topology_says_open() -> None:
    def config(auth: EdgeAuth) -> rate_limit_pb2.RateLimit:
        limit = rate_limit_pb2.RateLimit()
        filters = token_admission.token_filters(auth)
        filters[1].typed_config.Unpack(limit)
        return limit

    closed = config(AUTH)
    assert closed.failure_mode_deny and closed.status_on_error.code == 503
    assert closed.rate_limited_as_resource_exhausted
    reserve, settle = closed.rate_limits
    assert not reserve.apply_on_stream_done and settle.apply_on_stream_done
    assert "infermesh.tokens:reserve" in reserve.hits_addend.format
    assert "infermesh.tokens:used" in settle.hits_addend.format
    opened = EdgeAuth("api_keys", tenants=AUTH.tenants, token_limiter_fail_open=True)
    assert not config(opened).failure_mode_deny


def test_preflights_skip_the_token_filters() -> None:
    route = identity.unauthenticated(rc_pb2.Route())
    assert token_admission.ADMISSION_FILTER in route.typed_per_filter_config
    assert token_admission.LIMIT_FILTER in route.typed_per_filter_config


def test_a_model_nobody_is_token_limited_on_skips_both_filters() -> None:
    limited = identity.mark_model(rc_pb2.Route(), "lm")
    unlimited = identity.mark_model(rc_pb2.Route(), "classifier")
    nameless = rc_pb2.Route(name="no-model-name")
    only_lm = EdgeAuth("api_keys", tenants=AUTH.tenants[:1])  # `other` limits every model
    for item in (limited, unlimited, nameless):
        token_admission.skip_unlimited(item, only_lm)
    assert not token_admission.skip_unlimited(
        identity.mark_model(rc_pb2.Route(), "classifier"), AUTH
    ).typed_per_filter_config
    skipped = {token_admission.ADMISSION_FILTER, token_admission.LIMIT_FILTER}
    assert not set(limited.typed_per_filter_config)
    assert set(unlimited.typed_per_filter_config) == skipped
    assert not set(nameless.typed_per_filter_config)  # body-routed calls start here


def test_the_admission_script_reads_a_bounded_prefix_and_keeps_its_own_names() -> None:
    source = token_admission.lua_source()
    assert "grpc = 65536, json = 1048576" in source
    assert '"infermesh.tokens"' in source and '"x-infermesh-tokens-used"' in source
    assert "local function varint" in source and "VARINT" not in source
    assert token_admission.RESERVATION_HEADER in source and "ID_HEADER" not in source


class Context:
    """What ShouldRateLimit reads of a gRPC call: the peer's SPIFFE ID, and abort."""

    def __init__(self, spiffe_id: str) -> None:
        self.spiffe_id = spiffe_id
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"peer_spiffe_id": [self.spiffe_id.encode()]} if self.spiffe_id else {}

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.aborted = (code, message)
        raise RuntimeError("aborted")


def test_with_xds_tls_only_a_mesh_envoy_may_reserve_or_settle() -> None:
    service = TokenLimiter(
        lambda: AUTH, lambda: frozenset({"lm"}), ControlPlaneMetrics(), "infermesh.local",
        TokenLedger(Clock()),
    )  # fmt: skip
    envoy = Context("spiffe://infermesh.local/envoy/envoy-1")
    answer = asyncio.run(service.ShouldRateLimit(call("team-a", "lm", "reserve", 10), envoy))
    assert answer.overall_code == OK and envoy.aborted is None
    for peer in ("spiffe://infermesh.local/model-server/127.0.0.1/8001",
                 "spiffe://elsewhere/envoy/envoy-1", ""):  # fmt: skip
        context = Context(peer)
        with pytest.raises(RuntimeError):
            asyncio.run(service.ShouldRateLimit(call("team-a", "lm", "settle", 0), context))
        assert context.aborted is not None
        assert context.aborted[0] == grpc.StatusCode.PERMISSION_DENIED
    assert service.ledger.available("team-a", "lm") == 90  # no refund from a non-Envoy
