"""A take with and without ``Options(digests=True)``: whether recording digests by default
would cost a take next to nothing (benchmarks/results/2026-12-06-digests-default.md).

Run from the repository root::

    python -m benchmarks.digests_default --rounds 4

Two states: 20,000 float32 tensors of 64 elements (many small), and 16 of 16 MiB (large). Each
round takes the state with digests off and on, back to back, the order reversed every other
round, after one warm-up take; prints per state the median seconds of each and the per-round
ratios (on / off) as a Markdown row.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from snapshot import Options, Snapshot, StateDict


def states() -> dict[str, dict[str, Any]]:
    """The two states, by the name their row prints."""
    g = torch.Generator().manual_seed(0)
    small = StateDict(**{f"t{i}": torch.randn(64, generator=g) for i in range(20000)})
    large = StateDict(**{f"l{i}": torch.randn(4 << 20, generator=g) for i in range(16)})
    return {"many-small (20,000 x 256 B)": {"m": small}, "large (16 x 16 MiB)": {"m": large}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where the snapshots go (a temp folder)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        print("| state | off, s | on, s | on / off (per round) |\n|---|---|---|---|")
        for name, state in states().items():
            times: dict[str, list[float]] = {"off": [], "on": []}
            warm = os.path.join(root, "warm")
            Snapshot.take(warm, state)
            shutil.rmtree(warm)
            for r in range(args.rounds):
                for variant in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    path = os.path.join(root, f"{variant}{r}")
                    t = time.perf_counter()
                    Snapshot.take(path, state, options=Options(digests=variant == "on"))
                    times[variant].append(time.perf_counter() - t)
                    shutil.rmtree(path)
            ratios = [on / off for off, on in zip(times["off"], times["on"], strict=True)]
            print(
                f"| {name} | {statistics.median(times['off']):.3f} | "
                f"{statistics.median(times['on']):.3f} | {statistics.median(ratios):.2f} "
                f"({', '.join(f'{x:.2f}' for x in ratios)}) |",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
