"""Client identity and tenants through the real Envoy, configured by the real control plane.

API keys (Envoy's basic_auth against hashed keys): a missing or wrong key is UNAUTHENTICATED /
401, a model, version or priority a tenant may not use is PERMISSION_DENIED / 403 naming the
rule, a tenant over its limit is RESOURCE_EXHAUSTED / 429 with retry-after, gRPC and REST
sharing one bucket; the tenant reaches the model servers in a header Envoy sets (a client's
copy is dropped), and the servers count requests by tenant. No message holds a secret.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
import tritonclient.grpc as grpcclient
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm
from tritonclient.utils import InferenceServerException

from infermesh.api_keys import add_key, basic_authorization, new_key
from tests.edge_mesh_support import EdgeMesh, edge_mesh, image_input, rest
from tests.support import wait_for

pytestmark = pytest.mark.integration

ORIGIN = "https://app.example"
RESTRICTED = "restricted"  # a copy of the classifier only team-b may use
INFER = "/v2/models/{}/infer"
REST_BODY = json.dumps(
    {
        "inputs": [
            {"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}
        ]
    }
).encode()


class Tenants:
    def __init__(self, mesh: EdgeMesh, keys: dict[str, str], access_log: Path) -> None:
        self.mesh = mesh
        self.keys = keys
        self.access_log = access_log

    def headers(self, who: str | None, **more: str) -> dict[str, str]:
        auth = {"authorization": basic_authorization(self.keys[who])} if who else {}
        return {**auth, **more}

    def infer(self, who: str | None, model: str = "classifier", **kwargs: Any) -> Any:
        headers = self.headers(who, **kwargs.pop("headers", {}))
        client = grpcclient.InferenceServerClient(self.mesh.url)
        try:
            return client.infer(model, [image_input()], headers=headers, **kwargs)
        finally:
            client.close()

    def refused(self, who: str | None, model: str = "classifier", **kwargs: Any) -> Any:
        with pytest.raises(InferenceServerException) as info:
            self.infer(who, model, **kwargs)
        return info.value

    def rest_infer(self, who: str | None, model: str = "classifier", **more: str) -> Any:
        headers = {"content-type": "application/json", **self.headers(who, **more)}
        return rest(self.mesh, "POST", INFER.format(model), REST_BODY, headers)

    def served(self, tenant: str, model: str = "classifier") -> float:
        return self.mesh.served_for(tenant, model)


@pytest.fixture(scope="module")
def tenants(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    workdir = tmp_path_factory.mktemp("edge-tenants")
    keys = {
        "team-a": new_key("team-a"),
        "team-a-second": new_key("team-a"),  # two keys, one tenant
        "team-b": new_key("team-b"),
        "stranger": new_key("stranger"),  # a valid key of a tenant the topology does not list
    }
    for key in keys.values():
        add_key(workdir / "api-keys", key)
    listener = {
        "auth": {"mode": "api_keys", "api_keys_file": str(workdir / "api-keys")},
        "access_log": str(workdir / "access.log"),
        "cors": {"allow_origins": [ORIGIN]},
    }
    limit = {"requests_per_s": 0.2, "burst": 2}  # one token every 5 s: the third call waits
    top = {
        "tenants": {
            "team-a": {"models": ["classifier"]},
            "team-b": {"may_set_priority": True, "may_pick_version": True,
                       "model_rate_limits": {RESTRICTED: limit}},
        }
    }  # fmt: skip
    with edge_mesh(demo_repo, workdir, listener, top, copies=(RESTRICTED,)) as mesh:
        yield Tenants(mesh, keys, workdir / "access.log")


def test_a_missing_or_wrong_key_is_unauthenticated_and_never_echoed(tenants: Tenants) -> None:
    secret = tenants.keys["team-a"].partition(":")[2]
    key_id = tenants.keys["team-a"].partition(":")[0]
    wrong = {"authorization": basic_authorization(f"{key_id}:{secret[:-1]}x")}
    unknown = {"authorization": basic_authorization(f"team-a.nokey:{secret}")}
    bearer = {"authorization": f"Bearer {secret}"}
    for headers in ({}, wrong, unknown, bearer):
        error = tenants.refused(None, headers=headers)
        assert error.status() == "StatusCode.UNAUTHENTICATED", error
        assert "authentication failed" in error.message() and secret not in error.message()
        status, _, body = tenants.rest_infer(None, **headers)
        assert status == 401 and secret not in body.decode()
        assert "authentication failed" in json.loads(body)["error"]
    # Spoofed identity headers are no credential.
    spoof = {"x-infermesh-tenant": "team-a", "x-infermesh-key-id": "team-a.x"}
    assert tenants.refused(None, headers=spoof).status() == "StatusCode.UNAUTHENTICATED"


def test_the_tenant_reaches_the_servers_as_envoy_set_it(tenants: Tenants) -> None:
    before_a, before_b = tenants.served("team-a"), tenants.served("team-b")
    # Header-less (body-routed) gRPC, with a forged identity that must not count.
    forged = {"x-infermesh-tenant": "team-b", "x-infermesh-tenant-label": "team-b"}
    result = tenants.infer("team-a", headers=forged)
    assert result.as_numpy("probs").shape == (1, 10)
    tenants.infer("team-a-second")  # the tenant's second key
    status, _, body = tenants.rest_infer("team-a", **forged)
    assert status == 200, body
    assert tenants.served("team-a") == before_a + 3
    assert tenants.served("team-b") == before_b

    def logged() -> list[dict[str, Any]]:
        lines = tenants.access_log.read_text().splitlines() if tenants.access_log.exists() else []
        return [json.loads(line) for line in lines if '"team-a"' in line]

    wait_for(lambda: len(logged()) >= 3, 10, "team-a's calls in Envoy's access log")
    entries = logged()
    assert {(e["tenant"], e["tenant_label"]) for e in entries} == {("team-a", "team-a")}


def test_a_tenant_is_refused_a_model_it_may_not_use(tenants: Tenants) -> None:
    before = tenants.served("team-a", RESTRICTED)
    # Body-routed: the Lua filter names the model, then the tenants' rules refuse it.
    for headers in ({}, {"x-model-name": RESTRICTED}):
        error = tenants.refused("team-a", RESTRICTED, headers=headers)
        assert error.status() == "StatusCode.PERMISSION_DENIED", error
        assert "team-a" in error.message() and "may_use_only" not in error.message()
        assert "may_not_use_this_model" in error.message(), error.message()
    status, _, body = tenants.rest_infer("team-a", RESTRICTED)
    assert status == 403 and "may_not_use_this_model" in json.loads(body)["error"]
    # The routing header naming an allowed model, the body another: the server refuses it.
    error = tenants.refused("team-a", RESTRICTED, headers={"x-model-name": "classifier"})
    assert error.status() == "StatusCode.INVALID_ARGUMENT", error
    assert "x-model-name" in error.message()
    # The same for the model's metadata, readiness and configuration.
    client = grpcclient.InferenceServerClient(tenants.mesh.url)
    spoofed = tenants.headers("team-a", **{"x-model-name": "classifier"})
    for call in (client.get_model_metadata, client.is_model_ready):
        with pytest.raises(InferenceServerException) as info:
            call(RESTRICTED, headers=spoofed)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", call
    assert client.get_model_metadata("classifier", headers=spoofed).name == "classifier"
    client.close()
    assert tenants.served("team-a", RESTRICTED) == before
    assert tenants.infer("team-b", RESTRICTED).as_numpy("probs").shape == (1, 10)


def test_priority_and_versions_are_per_tenant_permissions(tenants: Tenants) -> None:
    error = tenants.refused("team-a", headers={"x-priority": "1"})
    assert error.status() == "StatusCode.PERMISSION_DENIED"
    assert "may_not_set_x-priority" in error.message()
    # In the body (Envoy cannot read it): the server refuses it, told by Envoy.
    error = tenants.refused("team-a", priority=1)
    assert error.status() == "StatusCode.PERMISSION_DENIED"
    assert "may not set a request priority" in error.message()
    for kwargs in ({"model_version": "1"}, {"headers": {"x-model-version": "1"}}):
        error = tenants.refused("team-a", **kwargs)
        assert error.status() == "StatusCode.PERMISSION_DENIED", kwargs
        assert "may_not_choose_a_model_version" in error.message()
    status, _, _ = rest(tenants.mesh, "POST", "/v2/models/classifier/versions/1/infer",
                        REST_BODY, tenants.headers("team-a"))  # fmt: skip
    assert status == 403
    # The routing header set (no Lua), the version only in the body: the server refuses it,
    # told by Envoy's x-infermesh-version.
    error = tenants.refused("team-a", model_version="1", headers={"x-model-name": "classifier"})
    assert error.status() == "StatusCode.PERMISSION_DENIED", error
    assert "may not choose a model version" in error.message()
    trusted = tenants.infer("team-b", priority=1, model_version="1")
    assert trusted.get_response().model_version == "1"


def test_an_identity_that_is_not_a_tenant_is_refused(tenants: Tenants) -> None:
    error = tenants.refused("stranger")
    assert error.status() == "StatusCode.PERMISSION_DENIED"
    assert "is_not_a_tenant" in error.message()


def test_a_tenant_over_its_limit_waits_gRPC_and_REST_sharing_one_bucket(
    tenants: Tenants,
) -> None:
    answers: list[tuple[str, int, dict[str, str]]] = []
    for call in range(4):
        if call % 2 == 0:
            try:
                tenants.infer("team-b", RESTRICTED)
                answers.append(("grpc", 200, {}))
            except InferenceServerException as exc:
                assert exc.status() == "StatusCode.RESOURCE_EXHAUSTED", exc
                assert "retry-after" in exc.message() and "tenant" in exc.message()
                answers.append(("grpc", 429, {}))
        else:
            status, headers, body = tenants.rest_infer("team-b", RESTRICTED)
            answers.append(("rest", status, headers))
            if status == 429:
                assert "rate limited" in json.loads(body)["error"]
    # Burst 2 (the earlier test may have taken one token): at least one of the four refused,
    # the refusals last, each REST one saying when to come back.
    codes = [code for _, code, _ in answers]
    assert 429 in codes and codes == sorted(codes), answers
    for kind, code, headers in answers:
        if kind == "rest" and code == 429:
            assert int(headers["retry-after"]) == 5
    # Another tenant, and the same tenant on another model, are not limited.
    assert tenants.infer("team-a").as_numpy("probs").shape == (1, 10)
    assert tenants.infer("team-b").as_numpy("probs").shape == (1, 10)
    assert tenants.mesh.envoy.counter("tenant_rate_limit.http_local_rate_limit.rate_limited") >= 1


def test_health_and_metadata_need_a_key_too(tenants: Tenants) -> None:
    status, _, _ = rest(tenants.mesh, "GET", "/v2/health/ready")
    assert status == 401
    status, _, body = rest(tenants.mesh, "GET", "/v2/models/classifier",
                           headers=tenants.headers("team-a"))  # fmt: skip
    assert status == 200 and json.loads(body)["name"] == "classifier"


def test_a_browser_preflight_needs_no_key_and_its_call_sends_one(tenants: Tenants) -> None:
    """Browsers send CORS preflights without credentials; the call after it has the key."""
    ask = {"origin": ORIGIN, "access-control-request-method": "POST",
           "access-control-request-headers": "content-type,authorization"}  # fmt: skip
    status, headers, _ = rest(tenants.mesh, "OPTIONS", INFER.format("classifier"), b"", ask)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in headers["access-control-allow-headers"]
    status, headers, _ = tenants.rest_infer("team-a", origin=ORIGIN)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "retry-after" in headers["access-control-expose-headers"]
    status, _, _ = tenants.rest_infer(None, origin=ORIGIN)
    assert status == 401  # the preflight let nothing else through
    # A "preflight" with an empty header is no preflight to Envoy's CORS filter, which then
    # passed it to the route: before, that reached a model server with no key.
    for empty in ("origin", "access-control-request-method"):
        status, _, _ = rest(tenants.mesh, "OPTIONS", INFER.format("classifier"), b"x",
                            {**ask, empty: ""})  # fmt: skip
        assert status == 401, empty


# --- JWTs --------------------------------------------------------------------------------------

ISSUER = "https://issuer.infermesh.test"
AUDIENCE = "infermesh"


class Issuer:
    """An RS256 signing key and the JWKS of its public half."""

    def __init__(self, kid: str) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        public = json.loads(RSAAlgorithm.to_jwk(self.key.public_key()))
        self.jwks = {"keys": [{**public, "kid": kid, "alg": "RS256", "use": "sig"}]}
        self.kid = kid

    def token(self, **claims: Any) -> str:
        """A signed token; a claim given as None is left out."""
        payload = {"iss": ISSUER, "aud": AUDIENCE, "sub": "team-a", "exp": time.time() + 600,
                   **claims}  # fmt: skip
        payload = {k: v for k, v in payload.items() if v is not None}
        return jwt.encode(payload, self.key, algorithm="RS256", headers={"kid": self.kid})


@pytest.fixture(scope="module")
def jwt_mesh(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EdgeMesh, Issuer]]:
    workdir = tmp_path_factory.mktemp("edge-jwt")
    issuer = Issuer("k1")
    (workdir / "jwks.json").write_text(json.dumps(issuer.jwks))
    jwt_auth = {"issuer": ISSUER, "audiences": [AUDIENCE], "jwks_file": "jwks.json"}
    listener = {"auth": {"mode": "jwt", "jwt": jwt_auth}}
    top = {"tenants": {"team-a": {}, "other": {"models": ["classifier"]}}}
    with edge_mesh(demo_repo, workdir, listener, top, copies=(RESTRICTED,)) as mesh:
        yield mesh, issuer


def _bearer(mesh: EdgeMesh, token: str, model: str = "classifier") -> Any:
    client = grpcclient.InferenceServerClient(mesh.url)
    try:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return client.infer(model, [image_input()], headers=headers)
    finally:
        client.close()


def test_a_jwt_without_the_tenant_claim_is_no_identity(jwt_mesh: tuple[EdgeMesh, Issuer]) -> None:
    mesh, issuer = jwt_mesh
    nameless = issuer.token(sub=None)  # valid signature, issuer, audience; no tenant
    for kwargs in ({}, {"priority": 1}):
        client = grpcclient.InferenceServerClient(mesh.url)
        with pytest.raises(InferenceServerException) as info:
            client.infer("classifier", [image_input()],
                         headers={"authorization": f"Bearer {nameless}"}, **kwargs)  # fmt: skip
        client.close()
        assert info.value.status() == "StatusCode.PERMISSION_DENIED"
        assert "credential_names_no_tenant" in info.value.message()


def test_jwts_are_checked_and_name_the_tenant(jwt_mesh: tuple[EdgeMesh, Issuer]) -> None:
    mesh, issuer = jwt_mesh
    before = mesh.served_for("team-a"), mesh.served_for("other")
    assert _bearer(mesh, issuer.token()).as_numpy("probs").shape == (1, 10)
    # An identity the topology does not name gets the `other` policy and label.
    assert _bearer(mesh, issuer.token(sub="someone")).as_numpy("probs").shape == (1, 10)
    assert (mesh.served_for("team-a"), mesh.served_for("other")) == (before[0] + 1, before[1] + 1)
    assert mesh.served_for("someone") == 0  # never a label of its own
    with pytest.raises(InferenceServerException) as info:
        _bearer(mesh, issuer.token(sub="someone"), RESTRICTED)
    assert info.value.status() == "StatusCode.PERMISSION_DENIED"
    assert _bearer(mesh, issuer.token(), RESTRICTED).as_numpy("probs").shape == (1, 10)


@pytest.mark.parametrize(
    ("claims", "status", "words"),
    [
        (None, "UNAUTHENTICATED", "Jwt is missing"),
        ({"exp": 1_000_000}, "UNAUTHENTICATED", "Jwt is expired"),
        ({"iss": "https://elsewhere.test"}, "UNAUTHENTICATED", "issuer is not configured"),
        ({"aud": "another-service"}, "PERMISSION_DENIED", "Audiences in Jwt are not allowed"),
        ({"forged": True}, "UNAUTHENTICATED", "Jwt verification fails"),
    ],
    ids=["missing", "expired", "issuer", "audience", "signature"],
)
def test_a_bad_jwt_is_refused_saying_why(
    jwt_mesh: tuple[EdgeMesh, Issuer], claims: dict[str, Any] | None, status: str, words: str
) -> None:
    mesh, issuer = jwt_mesh
    if claims is None:
        token = ""
    elif claims.pop("forged", False):
        token = Issuer("k1").token()  # signed by another key under the same kid
    else:
        token = issuer.token(**claims)
    with pytest.raises(InferenceServerException) as info:
        _bearer(mesh, token)
    assert info.value.status() == f"StatusCode.{status}", info.value
    assert words in info.value.message() and (not token or token not in info.value.message())
    status_code, _, body = rest(mesh, "POST", INFER.format("classifier"), REST_BODY,
                               {"authorization": f"Bearer {token}"} if token else {})  # fmt: skip
    assert status_code == (403 if status == "PERMISSION_DENIED" else 401)
    assert words in json.loads(body)["error"]


def test_status_warns_only_while_authentication_is_off(
    tenants: Tenants, demo_repo: Path, tmp_path: Path
) -> None:
    # These meshes run plaintext telemetry on loopback: /status says so, and nothing else.
    (plaintext,) = tenants.mesh.plane.admin_get("/status")["warnings"]
    assert "is plaintext (development: loopback only)" in plaintext
    frame = tenants.mesh.plane.call(tenants.mesh.plane.plane.api.live_frame())
    assert frame["warnings"] == [plaintext]
    with edge_mesh(demo_repo, tmp_path, {"auth": {"mode": "off"}}) as open_mesh:
        warning, _ = open_mesh.plane.admin_get("/status")["warnings"]
        assert "authentication is off on the public listener" in warning
        frame = open_mesh.plane.call(open_mesh.plane.plane.api.live_frame())
        assert frame["warnings"][0] == warning  # the live view's banner
