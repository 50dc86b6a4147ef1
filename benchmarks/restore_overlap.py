"""A restore of many small tensors with its values rebuilt while the reads run (the library's
way: ``Loader.inflate_ready`` as ``Loader.execute``'s ``meanwhile``) against rebuilt after them
(the way before: ``inflate_ready`` answering ``PENDING`` for every key), in one process,
alternating the two ways in pairs.

The rebuilding can only overlap what leaves the GIL free: reads waiting on the device. So the
pairs run with the local plugin's reads answered as they are (warm page cache: the restore is
CPU work throughout) and with each read held back ``--late-ms`` first, a sleep that leaves the
GIL free, as a device slower than the CPU work would. Prints each way's median and the median of
the pairs' differences (negative: rebuilding during the reads is faster). Run from the
repository root::

    python -m benchmarks.restore_overlap
    python -m benchmarks.restore_overlap --count 20000 --pairs 30 --late-ms 0,60
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import tempfile
import time

import torch

from snapshot import Snapshot, StateDict
from snapshot._engine.restore.loader import PENDING, Loader
from storage_plugins.fs import FSStoragePlugin

MEMBER_ELEMENTS = 2560  # 10 KiB of float32, the many-small case's tensors


def _pairs(path: str, count: int, pairs: int, late: float) -> dict[str, list[float]]:
    ready, read = Loader.inflate_ready, FSStoragePlugin._readv_sync

    def late_read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(late)
        return read(self, *args, **kwargs)

    targets = {f"t{i}": torch.zeros(MEMBER_ELEMENTS) for i in range(count)}
    app = {"model": StateDict(targets)}
    times: dict[str, list[float]] = {"during": [], "after": []}
    try:
        if late:
            FSStoragePlugin._readv_sync = late_read  # type: ignore[method-assign]
        for i in range(pairs):
            for way in ("during", "after") if i % 2 else ("after", "during"):
                Loader.inflate_ready = (  # type: ignore[method-assign]
                    ready if way == "during" else (lambda self, root: PENDING)
                )
                t0 = time.perf_counter()
                Snapshot(path).restore(app)
                times[way].append(time.perf_counter() - t0)
    finally:
        Loader.inflate_ready = ready  # type: ignore[method-assign]
        FSStoragePlugin._readv_sync = read  # type: ignore[method-assign]
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000, help="tensors of 10 KiB")
    parser.add_argument("--pairs", type=int, default=20, help="pairs of restores per delay")
    parser.add_argument("--late-ms", default="0,60", help="each read held back this long")
    parser.add_argument("--dir", default=None, help="scratch directory")
    args = parser.parse_args(argv)
    print(f"restore_overlap: {args.count} tensors, Python {platform.python_version()}")
    root = tempfile.mkdtemp(prefix="restore-overlap-", dir=args.dir)
    try:
        path = f"{root}/snap"
        g = torch.Generator().manual_seed(0)
        state = {f"t{i}": torch.randn(MEMBER_ELEMENTS, generator=g) for i in range(args.count)}
        Snapshot.take(path, {"model": StateDict(state)})
        for late_ms in (float(x) for x in args.late_ms.split(",")):
            times = _pairs(path, args.count, args.pairs, late_ms / 1e3)
            during, after = times["during"], times["after"]
            diffs = [a - b for a, b in zip(during, after, strict=True)]
            print(
                f"  reads {late_ms:.0f} ms late: during the reads "
                f"{statistics.median(during) * 1e3:.0f} ms, after them "
                f"{statistics.median(after) * 1e3:.0f} ms (medians of {len(during)}); "
                f"pairs' median difference {statistics.median(diffs) * 1e3:+.1f} ms, "
                f"during faster in {sum(d < 0 for d in diffs)}/{len(diffs)}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
