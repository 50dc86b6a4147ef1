"""How fast the device fills the page cache with a snapshot's blobs, driven each of the ways a
restore's read-ahead could drive it, against raw readers of the same files; cold every time.

A restore hints the ranges it is about to read (``snapshot/_engine/restore/read_ahead.py``); the local
plugin turns each hint into ``posix_fadvise(WILLNEED)`` of at most ``read_ahead.PIECE_BYTES``,
given by one thread, and the restore's reads then copy the bytes from the page cache. This
script times that way and its alternatives on the blob files of a snapshot of ``--count`` small
tensors (the many-small state of ``bench_io``):

- ``advise``: the local plugin's ``read_ahead_now`` over pieces of ``PIECE_BYTES`` from one
  thread (the library's way: ``WILLNEED``),
  then one pass reading every file (1 MiB reads into one buffer: the copy a restore makes);
- ``reads N x S``: N threads reading the files for real in reads of S bytes into a buffer of
  their own (the bytes dropped), then the same pass;
- ``raw N x S``: N threads reading the files in reads of S bytes and nothing after: what the
  raw readers of ``bench_io`` do, without their targets.

Every buffer is allocated and touched before the clock starts (on some machines the first
touch of fresh memory costs more than the reads). The rounds alternate the ways; the table
gives each way's median and its ratio to ``advise`` (below 1: faster). These are device
figures, with little Python in them: they compare ways on one machine, and runs on machines
whose devices differ tell different stories. Run from the repository root::

    python -m benchmarks.read_ahead_device
    python -m benchmarks.read_ahead_device --count 20000 --reps 10 --dir /var/tmp
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from benchmarks.common.system import drop_page_cache, files_under
from snapshot import Snapshot, StateDict
from snapshot._engine.restore.read_ahead import PIECE_BYTES
from storage_plugins.fs import FSStoragePlugin

MEMBER_BYTES = 10 << 10
PASS_BYTES = 1 << 20
MAX_THREADS = 4


def _blob_files(root: str) -> list[str]:
    """The snapshot's blob files (every file but the manifest), in name order."""
    return sorted(p for p in files_under(root) if os.path.basename(p) != "manifest.yaml")


def _read_file(path: str, buf: memoryview) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    return n


def _advise(plugin: FSStoragePlugin, root: str) -> Callable[[str, memoryview], int]:
    """A file hinted as a restore's read-ahead thread hints it: the local plugin's own
    ``read_ahead_now`` over pieces of ``PIECE_BYTES``."""

    def job(path: str, _: memoryview) -> int:
        blob = os.path.relpath(path, root).replace(os.sep, "/")
        size = os.path.getsize(path)
        for off in range(0, size, PIECE_BYTES):
            if not plugin.read_ahead_now(blob, off, min(PIECE_BYTES, size - off)):
                raise SystemExit("the local plugin gave no hint of its own")
        return size

    return job


def _in_threads(files: list[str], bufs: list[memoryview], job: Callable[..., int]) -> int:
    """Runs ``job(file, buffer)`` over ``files`` from ``len(bufs)`` threads, each with its
    buffer, the files taken in order; the bytes the jobs report."""
    todo = list(reversed(files))
    lock = threading.Lock()
    totals = [0] * len(bufs)

    def worker(i: int) -> None:
        while True:
            with lock:
                if not todo:
                    return
                path = todo.pop()
            totals[i] += job(path, bufs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(bufs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(totals)


def _ways(
    hint: Callable[[str, memoryview], int],
    files: list[str],
    scratch: list[bytearray],
    pass_buf: memoryview,
) -> dict[str, Callable[[], int]]:
    """Each way, as a function returning the bytes it moved into memory (every file's, whole,
    or the way is broken)."""

    def views(n: int, size: int) -> list[memoryview]:
        return [memoryview(b)[:size] for b in scratch[:n]]

    def then_pass(first: Callable[[], object]) -> Callable[[], int]:
        def way() -> int:
            first()
            return sum(_read_file(f, pass_buf) for f in files)

        return way

    ways: dict[str, Callable[[], int]] = {
        f"advise {PIECE_BYTES >> 20} MiB, 1 thread (the library's)": then_pass(
            lambda: _in_threads(files, views(1, 1), hint)
        )
    }
    for n in (1, 2, 4):
        ways[f"reads {n} x 1 MiB"] = then_pass(
            lambda n=n: _in_threads(files, views(n, 1 << 20), _read_file)
        )
    for size in (8 << 20, 1 << 20):
        ways[f"raw {MAX_THREADS} x {size >> 20} MiB"] = lambda size=size: _in_threads(
            files, views(MAX_THREADS, size), _read_file
        )
    return ways


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000, help="tensors of 10 KiB")
    parser.add_argument("--reps", type=int, default=8, help="rounds (each way once per round)")
    parser.add_argument("--dir", default=None, help="scratch directory (on the device to test)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = os.path.join(tmp, "snap")
        state = {f"t{i}": torch.rand(MEMBER_BYTES // 4) for i in range(args.count)}
        Snapshot.take(root, {"model": StateDict(state)})
        del state
        files = _blob_files(root)
        total = sum(map(os.path.getsize, files))
        scratch = [bytearray(max(PIECE_BYTES, PASS_BYTES)) for _ in range(MAX_THREADS)]
        pass_buf = bytearray(PASS_BYTES)
        for b in (*scratch, pass_buf):
            b[:: 1 << 12] = b"\x01" * len(range(0, len(b), 1 << 12))
        plugin = FSStoragePlugin(root)
        ways = _ways(_advise(plugin, root), files, scratch, memoryview(pass_buf))
        times: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.reps):
            names = list(ways) if r % 2 == 0 else list(reversed(ways))
            for name in names:
                drop_page_cache(root)
                time.sleep(0.1)  # the evictions settle
                t0 = time.perf_counter()
                moved = ways[name]()
                times[name].append(time.perf_counter() - t0)
                if moved != total:
                    raise SystemExit(f"{name} moved {moved} bytes of {total}")
                print(f"  [round {r + 1}] {name}: {times[name][-1]:.3f} s", file=sys.stderr)
        asyncio.run(plugin.close())

    base = statistics.median(next(iter(times.values())))
    print(
        f"{platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} CPUs; "
        f"{len(files)} blob files, {total / (1 << 20):.1f} MiB ({args.count:,} tensors of "
        f"10 KiB); cold, median of {args.reps}\n"
    )
    print("| way | median s | GB/s | ÷ advise | runs s |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        runs = " ".join(f"{t:.3f}" for t in sorted(ts))
        print(f"| {name} | {med:.3f} | {total / med / 1e9:.2f} | {med / base:.2f} | {runs} |")


if __name__ == "__main__":
    main()
