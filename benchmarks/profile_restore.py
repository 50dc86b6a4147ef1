"""Where a restore of many small tensors spends its time: takes N tensors of 1 KiB at PATH,
restores them warm three times (timed), then once under cProfile, printing the 14 functions
with the most time of their own. Run it per tree: ``PYTHONPATH=<tree> python
benchmarks/profile_restore.py 100000 /tmp/profile-restore``."""

from __future__ import annotations

import cProfile
import pstats
import shutil
import sys
import time

import torch

from snapshot import Snapshot, StateDict


def main() -> None:
    count, path = int(sys.argv[1]), sys.argv[2]
    state = {"m": StateDict(**{f"t{i}": torch.full((256,), float(i)) for i in range(count)})}
    shutil.rmtree(path, ignore_errors=True)
    Snapshot.take(path, state)
    target = {"m": StateDict(**{f"t{i}": torch.zeros(256) for i in range(count)})}
    Snapshot(path).restore(target)  # imports done, files in the page cache
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        Snapshot(path).restore(target)
        seconds.append(round(time.perf_counter() - start, 3))
    print("restore warm s:", seconds)
    profile = cProfile.Profile()
    profile.enable()
    Snapshot(path).restore(target)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
