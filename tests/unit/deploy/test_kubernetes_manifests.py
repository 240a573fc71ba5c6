"""deploy/kubernetes/: every object validates against the Kubernetes schemas (strict: unknown
fields are errors), and the manifests agree with the programs they run: command lines parse
with the real parsers, ports and probes line up, the drain fits in the grace period, the
topology is valid, and the control plane may watch EndpointSlices."""

from __future__ import annotations

import copy
import dataclasses
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from control_plane.app.cli import build_parser as control_plane_parser
from control_plane.config.kubernetes_source import KubernetesEndpoint
from control_plane.config.topology import Topology, parse_topology_text
from control_plane.xds.bootstrap import build_parser as bootstrap_parser
from control_plane.xds.bootstrap import prepare_xds_tls
from infermesh import pki
from infermesh.api_keys import add_key, new_key
from model_server.cli import build_parser as model_server_parser
from tests.support import ROOT

MANIFESTS = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"  # the schemas checked against (bundled by kubernetes-validate)
NAMESPACE = "infermesh"


def documents() -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        found += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return found


def named(kind: str, name: str) -> dict[str, Any]:
    matches = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


WORKLOADS = ("Deployment", "StatefulSet")


def workload(name: str) -> dict[str, Any]:
    matches = [
        d for _, d in documents() if d["kind"] in WORKLOADS and d["metadata"]["name"] == name
    ]
    assert len(matches) == 1, f"workload {name}: {len(matches)} found"
    return matches[0]


def container(name: str) -> dict[str, Any]:
    containers = workload(name)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def expand(command: list[str], env: dict[str, str]) -> list[str]:
    """The command as the kubelet runs it: $(VAR) replaced from the container's env."""
    out = []
    for arg in command:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        out.append(arg)
    return out


