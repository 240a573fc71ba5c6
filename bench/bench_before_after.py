"""A benchmark before and after a change, side by side in one run.

Runs one of bench/'s scripts that prints a Markdown table (a label, then numbers) alternately
in an earlier source tree (``git worktree add /tmp/before REV``) and in this one, ``--rounds``
times each, and prints per cell the median of each side, its spread (min-max) and the ratio
after/before. Each side runs its own copy of the script, so a script whose imports moved
between the two still runs.

    git worktree add /tmp/before 7cae8d7
    .venv/bin/python bench/bench_before_after.py --before /tmp/before --rounds 3 \\
        bench/bench_control_plane_steps.py --endpoints 1000,10000 --repeat 3

Take the bench lock and run it alone: the two sides share the machine with nothing else.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"^-?[\d,]*\.?\d+$")


def table(output: str) -> dict[tuple[str, int], float]:
    """(row label, column) -> value for every numeric cell of the Markdown tables printed."""
    cells = {}
    for line in output.splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(parts) < 2 or set(parts[1]) <= {"-", " "}:
            continue
        for column, text in enumerate(parts[1:], 1):
            if NUMBER.match(text):
                cells[(parts[0], column)] = float(text.replace(",", ""))
    return cells


def run_side(tree: Path, script: str, args: list[str]) -> dict[tuple[str, int], float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, str(tree / script), *args],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"{tree / script} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return table(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the earlier source tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("script", help="a bench script, relative to the repository")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args()
    if not (args.before / args.script).is_file():
        sys.exit(f"{args.before / args.script} does not exist")
    sides: dict[str, list[dict[tuple[str, int], float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for name, tree in (("before", args.before.resolve()), ("after", ROOT)):
            sides[name].append(run_side(tree, args.script, args.args))
            print(f"round {i + 1}/{args.rounds} {name}: {len(sides[name][-1])} cells", flush=True)
    keys = [k for k in sides["after"][0] if all(k in r for s in sides.values() for r in s)]
    print(f"\n{args.script} {' '.join(args.args)}: {args.rounds} rounds each side, alternating")
    print("\n| row | column | before (median, min-max) | after (median, min-max) | after/before |")
    print("| --- | --- | --- | --- | --- |")
    for label, column in keys:
        b = [r[(label, column)] for r in sides["before"]]
        a = [r[(label, column)] for r in sides["after"]]
        mb, ma = statistics.median(b), statistics.median(a)
        ratio = f"{ma / mb:.2f}" if mb else "n/a"
        print(f"| {label} | {column} | {mb:,.2f} ({min(b):,.2f}-{max(b):,.2f}) "
              f"| {ma:,.2f} ({min(a):,.2f}-{max(a):,.2f}) | {ratio} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
