"""Where the control plane's time goes: py-spy samples summarized by activity.

    .venv/bin/python bench/scale/profile.py --pid PID --duration 20 --out prof.txt
    .venv/bin/python bench/scale/profile.py --summarize prof.txt

Records with ``py-spy record --format raw --gil`` (only the thread holding the GIL: the Python
CPU the event loop and the worker threads compete for) and sums the samples per activity: each
stack goes to the first activity of the list below found on it (rebuild, routing recompute,
telemetry snapshot, OTLP ingest, placement poll, ADS, live view, admin), rebuilds split by
their innermost step; the rest is listed by leaf frame. py-spy is not a project dependency:
``.venv/bin/pip install py-spy``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

ACTIVITIES = [  # (activity, substring of a frame "function (file:line)"), first match wins
    ("rebuild", "rebuild (control_plane/app/server.py"),
    ("routing recompute", "recompute (control_plane/routing/router.py"),
    (
        "telemetry as_json (live view frame, GET /telemetry)",
        "as_json (control_plane/telemetry/store.py",
    ),
    ("telemetry snapshot (routing input)", "snapshot (control_plane/telemetry/store.py"),
    ("OTLP ingest", "control_plane/telemetry/receiver.py"),
    ("OTLP ingest", "control_plane/telemetry/decode.py"),
    ("OTLP ingest", "control_plane/telemetry/otlp_wire.py"),
    ("OTLP ingest", "ingest (control_plane/telemetry/store.py"),
    ("ADS responses", "control_plane/xds/ads.py"),
    ("live view / status", "control_plane/admin/live_view.py"),
    ("live view / status", "control_plane/admin/api.py"),
    ("admin HTTP", "control_plane/admin/http.py"),
    ("placement poll", "control_plane/discovery/placement.py"),
    ("placement poll (gRPC client calls)", "grpc/aio/_call.py"),
    ("placement poll (gRPC client calls)", "(_call.py:"),
]
REBUILD_STEPS = [  # innermost wins
    ("publish_assignments (Prometheus gauges)", "publish_assignments ("),
    ("consistency_errors", "consistency_errors ("),
    ("Snapshot.build (serialize + hash)", "build (control_plane/xds/snapshot.py"),
    ("build_resources (protobuf objects)", "build_resources ("),
    ("build_mesh_state", "build_mesh_state ("),
    ("set_snapshot (notify streams)", "set_snapshot ("),
]


def classify(frames: list[str]) -> str:
    for activity, needle in ACTIVITIES:
        if any(needle in frame for frame in frames):
            if activity != "rebuild":
                return activity
            for step, inner in REBUILD_STEPS:
                if any(inner in f for f in frames):
                    return f"rebuild: {step}"
            return "rebuild: other"
    leaf = frames[-1] if frames else "?"
    return f"other: {leaf}"


def summarize(path: Path, top: int = 25) -> list[tuple[str, int, float]]:
    counts: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        counts[classify(frames)] += int(n)
    total = sum(counts.values()) or 1
    return [(name, n, 100.0 * n / total) for name, n in counts.most_common(top)]


def record(pid: int, duration: float, out: Path, rate: int) -> None:
    exe = Path(sys.executable).with_name("py-spy")
    subprocess.run(
        [str(exe), "record", "--pid", str(pid), "--duration", str(int(duration)), "--rate",
         str(rate), "--format", "raw", "--gil", "--nonblocking", "--output", str(out)],
        check=True, capture_output=True,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pid", type=int)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--rate", type=int, default=100)
    p.add_argument("--out", type=Path, default=Path("cp-profile.txt"))
    p.add_argument("--summarize", type=Path, default=None, help="summarize a raw profile")
    args = p.parse_args()
    path = args.summarize
    if path is None:
        record(args.pid, args.duration, args.out, args.rate)
        path = args.out
    rows = summarize(path)
    total = sum(n for _, n, _ in rows)
    print(f"{path}: {total} samples in the top {len(rows)} activities")
    for name, n, share in rows:
        print(f"{share:6.1f}%  {n:6d}  {name}")


if __name__ == "__main__":
    main()
