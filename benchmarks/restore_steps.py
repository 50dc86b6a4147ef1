"""Two steps of a restore of many small tensors, timed in one process, side by side with the way
each was done before:

- ``first tensors``: decoding the manifest of ``--count`` tensors (a flat dict, as the
  many-small case of ``bench_io`` writes it) with an ``on_tensors`` that notes when the first
  tensors arrive (what a restore's read-ahead waits for before its first hint), with the
  codec's short first pieces and with pieces of one size (``FIRST_PIECE_CHARS`` set to
  ``PIECE_CHARS``, the way the codec cut them before); also the whole decoding's time.
- ``slab digest``: the CRC-32s of the members of a slab read in calls of 1,024 buffers (members
  with 12 bytes of padding between them, as a slab lays them out), beside the CRC calls alone.

Each figure is the best of ``--reps`` runs, alternating the two ways. These are CPU steps on
warm memory: the machine's Python speed sets them, so compare the two columns of one run, not
runs on different machines. Run from the repository root::

    python -m benchmarks.restore_steps
    python -m benchmarks.restore_steps --count 20000 --reps 9
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable

import torch

import manifest as mf
from manifest import DictEntry, Location, Manifest, TensorEntry, codec
from snapshot._engine.format.serialization import RangeDigest, crc32, tensor_memoryview

MEMBER_BYTES = 10 << 10
PADDING = 12
IOV = 1024  # buffers per system call of the local plugin's scatter reads


def _manifest(count: int) -> bytes:
    entries: dict = {"0/model": DictEntry(keys=tuple(f"t{i}" for i in range(count)))}
    stride = MEMBER_BYTES + PADDING
    for i in range(count):
        loc = Location(
            blob=f"0/s{i // 3000}", offset=stride * (i % 3000), nbytes=MEMBER_BYTES, crc32=i * 7919
        )
        entries[f"0/model/t{i}"] = TensorEntry(
            dtype="float32", shape=(MEMBER_BYTES // 4,), chunks=(loc,)
        )
    return mf.dumps(Manifest(entries=entries))


def _decode(data: bytes, first_piece: int) -> tuple[float, float]:
    """(seconds until the first tensors arrive, seconds of the whole decoding)."""
    saved = codec.FIRST_PIECE_CHARS
    codec.FIRST_PIECE_CHARS = first_piece
    arrived: list[float] = []
    try:
        start = time.perf_counter()
        mf.loads(data, on_tensors=lambda items: arrived.append(time.perf_counter()))
        end = time.perf_counter()
    finally:
        codec.FIRST_PIECE_CHARS = saved
    return arrived[0] - start, end - start


def _best(runs: list[Callable[[], float]], reps: int) -> list[float]:
    """The best of ``reps`` values of each run, the runs alternating."""
    best = [float("inf")] * len(runs)
    for _ in range(reps):
        for i, run in enumerate(runs):
            best[i] = min(best[i], run())
    return best


def _timed(fn: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000, help="tensors of 10 KiB")
    parser.add_argument("--reps", type=int, default=7, help="runs of each way (best kept)")
    args = parser.parse_args(argv)

    print(
        f"{platform.processor() or platform.machine()}, Python {sys.version.split()[0]}, "
        f"torch {torch.__version__}; {args.count:,} tensors of 10 KiB; best of {args.reps}"
    )
    print()
    data = _manifest(args.count)
    firsts = [float("inf")] * 2
    wholes = [float("inf")] * 2
    for _ in range(args.reps):
        for i, first_piece in enumerate((codec.FIRST_PIECE_CHARS, codec.PIECE_CHARS)):
            got, whole = _decode(data, first_piece)
            firsts[i] = min(firsts[i], got)
            wholes[i] = min(wholes[i], whole)
    print("| manifest decoding | short first pieces | pieces of one size | ratio |")
    print("|---|---|---|---|")
    print(
        f"| first tensors arrive (ms) | {firsts[0] * 1e3:.2f} | {firsts[1] * 1e3:.2f} | "
        f"{firsts[0] / firsts[1]:.2f} |"
    )
    print(
        f"| whole decoding (ms) | {wholes[0] * 1e3:.1f} | {wholes[1] * 1e3:.1f} | "
        f"{wholes[0] / wholes[1]:.2f} |"
    )
    print()

    members = [torch.randn(MEMBER_BYTES // 4) for _ in range(args.count)]
    pad = memoryview(bytearray(PADDING))
    pieces: list[memoryview] = []
    for m in members:
        pieces += [tensor_memoryview(m), pad]  # ``members`` keeps the memory alive
    ranges = [(i * (MEMBER_BYTES + PADDING), MEMBER_BYTES) for i in range(args.count)]

    def digest() -> list[int]:
        d = RangeDigest(ranges)
        for at in range(0, len(pieces), IOV):
            d.many(pieces[at : at + IOV])
        return d.values

    searched, alone = _best(
        [_timed(digest), _timed(lambda: list(map(crc32, pieces[::2])))],
        args.reps,
    )
    assert digest() == list(map(crc32, pieces[::2]))
    print("| slab digest | the digest | CRC calls alone | ratio |")
    print("|---|---|---|---|")
    print(
        f"| {args.count:,} members (ms) | {searched * 1e3:.1f} | {alone * 1e3:.1f} | "
        f"{searched / alone:.2f} |"
    )

if __name__ == "__main__":
    main()
