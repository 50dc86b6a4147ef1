"""Take and restore of many small tensors while another thread of the process runs Python (a
training loop beside an async take, a busy thread of the application), against the same call
with the process otherwise idle; torch.save and torch.load of the same state side by side.

A thread that gives up the GIL (for a system call, a CRC of more than 5 KiB, most of torch's
bound methods, a ctypes call) gets it back from a thread running Python only at that thread's
next switch (``sys.getswitchinterval()``, 5 ms by default): a call that gives it up once per
tensor waits that long per tensor. So the table says, per call, its time beside the busy thread
÷ alone (2 is a fair share of one GIL; far above, a wait per tensor), and below it the steps a
take or restore repeats per tensor, timed the same two ways: CRCs of ``--count`` buffers of
10 KiB (``crc32`` as isal gives it) and the negation bit asked of ``--count`` tensors
(``Tensor.is_neg()``). Every figure is the median of ``--reps`` runs, the two ways
alternating. Run from the repository root::

    python -m benchmarks.busy_thread
    python -m benchmarks.busy_thread --count 20000 --reps 5

``--calls-only`` leaves the steps out, for a library tree without them (an earlier commit, run
with its root first on ``PYTHONPATH``); ``--no-torch`` leaves torch.save and torch.load out (beside
a busy thread they take minutes). Before each run alone, the library's record of a recent wait
for the GIL (``checksum._held_until``, where the tree has it) is cleared, so that run starts
as in a process that has seen no busy thread.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from snapshot import Snapshot, StateDict
from snapshot._engine.format.serialization import tensor_memoryview

MEMBER_ELEMENTS = 2560  # 10 KiB of float32, the many-small case's tensors


@contextmanager
def _busy() -> Iterator[None]:
    """A thread running Python (a counting loop) for the duration."""
    stop = False

    def spin() -> None:
        n = 0
        while not stop:
            n += 1

    thread = threading.Thread(target=spin, name="busy", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop = True
        thread.join()


def _timed(fn: Callable[[], object], busy: bool) -> float:
    import importlib

    try:  # trees from before the checksums moved into serialization had a GIL heuristic
        checksum = importlib.import_module("snapshot._engine.format.serialization")
    except ImportError:
        checksum = None
    if hasattr(checksum, "_held_until"):
        checksum._held_until = 0.0  # type: ignore[union-attr]
    if busy:
        with _busy():
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _medians(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median seconds of ``fn`` alone and beside the busy thread, alternating."""
    alone: list[float] = []
    beside: list[float] = []
    for _ in range(reps):
        alone.append(_timed(fn, False))
        beside.append(_timed(fn, True))
    return statistics.median(alone), statistics.median(beside)


def _row(name: str, alone: float, beside: float, unit: float = 1.0, fmt: str = ".3f") -> str:
    return f"| {name} | {alone * unit:{fmt}} | {beside * unit:{fmt}} | {beside / alone:.1f} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000, help="tensors of 10 KiB")
    parser.add_argument("--reps", type=int, default=3, help="runs of each way (median kept)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: the temp dir)")
    parser.add_argument("--calls-only", action="store_true", help="time the calls only")
    parser.add_argument("--no-torch", action="store_true", help="leave torch.save/load out")
    args = parser.parse_args(argv)

    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{sys.version.split()[0]}, torch {torch.__version__}; {args.count:,} tensors of 10 KiB; "
        f"switch interval {sys.getswitchinterval() * 1e3:g} ms; median of {args.reps}"
    )
    print()
    gen = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.rand(MEMBER_ELEMENTS, generator=gen) for i in range(args.count)}
    targets = {k: torch.zeros(MEMBER_ELEMENTS) for k in state}
    root = tempfile.mkdtemp(prefix="busy-thread-", dir=args.dir)
    try:
        snap = os.path.join(root, "snap")
        saved = os.path.join(root, "state.pt")

        def take() -> None:
            shutil.rmtree(snap, ignore_errors=True)
            Snapshot.take(snap, {"m": StateDict(state)})

        def restore() -> None:
            Snapshot(snap).restore({"m": StateDict(targets)})

        def save() -> None:
            torch.save(state, saved)

        def load() -> None:
            torch.load(saved, weights_only=True)

        print("| call | alone s | beside a busy thread s | ratio |")
        print("|---|---|---|---|")
        for name, fn in (
            ("statesnap take", take),
            ("torch.save", save),
            ("statesnap restore", restore),
            ("torch.load", load),
        ):
            if args.no_torch and fn in (save, load):
                continue
            if fn is restore:
                take()
            print(_row(name, *_medians(fn, args.reps)))
        assert all(torch.equal(targets[k], state[k]) for k in state)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not args.calls_only:
        print()
        _steps(list(state.values()), args.count, args.reps)


def _steps(tensors: list[torch.Tensor], count: int, reps: int) -> None:
    from snapshot._engine.format.serialization import crc32

    views = [tensor_memoryview(t) for t in tensors]  # ``tensors`` keeps their memory alive
    print(f"| {count:,} per-tensor steps | alone ms | beside a busy thread ms | ratio |")
    print("|---|---|---|---|")
    for name, step in (
        ("crc32 (isal)", lambda: list(map(crc32, views))),
        ("Tensor.is_neg()", lambda: list(map(torch.Tensor.is_neg, tensors))),
    ):
        print(_row(name, *_medians(step, reps), unit=1e3, fmt=".1f"))


if __name__ == "__main__":
    main()
