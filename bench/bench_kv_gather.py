"""Benchmark one generation step's KV-cache gather: how it copies, and what glibc does with the
memory between steps.

A ``KvCache`` holds ``--sequences`` sequences of ``--tokens`` tokens (about 430: the shared
prompts of bench_affinity) for a demo LM of ``--width`` and ``--layers``; each call gathers them
all, as every decode step does. Two ways of copying, each in fresh child processes with glibc's
malloc thresholds as they come (``--malloc-keep-mib 0``) and raised (the server's default,
``model_server.core.allocator``):

- ``one_take``: ``KvCache.gather``, one indexed copy per layer and tensor;
- ``per_block``: the copy it replaced, one numpy assignment per sequence, block, layer and
  tensor, into zeroed arrays (written here over the same pool).

Per arm ``--rounds`` child processes, each timing ``--calls`` gathers after a warm-up; medians
with [min-max] and the ratios. Run it alone:

    flock /tmp/infermesh-bench.lock .venv/bin/python bench/bench_kv_gather.py
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np

from model_server.core import allocator
from model_server.generative.kv_cache import KvCache, KvShape

ARMS = ("per_block", "one_take")
MEMORY = {"glibc defaults": 0, "memory kept": allocator.DEFAULT_KEEP_MIB}


def filled_cache(args: argparse.Namespace) -> tuple[KvCache, list[str]]:
    heads = 4
    shape = KvShape(args.layers, heads, args.width // heads, total_blocks=args.sequences * 40)
    cache, rng, names = KvCache(shape, prefix_caching=False), np.random.default_rng(0), []
    for i in range(args.sequences):
        name, length = f"s{i}", args.tokens + i  # lengths differ: rows are padded
        cache.reserve(name, length + 1)
        part = [rng.standard_normal((heads, length, shape.head_dim), np.float32)]
        cache.append(name, part * args.layers, part * args.layers)
        names.append(name)
    return cache, names


def per_block(cache: KvCache, names: list[str]) -> None:
    """The gather before this change, over today's pool layout."""
    shape, size = cache.shape, cache.shape.block_tokens
    longest = max(cache.length(n) for n in names)
    out = (len(names), shape.heads, longest, shape.head_dim)
    keys = [np.zeros(out, np.float32) for _ in range(shape.layers)]
    values = [np.zeros(out, np.float32) for _ in range(shape.layers)]
    for row, name in enumerate(names):
        length, held = cache.length(name), cache._blocks[name]
        pad = longest - length
        for index, block in enumerate(held[: cache.blocks_for(length)]):
            first, n = index * size, min(size, length - index * size)
            source = slice(block * size, block * size + n)
            for layer in range(shape.layers):
                keys[layer][row, :, pad + first : pad + first + n] = cache.keys[layer][:, source]
                values[layer][row, :, pad + first : pad + first + n] = cache.values[layer][
                    :, source
                ]


def child(args: argparse.Namespace) -> None:
    allocator.keep_freed_memory(args.keep_mib)
    cache, names = filled_cache(args)
    gather = (lambda: per_block(cache, names)) if args.arm == "per_block" else (
        lambda: cache.gather(names)
    )  # fmt: skip
    for _ in range(20):
        gather()
    started = time.perf_counter()
    for _ in range(args.calls):
        gather()
    print(f"{(time.perf_counter() - started) / args.calls * 1e3:.4f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=11, help="rows per step (32 streams / 3)")
    p.add_argument("--tokens", type=int, default=420, help="the shortest row's tokens")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="child processes per arm")
    p.add_argument("--calls", type=int, default=200, help="timed gathers per child")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--keep-mib", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:
        child(args)
        return 0
    shared = [f"--{k.replace('_', '-')}={getattr(args, k)}"
              for k in ("sequences", "tokens", "width", "layers", "calls")]  # fmt: skip
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):  # the arms take turns, so drift hits them alike
        for arm in ARMS:
            for memory, keep in MEMORY.items():
                cmd = [sys.executable, __file__, "--arm", arm, f"--keep-mib={keep}", *shared]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
                results.setdefault((arm, memory), []).append(float(out.stdout))
    print(f"## KV gather: {args.sequences} sequences of {args.tokens}+ tokens, width {args.width}, "
          f"{args.layers} layers; ms a step, median [min-max] of {args.rounds}\n")  # fmt: skip
    print("| gather | " + " | ".join(MEMORY) + " |")
    print("| --- |" + " --- |" * len(MEMORY))
    medians = {key: statistics.median(v) for key, v in results.items()}
    for arm in ARMS:
        cells = [f"{medians[arm, m]:.3f} [{min(results[arm, m]):.3f}-{max(results[arm, m]):.3f}]"
                 for m in MEMORY]  # fmt: skip
        print(f"| {arm} | " + " | ".join(cells) + " |")
    before, after = medians["per_block", "glibc defaults"], medians["one_take", "memory kept"]
    print(f"\none_take with memory kept against per_block with glibc's defaults: "
          f"{after / before:.2f}x the time ({before / after:.1f}x faster)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
