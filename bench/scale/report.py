"""Figures of bench_scale.py: one summary row per configuration, the table and the plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

try:
    from scale.harness import quantile
except ImportError:  # run as a script: bench/scale is sys.path[0]
    from harness import quantile  # type: ignore[import-not-found,no-redef]


def _median(values: list[float]) -> float:
    data = [v for v in values if not math.isnan(v)]
    return statistics.median(data) if data else math.nan


def _rate(r: dict[str, Any], name: str) -> float:
    """Per second between the idle scrape and the last one (trials included)."""
    start, end = r.get("cp_metrics_idle", {}), r.get("cp_metrics_end", {})
    span = r.get("cp_metrics_end_at", 0) - r.get("cp_metrics_idle_at", 0)
    if name not in start or name not in end or span <= 0:
        return math.nan
    return float(end[name] - start[name]) / span


def _rates(r: dict[str, Any], prefix: str) -> dict[str, float]:
    """``_rate`` of every series whose name (with labels) starts with ``prefix``."""
    return {name: _rate(r, name) for name in r.get("cp_metrics_end", {}) if name.startswith(prefix)}


def _largest_share(r: dict[str, Any]) -> float:
    """The busiest telemetry shard's share of the points the shards took in."""
    shares = _rates(r, "telemetry_shard_points_total")
    total = sum(shares.values())
    return max(shares.values()) / total if total > 0 else math.nan


def _agree(trials: list[dict[str, Any]]) -> str:
    """Trials where both real Envoys ended on the synthetic nodes' weight, of those measured."""
    measured = [t for t in trials if t.get("synthetic_final") and not math.isnan(t["t_all_s"])]
    same = sum(
        all(e and e[0] == t["synthetic_final"][0] for e in t["envoy_final"]) for t in measured
    )
    return f"{same}/{len(measured)}"


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    trials = r.get("trials", [])
    t_all = [t["t_all_s"] for t in trials]
    envoy = [max(t["envoy_s"]) if t["envoy_s"] else math.nan for t in trials]
    idle = r.get("idle_cpu_cores", math.nan)
    # CPU per update: the control plane's CPU from the changed export to the last node, less
    # what it burns anyway over that window (polling, telemetry) at the idle rate.
    net = [t["cp_cpu_s"] - idle * t["t_all_s"] for t in trials if not math.isnan(t["t_all_s"])]
    update_bytes = [_median(t["update_bytes"]) for t in trials if t["update_bytes"]]
    return {
        "config": f"{r['endpoints']} ep / {r['nodes']} nodes / {r['mode']}",
        "trials": f"{sum(not math.isnan(t) for t in t_all)}/{len(trials)}",
        "p50_s": quantile(t_all, 0.5),
        "p99_s": quantile(t_all, 0.99),
        "envoy_p50_s": quantile(envoy, 0.5),
        "eject_p50_s": quantile([t.get("t_eject_all_s", math.nan) for t in trials], 0.5),
        "cpu_update_s": _median([t["cp_cpu_s"] for t in trials if not math.isnan(t["t_all_s"])]),
        "cpu_update_net_s": _median(net),
        "cpu_update_all_s": _median(
            [t.get("cp_cpu_all_s", math.nan) for t in trials if not math.isnan(t["t_all_s"])]
        ),
        "idle_cores": idle,
        "idle_cores_all": r.get("idle_cpu_cores_all", math.nan),
        "rss_mib": r.get("idle_rss", 0) / 2**20,
        "rss_all_mib": r.get("idle_rss_all", math.nan) / 2**20,
        "peak_mib": r.get("peak_rss", 0) / 2**20,
        "update_kib": _median(update_bytes) / 1024,
        "first_snapshot_s": r.get("first_snapshot_s", math.nan),
        "sync_s": r.get("sync_s", math.nan),
        "poll_period_s": r.get("poll_period_s", math.nan),
        "probe_failures": r.get("cp_unreachable_logs", math.nan),
        "otlp_points_s": _rate(r, "telemetry_points_total")
        + sum(_rates(r, "telemetry_points_ignored_total").values()),
        "shard_share": _largest_share(r),
        "agree": _agree(trials),
        "runtime_s": r.get("runtime_s", math.nan),
        "error": r.get("error", ""),
    }


