"""``infermesh``: run the mesh natively (``up``), see the control plane's view (``status``) and
what the model servers report (``telemetry``), shift versions (``split``, ``canary``), and
manage models on every server as an operator (``models``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from infermesh import certs, keys, models
from infermesh.launcher import up
from infermesh.secrets import ADMIN_TOKEN_FILE

ROOT = Path.cwd()
ADMIN_HELP = "control-plane admin HOST:PORT, or several (one per replica) separated by commas"


def _status(admins: str, raw: bool) -> int:
    """Each replica's view in turn (``--json``: one object, or one per replica keyed by its
    admin address); 0 if any replica answered."""
    replicas = _replicas(admins)
    answers = {admin: _fetch(admin, "/status") for admin in replicas}
    found = {admin: status for admin, status in answers.items() if status is not None}
    if raw and found:
        shown = found if len(replicas) > 1 else next(iter(found.values()))
        print(json.dumps(shown, indent=2, sort_keys=True))
    elif found:
        for admin, status in found.items():
            if len(replicas) > 1:
                print(f"== control plane {admin} ==")
            _print_status(status)
    return 0 if found else 1


def _print_status(status: dict[str, Any]) -> None:
    print(f"snapshot: {status.get('snapshot')}  last rebuild: {status.get('last_rebuild')}")
    if status["topology"]["error"]:
        print(f"topology error (last good one kept): {status['topology']['error']}")
    for warning in status.get("warnings", ()):
        print(f"WARNING: {warning}")
    print("endpoints:")
    for key, e in sorted(status["endpoints"].items()):
        state = "reachable" if e["reachable"] else f"UNREACHABLE ({e['error']})"
        overrides = {k: e[k] for k in ("weight_override", "health_override") if e[k] is not None}
        print(f"  {key:22} {state:12} ready={','.join(e['ready_models']) or '-'} {overrides or ''}")
    print("clusters:")
    for name, endpoints in sorted(status["clusters"].items()):
        members = ", ".join(f"{m['endpoint']} w={m['weight']} {m['health']}" for m in endpoints)
        print(f"  {name:28} {members or '(empty)'}")
    for pool, routing in sorted(status.get("routing", {}).items()):
        split = status.get("version_splits", {}).get(pool) or {}
        described = " ".join(f"v{v}={w}" for v, w in split.items()) or "none"
        fail_open = " (FAILING OPEN)" if routing.get("fail_open") else ""
        print(f"routing {pool}{fail_open}: version split {described}")
        circuit = status.get("circuits", {}).get(pool)
        if circuit and circuit.get("open"):
            print(
                f"  circuit OPEN: the fallback serves for {circuit['open_for_s']} s more "
                f"(trip {circuit['trips']})"
            )
        run = status.get("canaries", {}).get(pool)
        if run:
            print(
                f"  canary v{run['canary']} against v{run['stable']}: {run['status']} at "
                f"{run['percent']}% (step {run['step']}): {run['reason']}"
            )
        for endpoint, e in sorted(routing.get("endpoints", {}).items()):
            print(
                f"  {endpoint:22} weight={e['weight']} {e['health']:9} score={e['score']}  "
                f"{e['reason']}"
            )
    print("envoy nodes:")
    for node in status["nodes"]:
        connected = "connected" if node["connected"] else "disconnected"
        print(f"  {node['node_id']} ({node['mode']}, {connected})")
        for kind, t in node["types"].items():
            nack = f" last NACK: {t['last_nack']['error'][:80]!r}" if t["last_nack"] else ""
            print(f"    {kind}: acked {t['acked_version'] or '-'} sync={t['in_sync']}{nack}")


def _fetch(admin: str, path: str) -> dict[str, Any] | None:
    request = urllib.request.Request(f"http://{admin}{path}", headers=_auth(os.environ, True))
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body
    except OSError as exc:
        print(f"infermesh: control plane admin at {admin} does not answer: {exc}", file=sys.stderr)
        return None


def _num(signal: dict[str, Any] | None, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    if not signal or signal.get("value") is None:
        return "-"
    return fmt.format(signal["value"] * scale)


def _bytes(signal: dict[str, Any] | None) -> str:
    return _num(signal, "{:.2f}", 1 / 2**30) + ("G" if signal else "")


TELEMETRY_COLUMNS = (
    "endpoint", "age", "qps", "p50 ms", "p99 ms", "errors", "queue", "memory used/total", "kv",
)  # fmt: skip


def telemetry_rows(body: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per endpoint of GET /telemetry (pure: the table ``infermesh telemetry`` prints)."""
    rows: list[tuple[str, ...]] = []
    for key, e in sorted(body.get("endpoints", {}).items()):
        age = f"{e['age_s']:.1f}s" + (" STALE" if e["stale"] else "")
        if e.get("draining") and e["draining"]["value"]:
            age += " DRAINING"
        memory = f"{_bytes(e['memory_used_bytes'])}/{_bytes(e['memory_total_bytes'])}"
        if e.get("memory_source"):
            memory += f" ({e['memory_source']})"
        kv = f"{_num(e['kv_blocks_used'], '{:.0f}')}/{_num(e['kv_blocks_total'], '{:.0f}')}"
        rows.append(
            (
                key,
                age,
                _num(e["qps"]),
                _num(e["p50_ms"], "{:.2f}"),
                _num(e["p99_ms"], "{:.2f}"),
                _num(e["error_rate"], "{:.1%}"),
                _num(e["queue_depth"], "{:.0f}"),
                memory,
                kv,
            )
        )
    return rows