def port_number(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return int(next(p["containerPort"] for p in c["ports"] if p["name"] == port))


def probes(c: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        if kind in c:
            yield kind, c[kind]


SECRET_MOUNT = "/etc/infermesh-credentials/"


PKI_MOUNT = "/etc/infermesh-pki"
POD_ENV = {"POD_IP": "10.1.2.3", "POD_NAME": "infermesh-model-server-7d9f-x2x",
           "POD_NAMESPACE": NAMESPACE}  # fmt: skip


def configmap_topology(tmp_path: Path) -> Topology:
    """The ConfigMap's topology as the control plane loads it, its Secret's api-keys (one
    key, made here) in ``tmp_path`` and its certificates as cert-manager would make them
    (``mount_as_cert_manager``)."""
    add_key(tmp_path / "api-keys", new_key("team-a"))
    pki_dir = mount_as_cert_manager(tmp_path / "cert-manager", "infermesh-control-plane")
    text = named("ConfigMap", "infermesh-topology")["data"]["topology.yaml"]
    text = text.replace(SECRET_MOUNT, f"{tmp_path}/").replace(PKI_MOUNT, str(pki_dir))
    return parse_topology_text(text, "ConfigMap infermesh-topology", require_auth=True)


# -- cert-manager ----------------------------------------------------------------------------
CERT_MANAGER_KINDS = ("Certificate", "Issuer")
# The cert-manager.io/v1 fields these manifests may use (no schema is bundled for CRDs).
CERTIFICATE_SPEC = {
    "secretName", "commonName", "dnsNames", "uris", "ipAddresses", "duration", "renewBefore",
    "usages", "isCA", "privateKey", "issuerRef", "subject", "secretTemplate",
}  # fmt: skip
PRIVATE_KEY = {"algorithm", "size", "encoding", "rotationPolicy"}
USAGES = {"digital signature", "key encipherment", "server auth", "client auth"}


def issued_secrets(workdir: Path) -> dict[str, dict[str, bytes]]:
    """Every Certificate's Secret as cert-manager fills it (tls.crt, tls.key, ca.crt), made
    by infermesh.pki from the Certificate's own fields: its URI SAN is the identity and its
    DNS names ride along; the CA's common name carries the trust domain."""
    ca_spec = named("Certificate", "infermesh-ca")["spec"]
    assert ca_spec["isCA"] is True
    prefix = "InferMesh CA "
    assert ca_spec["commonName"].startswith(prefix)
    authority = pki.init_authority(workdir / "ca", ca_spec["commonName"].removeprefix(prefix))
    ca_pem = (workdir / "ca" / "ca.crt").read_bytes()
    secrets = {ca_spec["secretName"]: {"ca.crt": ca_pem}}
    for _, doc in documents():
        if doc["kind"] != "Certificate" or doc["spec"].get("isCA"):
            continue
        spec = doc["spec"]
        assert spec["issuerRef"]["name"] == "infermesh-ca"
        if spec.get("uris"):
            (uri,) = spec["uris"]
            who = pki.parse_spiffe_id(uri)
            assert who is not None, uri
        else:  # the edge's: a server certificate for the Service's names
            who = pki.edge(spec["dnsNames"][0], authority.trust_domain)
        who = dataclasses.replace(who, dns=tuple(spec.get("dnsNames", ())))
        files = pki.issue(authority, who, workdir / doc["metadata"]["name"])
        secrets[spec["secretName"]] = {
            "tls.crt": files.cert.read_bytes(), "tls.key": files.key.read_bytes(), "ca.crt": ca_pem,
        }  # fmt: skip
    return secrets


def mount_as_cert_manager(workdir: Path, workload_name: str) -> Path:
    """The workload's projected ``pki`` volume as the kubelet lays it out from the Secrets."""
    secrets = issued_secrets(workdir)
    volumes = workload(workload_name)["spec"]["template"]["spec"]["volumes"]
    projected = next(v["projected"] for v in volumes if v["name"] == "pki")
    mount = workdir / f"{workload_name}-pki"
    mount.mkdir()
    for source in projected["sources"]:
        secret = secrets[source["secret"]["name"]]
        for item in source["secret"]["items"]:
            (mount / item["path"]).write_bytes(secret[item["key"]])
    return mount


def test_cert_manager_objects_use_known_fields_and_one_issuer() -> None:
    found = [d for _, d in documents() if d["kind"] in CERT_MANAGER_KINDS]
    assert {d["kind"] for d in found} == set(CERT_MANAGER_KINDS)
    for doc in found:
        assert doc["apiVersion"] == "cert-manager.io/v1"
        spec = doc["spec"]
        if doc["kind"] == "Issuer":
            assert set(spec) in ({"selfSigned"}, {"ca"}), spec
            continue
        assert set(spec) <= CERTIFICATE_SPEC, set(spec) - CERTIFICATE_SPEC
        assert set(spec["privateKey"]) <= PRIVATE_KEY
        assert spec["privateKey"]["algorithm"] == "ECDSA"  # infermesh.pki reads EC keys
        assert set(spec.get("usages", ())) <= USAGES
        issuer = spec["issuerRef"]
        named("Issuer", issuer["name"])
        if not spec.get("isCA"):
            assert "client auth" in spec["usages"] or "server auth" in spec["usages"]


def test_the_control_plane_reads_cert_managers_secrets_as_its_pki(tmp_path: Path) -> None:
    """Every hop is mutual TLS with the Certificates' identities: the topology turns each on
    and loads cert-manager's Secrets, laid out by the projected volume, as a pki directory
    holding the CA, the control plane's identity and every Envoy replica's."""
    topology = configmap_topology(tmp_path)
    tls = topology.listener.upstream_tls
    assert tls is not None and topology.xds_tls and topology.telemetry.tls
    assert not topology.telemetry.insecure_plaintext
    assert topology.listener.tls is not None  # edge TLS on
    replicas = workload("infermesh-envoy")["spec"]["replicas"]
    assert sorted(e.name for e in tls.envoys) == [f"infermesh-envoy-{i}" for i in range(replicas)]
    assert tls.control_plane is not None and tls.control_plane.name == "control-plane"
    # The model servers and Envoys dial each replica by name: its certificate carries it.
    otlp = expand(container("infermesh-model-server")["command"], POD_ENV)
    endpoints = otlp[otlp.index("--otlp-endpoint") + 1].split(",")
    names = set(named("Certificate", "infermesh-control-plane")["spec"]["dnsNames"])
    assert {e.rsplit(":", 1)[0] for e in endpoints} <= names


def test_each_envoy_proves_its_pod_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Envoy StatefulSet's pods are their xDS node ids; each finds its own certificate."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the SDS directory, removed after
    envoy = workload("infermesh-envoy")
    assert envoy["kind"] == "StatefulSet"
    pki_dir = mount_as_cert_manager(tmp_path, "infermesh-envoy")
    command = container("infermesh-envoy")["command"]
    assert command[command.index("--xds-tls") + 1] == PKI_MOUNT
    for i in range(envoy["spec"]["replicas"]):
        node = f"infermesh-envoy-{i}"
        args, _ = bootstrap_parser().parse_known_args(expand(command[3:], {"POD_NAME": node}))
        assert args.node_id == node
        assert prepare_xds_tls(pki_dir, node).trust_domain == "infermesh.local"


def test_a_model_server_pods_csi_certificate_is_the_identity_it_checks(tmp_path: Path) -> None:
    """csi-driver fills ${POD_NAME} and ${POD_NAMESPACE}; the result is the identity the
    server checks its certificate against (--tls-pod) and the name Envoy sends as SNI."""
    pod = workload("infermesh-model-server")["spec"]["template"]["spec"]
    attributes = next(v["csi"] for v in pod["volumes"] if v["name"] == "tls")["volumeAttributes"]
    assert attributes["csi.cert-manager.io/issuer-name"] == "infermesh-ca"

    def filled(key: str) -> str:
        value = str(attributes[f"csi.cert-manager.io/{key}"])
        return value.replace("${POD_NAME}", POD_ENV["POD_NAME"]).replace(
            "${POD_NAMESPACE}", POD_ENV["POD_NAMESPACE"]
        )

    args = model_server_parser().parse_args(
        expand(container("infermesh-model-server")["command"][1:], POD_ENV)
    )
    namespace, name = args.tls_pod.split("/")
    expected = pki.model_server_pod(namespace, name)
    assert (namespace, name) == (POD_ENV["POD_NAMESPACE"], POD_ENV["POD_NAME"])
    assert filled("uri-sans") == expected.spiffe_id
    assert filled("dns-names").split(",") == list(expected.dns)
    assert {"server auth", "client auth"} <= set(filled("key-usages").split(","))
    mounts = {
        m["name"]: m["mountPath"] for m in container("infermesh-model-server")["volumeMounts"]
    }
    for flag, file in (
        (args.tls_cert, "tls.crt"),
        (args.tls_key, "tls.key"),
        (args.tls_ca, "ca.crt"),
    ):
        assert flag == Path(mounts["tls"]) / file


@pytest.mark.parametrize(
    "path,doc",
    documents(),
    ids=[f"{p.name}:{d['kind']}/{d['metadata']['name']}" for p, d in documents()],
)
def test_every_object_validates_strictly(path: Path, doc: dict[str, Any]) -> None:
    if doc["kind"] in CERT_MANAGER_KINDS:  # a CRD: test_cert_manager_objects_use_known_fields
        assert doc["metadata"]["namespace"] == NAMESPACE
        return
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    if doc["kind"] != "Namespace":
        assert doc["metadata"]["namespace"] == NAMESPACE


def test_a_misspelled_field_is_refused() -> None:
    """The check can fail: strict mode refuses a field the schema does not know."""
    broken = copy.deepcopy(workload("infermesh-model-server"))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriod"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_each_part_of_the_mesh_keeps_all_but_one_pod_through_disruptions() -> None:
    """A node drain takes one pod of each workload at a time (its PodDisruptionBudget selects
    exactly its pods), and replicas spread over nodes and zones without ever blocking a
    one-node cluster."""
    for _, doc in documents():
        if doc["kind"] not in WORKLOADS:
            continue
        name, spec = doc["metadata"]["name"], doc["spec"]
        budget = named("PodDisruptionBudget", name)["spec"]
        assert budget["selector"] == spec["selector"], name
        assert budget["maxUnavailable"] == 1 and spec["replicas"] >= 2, name
        spread = spec["template"]["spec"]["topologySpreadConstraints"]
        keys = {c["topologyKey"] for c in spread}
        assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}, name
        for constraint in spread:
            assert constraint["whenUnsatisfiable"] == "ScheduleAnyway", name
            assert constraint["labelSelector"] == spec["selector"], name
            labels = spec["template"]["metadata"]["labels"]
            assert constraint["labelSelector"]["matchLabels"].items() <= labels.items(), name


def test_the_kustomization_lists_every_file() -> None:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == NAMESPACE
    files = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_model_server_drain_fits_in_the_grace_period() -> None:
    deployment = named("Deployment", "infermesh-model-server")
    pod = deployment["spec"]["template"]["spec"]
    c = container("infermesh-model-server")
    assert c["command"][0] == "infermesh-model-server"
    args = model_server_parser().parse_args(expand(c["command"][1:], POD_ENV))
    pre_stop = c["lifecycle"]["preStop"]
    sleep_s = (
        float(pre_stop["sleep"]["seconds"])
        if "sleep" in pre_stop
        else float(shlex.split(" ".join(pre_stop["exec"]["command"]))[-1])
    )
    assert pod["terminationGracePeriodSeconds"] > sleep_s + args.drain_delay + args.drain_timeout
    assert deployment["spec"]["replicas"] == 3


def test_model_server_ports_probes_and_address(tmp_path: Path) -> None:
    c = container("infermesh-model-server")
    args = model_server_parser().parse_args(expand(c["command"][1:], POD_ENV))
    assert args.host == "0.0.0.0"
    assert args.advertise_address == f"10.1.2.3:{args.port}"  # what the EndpointSlice lists
    assert port_number(c, "grpc") == args.port
    assert port_number(c, "metrics") == args.metrics_port
    assert port_number(c, "http") == args.http_port
    # Envoy reaches the REST port as the gRPC port + the topology's offset.
    rest = configmap_topology(tmp_path).listener.rest
    assert rest.enabled and args.http_port == args.port + rest.port_offset
    # The gRPC port speaks only mutual TLS, which the kubelet cannot: readiness is the
    # metrics port's plaintext /ready (model_server.protocol.admin_http).
    readiness = c["readinessProbe"]["httpGet"]
    assert readiness["path"] == "/ready" and port_number(c, readiness["port"]) == args.metrics_port
    for kind, probe in probes(c):
        action = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
        assert action is not None, kind
        assert port_number(c, action["port"]) in (args.port, args.metrics_port), kind
    assert "livenessProbe" in c and c["livenessProbe"]["httpGet"]["path"] != "/ready"  # draining
    # is not dead
    assert args.model_repository == Path("/models")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts["/models"] == "models"
    # The Service the topology names: headless, its grpc port on the server's port.
    service = named("Service", "infermesh-model-server")
    assert service["spec"]["clusterIP"] == "None"
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert port_number(c, grpc["targetPort"]) == args.port


def test_pods_run_as_non_root_with_limits() -> None:
    for _, doc in documents():
        if doc["kind"] not in WORKLOADS:
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["image"] == "infermesh:latest"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert {"cpu", "memory"} <= set(c["resources"]["requests"])
            assert {"cpu", "memory"} <= set(c["resources"]["limits"])


def test_the_topology_watches_the_model_server_service(tmp_path: Path) -> None:
    topology = configmap_topology(tmp_path)
    (source,) = topology.endpoints
    assert isinstance(source, KubernetesEndpoint)
    # The namespace defaults to the pod's own: the one the manifests deploy into.
    assert source.service == "infermesh-model-server"
    service = named("Service", "infermesh-model-server")
    assert source.port in {p["name"] for p in service["spec"]["ports"]}
    assert (topology.xds.host, topology.admin.host, topology.telemetry.host) == ("0.0.0.0",) * 3
    assert topology.listener.host == "0.0.0.0"


def test_the_control_plane_may_list_and_watch_endpoint_slices() -> None:
    plane = workload("infermesh-control-plane")
    pod = plane["spec"]["template"]["spec"]
    assert plane["spec"]["replicas"] == 2
    account = pod["serviceAccountName"]
    named("ServiceAccount", account)
    bindings = [
        d
        for _, d in documents()
        if d["kind"] == "RoleBinding"
        and {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE} in d["subjects"]
    ]
    verbs = set()
    for binding in bindings:
        role = named(binding["roleRef"]["kind"], binding["roleRef"]["name"])
        for rule in role["rules"]:
            if "discovery.k8s.io" in rule["apiGroups"] and "endpointslices" in rule["resources"]:
                verbs |= set(rule["verbs"])
    assert {"list", "watch"} <= verbs


def test_control_plane_service_ports_match_its_flags() -> None:
    c = container("infermesh-control-plane")
    assert c["command"][0] == "infermesh-control-plane"
    args = control_plane_parser().parse_args(c["command"][1:])
    mount = next(m for m in c["volumeMounts"] if m["name"] == "topology")
    assert args.topology == Path(mount["mountPath"]) / "topology.yaml"
    service = named("Service", "infermesh-control-plane")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    flags = {"xds": args.xds_port, "admin": args.admin_port, "otlp": args.otlp_port}
    for name, flag in flags.items():
        assert ports[name]["port"] == flag == port_number(c, ports[name]["targetPort"]), name
    for kind, probe in probes(c):
        assert port_number(c, probe["httpGet"]["port"]) == args.admin_port, kind
    # A StatefulSet behind a headless Service: each replica has a DNS name of its own, and
    # model servers and Envoy send telemetry to every replica by that name (not one of them).
    plane = workload("infermesh-control-plane")
    assert plane["kind"] == "StatefulSet" and service["spec"]["clusterIP"] == "None"
    name = service["metadata"]["name"]
    assert plane["spec"]["serviceName"] == name
    replicas = [f"{name}-{i}.{name}:{args.otlp_port}" for i in range(plane["spec"]["replicas"])]
    model_server = model_server_parser().parse_args(
        expand(container("infermesh-model-server")["command"][1:], POD_ENV)
    )
    assert model_server.otlp_endpoint == tuple(replicas)
    envoy = container("infermesh-envoy")["command"]
    assert envoy[:4] == ["python", "-m", "control_plane.xds.bootstrap", "--run"]
    flag = {envoy[i]: envoy[i + 1] for i in range(4, envoy.index("--") - 1)}
    assert flag["--xds-host"] == name  # resolves to every replica: a broken stream moves on
    assert flag["--xds-port"] == str(args.xds_port)
    assert flag["--otlp-port"] == ",".join(replicas)


def test_envoy_listens_where_its_service_points(tmp_path: Path) -> None:
    listener = configmap_topology(tmp_path).listener
    plane = control_plane_parser().parse_args(container("infermesh-control-plane")["command"][1:])
    port = plane.listener_port or listener.port
    c = container("infermesh-envoy")
    assert port_number(c, "grpc") == port
    service = named("Service", "infermesh-envoy")
    (grpc,) = service["spec"]["ports"]
    assert port_number(c, grpc["targetPort"]) == port


def test_the_manifests_ship_with_their_credentials_required(tmp_path: Path) -> None:
    """The admin binds 0.0.0.0, so the control plane needs both tokens (it refuses to start
    without them); the servers' model-repository API needs the operator key, which the
    control plane's poller sends; all of it from one Secret that is never committed."""
    plane = container("infermesh-control-plane")
    args = control_plane_parser().parse_args(plane["command"][1:])
    topology = configmap_topology(tmp_path)
    assert topology.listener.auth.mode == "api_keys"  # authentication on
    assert topology.listener.auth.api_keys_file.startswith(str(tmp_path))
    assert topology.admin.host == "0.0.0.0"
    assert args.admin_token_file and args.admin_read_token_file
    server = model_server_parser().parse_args(
        expand(container("infermesh-model-server")["command"][1:], POD_ENV)
    )
    assert server.model_control_mode == "explicit"
    (spec,) = server.restrictions
    assert "model-repository" in spec.groups
    assert args.model_server_credential == f"{spec.header}=@{spec.path}"
    for name in ("infermesh-control-plane", "infermesh-model-server"):
        volumes = workload(name)["spec"]["template"]["spec"]["volumes"]
        secret = next(v["secret"] for v in volumes if v["name"] == "credentials")
        assert secret["secretName"] == "infermesh-credentials"
    kinds = {d["kind"] for _, d in documents()}
    assert "Secret" not in kinds  # the operator makes it (docs/security.md)