COLUMNS = [
    ("config", "configuration", "{}"),
    ("trials", "trials ok", "{}"),
    ("p50_s", "P50 all nodes s", "{:.3f}"),
    ("p99_s", "P99 all nodes s", "{:.3f}"),
    ("envoy_p50_s", "real Envoys P50 s", "{:.3f}"),
    ("eject_p50_s", "ejection P50 s", "{:.2f}"),
    ("cpu_update_s", "CP CPU/update s", "{:.2f}"),
    ("cpu_update_net_s", "net of idle s", "{:.2f}"),
    ("cpu_update_all_s", "with its processes s", "{:.2f}"),
    ("idle_cores", "CP idle cores", "{:.2f}"),
    ("idle_cores_all", "with its processes", "{:.2f}"),
    ("rss_mib", "RSS MiB", "{:.0f}"),
    ("rss_all_mib", "with its processes", "{:.0f}"),
    ("peak_mib", "peak MiB", "{:.0f}"),
    ("update_kib", "EDS KiB/update/node", "{:.1f}"),
    ("first_snapshot_s", "first snapshot s", "{:.1f}"),
    ("sync_s", "all in sync s", "{:.1f}"),
    ("poll_period_s", "poll period s", "{:.2f}"),
    ("probe_failures", "probe failures", "{}"),
    ("otlp_points_s", "OTLP points/s taken in", "{:.0f}"),
    ("shard_share", "busiest shard's share", "{:.2f}"),
    ("agree", "Envoys same weight", "{}"),
    ("runtime_s", "runtime s", "{:.0f}"),
]


def print_table(results: list[dict[str, Any]]) -> None:
    rows = [summarize(r) for r in results]
    print("| " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS))
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row[key]
            cells.append(
                "n/a" if isinstance(value, float) and math.isnan(value) else fmt.format(value)
            )
        print("| " + " | ".join(cells) + " |")
    for row in rows:
        if row["error"]:
            print(f"- {row['config']}: {row['error'][:500]}")


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [summarize(r) for r in results if r.get("trials")]
    if not rows:
        return
    labels = [r["config"] for r in rows]
    y = list(range(len(rows)))
    fig, axes = plt.subplots(1, 3, figsize=(17, 1.0 + 0.45 * len(rows)), sharey=True)
    axes[0].barh([i - 0.2 for i in y], [r["p50_s"] for r in rows], 0.4, label="P50")
    axes[0].barh([i + 0.2 for i in y], [r["p99_s"] for r in rows], 0.4, label="P99")
    axes[0].axvline(1.0, color="red", linestyle="--", linewidth=1, label="target 1 s")
    axes[0].set_title("telemetry change -> every node has the new weight (s)", fontsize=9)
    axes[0].legend(fontsize=8)
    axes[1].barh(y, [r["update_kib"] for r in rows], color="tab:green")
    axes[1].set_xscale("log")
    axes[1].set_title("EDS KiB per update per node (log)", fontsize=9)
    axes[2].barh(y, [r["cpu_update_s"] for r in rows], color="tab:purple")
    axes[2].set_title("control-plane CPU s, change -> last node", fontsize=9)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    """Table and plot of several runs' JSON (each run's --json), in the order given."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("runs", type=Path, nargs="+", help="JSON files written by bench_scale.py")
    p.add_argument("--label", action="append", default=[], help="a label per file (optional)")
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    results = []
    for i, path in enumerate(args.runs):
        for r in json.loads(path.read_text()):
            if i < len(args.label):
                r["mode"] = f"{r['mode']} ({args.label[i]})"
            results.append(r)
    print_table(results)
    if args.plot is not None:
        plot(results, args.plot)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