def _telemetry(admins: str, raw: bool) -> int:
    """From the first replica that answers: every replica receives the same telemetry."""
    body = next(filter(None, (_fetch(a, "/telemetry") for a in _replicas(admins))), None)
    if body is None:
        return 1
    if raw:
        print(json.dumps(body, indent=2, sort_keys=True))
        return 0
    rows = [TELEMETRY_COLUMNS, *telemetry_rows(body)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TELEMETRY_COLUMNS))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if len(rows) == 1:
        print("(no endpoint has reported telemetry)")
    return 0


def _split(admin: str, model: str, pairs: list[str]) -> int:
    body: dict[str, int] = {}
    for pair in pairs:
        version, _, weight = pair.partition("=")
        if not version or not weight.isdigit():
            print(f"infermesh: {pair!r} is not VERSION=WEIGHT (e.g. 2=10)", file=sys.stderr)
            return 2
        body[version] = int(weight)
    return _post(admin, f"/models/{model}/split", body)


def _canary(admin: str, args: argparse.Namespace) -> int:
    if args.abort:
        return _post(admin, f"/models/{args.model}/canary", {"abort": True}, done_if_409=True)
    if args.version is None:
        print("infermesh: canary needs a VERSION (or --abort)", file=sys.stderr)
        return 2
    body: dict[str, Any] = {"version": args.version}
    if args.steps is not None:
        try:
            body["steps"] = [int(step) for step in args.steps.split(",")]
        except ValueError:
            print(f"infermesh: --steps {args.steps!r}: expected e.g. 10,25,50,100", file=sys.stderr)
            return 2
    options = ("stable", "dwell_s", "max_error_rate", "p99_margin", "error_margin", "min_requests")
    body.update({k: getattr(args, k) for k in options if getattr(args, k) is not None})
    return _post(admin, f"/models/{args.model}/canary", body)


