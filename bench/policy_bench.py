"""Hit ratio per epoch of the cache's admission policy against plain LRU, trace-driven.

Runs the real BlockCache (LMDB index, data files, TinyLFU admission) on a
temporary directory with small blocks, replaying two workloads over a
dataset twice the cache size: cyclic sequential epochs, and a shuffled
sample loader (a new permutation every epoch). Plain LRU replays the same
traces for reference.

    python -m bench.policy_bench [--cache-blocks 2000] [--epochs 5]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cachefs.cache import BlockCache, BlockKey
from cachefs.db import open_index_db
from cachefs.metrics import Stats

from .plan_bench import lru_hits

BLOCK_BYTES = 4096  # small blocks: the policy sees keys and sizes, not contents


def cyclic(total_blocks: int, epochs: int, seed: int) -> Iterator[list[int]]:
    for _ in range(epochs):
        yield list(range(total_blocks))


def shuffled(total_blocks: int, epochs: int, seed: int) -> Iterator[list[int]]:
    rng = random.Random(seed)
    for _ in range(epochs):
        order = list(range(total_blocks))
        rng.shuffle(order)
        yield order


def replay_cachefs(epochs: list[list[int]], cache_blocks: int) -> list[float]:
    """Hit ratio per epoch of the real BlockCache."""
    with tempfile.TemporaryDirectory(prefix="cachefs-policy-") as workdir:
        db = open_index_db(Path(workdir) / "index.lmdb")
        cache = BlockCache(db, Path(workdir), cache_blocks * BLOCK_BYTES, BLOCK_BYTES, Stats())
        payload = bytes(BLOCK_BYTES)
        ratios = []
        for order in epochs:
            hits = 0
            for block in order:
                key = BlockKey(b"\0" * 8, b"\1" * 8, block)
                cache.sketch.record(key)
                if cache.contains(key):
                    hits += 1
                else:
                    cache.insert_many([(key, payload, False)])
            ratios.append(hits / len(order))
        db.close()
    return ratios


def replay_lru(epochs: list[list[int]], cache_blocks: int) -> list[float]:
    """Hit ratio per epoch of plain LRU (the simulator the plan benchmark uses too)."""
    return [hits / len(order) for hits, order in zip(lru_hits(epochs, cache_blocks), epochs, strict=True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.policy_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--cache-blocks", type=int, default=2000)
    parser.add_argument("--dataset-factor", type=float, default=2.0, help="dataset size / cache size (default: 2)")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)
    total = int(args.cache_blocks * args.dataset_factor)
    optimum = min(1.0, args.cache_blocks / total)
    print(f"dataset {total} blocks, cache {args.cache_blocks} blocks: cache/dataset = {optimum:.2f}\n")
    print("| workload | policy | " + " | ".join(f"epoch {e + 1}" for e in range(args.epochs)) + " |")
    print("|---|---|" + "---|" * args.epochs)
    for name, workload in (("cyclic sequential", cyclic), ("shuffled samples", shuffled)):
        epochs = list(workload(total, args.epochs, seed=1))
        for policy, replay in (("cachefs (TinyLFU admission)", replay_cachefs), ("plain LRU", replay_lru)):
            ratios = replay(epochs, args.cache_blocks)
            print(f"| {name} | {policy} | " + " | ".join(f"{100 * r:.1f} %" for r in ratios) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