def _post(admins: str, path: str, body: dict[str, Any], done_if_409: bool = False) -> int:
    """Sends an operator change to every control-plane replica (each keeps its own splits and
    canaries, and Envoy may follow either), whatever one of them answers: a replica that
    restarted has forgotten a canary the others still run, and an abort must reach those.
    ``done_if_409``: a 409 means the replica is already where the change would take it (an
    abort where no canary runs). 0 when every replica that answered applied it."""
    replicas = _replicas(admins)
    applied = refused = 0
    for admin in replicas:
        prefix = f"{admin}: " if len(replicas) > 1 else ""
        request = urllib.request.Request(
            f"http://{admin}{path}",
            data=json.dumps(body).encode(),
            method="POST",
            headers=_post_headers(os.environ),
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                why = json.loads(exc.read()).get("error", exc)
            except ValueError:
                why = exc
            if done_if_409 and exc.code == 409:
                print(f"{prefix}nothing to do: {why}")
                applied += 1
            else:
                print(f"infermesh: {prefix}{why}", file=sys.stderr)
                refused += 1
            continue
        except OSError as exc:
            print(
                f"infermesh: control plane admin at {admin} does not answer, not applied there: "
                f"{exc}",
                file=sys.stderr,
            )
            continue
        applied += 1
        print(prefix + json.dumps(answer, sort_keys=True))
    if applied < len(replicas):
        print(f"infermesh: applied on {applied} of {len(replicas)} replicas", file=sys.stderr)
    return 0 if applied and not refused else 1


def _post_headers(env: Mapping[str, str]) -> dict[str, str]:
    """JSON, and the admin token (``_auth``)."""
    return {"content-type": "application/json", **_auth(env, False)}


def _auth(env: Mapping[str, str], read: bool) -> dict[str, str]:
    """The admin token: INFERMESH_ADMIN_TOKEN, else (reads) INFERMESH_ADMIN_READ_TOKEN, else
    the local mesh's .infermesh/admin.token (``infermesh up`` makes it); none without them."""
    token = env.get("INFERMESH_ADMIN_TOKEN") or (read and env.get("INFERMESH_ADMIN_READ_TOKEN"))
    if not token:
        try:
            token = (ROOT / ADMIN_TOKEN_FILE).read_text().strip()
        except OSError:
            return {}
    return {"authorization": f"Bearer {token}"} if token else {}


def _replicas(admins: str) -> list[str]:
    return [a.strip() for a in admins.split(",") if a.strip()]


def default_admins(env: Mapping[str, str]) -> str:
    """INFERMESH_ADMIN (HOST:PORT[,HOST:PORT...]) if set, else compose.yaml's two replicas."""
    if env.get("INFERMESH_ADMIN"):
        return env["INFERMESH_ADMIN"]
    ports = (env.get("INFERMESH_ADMIN_PORT", "19000"), env.get("INFERMESH_ADMIN2_PORT", "19001"))
    return ",".join(f"127.0.0.1:{port}" for port in ports)


def _add_canary_parser(commands: Any, default_admin: str) -> None:
    canary = commands.add_parser(
        "canary",
        help="start an SLO-gated canary (`infermesh canary classifier 2`) or --abort it",
    )
    canary.add_argument("model")
    canary.add_argument("version", nargs="?", help="the canary version")
    canary.add_argument("--abort", action="store_true", help="stop it: all traffic to stable")
    canary.add_argument("--stable", help="compare against this version (default: most traffic)")
    canary.add_argument("--steps", help="percentages, e.g. 10,25,50,100 (default: topology's)")
    canary.add_argument("--dwell-s", type=float, help="seconds on each step at least")
    canary.add_argument("--max-error-rate", type=float, help="0..1, the SLA on errors")
    canary.add_argument("--p99-margin", type=float, help="canary P99 <= margin x stable's")
    canary.add_argument("--error-margin", type=float, help="canary errors <= stable's + margin")
    canary.add_argument("--min-requests", type=int, help="evidence needed before judging")
    canary.add_argument("--admin", default=default_admin, help=ADMIN_HELP)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infermesh", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("up", help="start the mesh from compose.yaml as processes")
    start.add_argument("--compose", type=Path, default=ROOT / "compose.yaml")
    start.add_argument("--log-dir", type=Path, default=ROOT / ".infermesh" / "logs")
    start.add_argument(
        "--stop-leftovers",
        action="store_true",
        help="first stop the services a killed infermesh up left running (its run file names "
        "them): SIGTERM, then SIGKILL after their stop grace period",
    )
    show = commands.add_parser("status", help="the control plane's view of the mesh")
    default_admin = default_admins(os.environ)
    show.add_argument("--admin", default=default_admin, help=ADMIN_HELP)
    show.add_argument("--json", action="store_true", help="print the raw status JSON")
    tele = commands.add_parser("telemetry", help="what the model servers report (OTLP)")
    tele.add_argument("--admin", default=default_admin, help=ADMIN_HELP)
    tele.add_argument("--json", action="store_true", help="print the raw telemetry JSON")
    split = commands.add_parser(
        "split", help="set a model's version split, e.g. `infermesh split classifier 1=90 2=10`"
    )
    split.add_argument("model")
    split.add_argument("weights", nargs="*", help="VERSION=WEIGHT; none: back to the topology's")
    split.add_argument("--admin", default=default_admin, help=ADMIN_HELP)
    _add_canary_parser(commands, default_admin)
    models.add_parser(commands, ADMIN_HELP, default_admin)
    keys.add_parser(commands, ROOT)
    certs.add_parser(commands, ROOT)
    args = parser.parse_args(argv)
    if args.command == "keys":
        return keys.run(args)
    if args.command == "certs":
        return certs.run(args)
    if args.command == "models":
        return models.run(args, _replicas(args.admin), _fetch)
    if args.command == "canary":
        return _canary(args.admin, args)
    if args.command == "split":
        return _split(args.admin, args.model, args.weights)
    if args.command == "up":
        root = args.compose.resolve().parent
        return up(args.compose, root, args.log_dir, stop_leftovers=args.stop_leftovers)
    if args.command == "telemetry":
        return _telemetry(args.admin, args.json)
    return _status(args.admin, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
