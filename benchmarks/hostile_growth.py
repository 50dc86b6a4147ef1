"""How the cost of reading a manifest grows with each input that could amplify it.

Each input is made at a size ``n`` and at ``10 n`` from a real snapshot, its manifest forged (the
checksum line recomputed, so that what is measured is the decoder and the reads, not the
trailer), and one operation is timed on it:

- ``entries``: a dict of ``n`` primitive entries; ``Snapshot(path)`` and ``read_object`` of the
  dict.
- ``shards``: a sharded tensor whose entry lists ``n`` empty shards beside its one real shard;
  ``Snapshot(path)`` and ``read_object`` of it.
- ``aliases``: ``n`` entries whose chunks are a YAML alias of one anchored list of ``n``
  locations (``n**2`` locations once expanded; refused at the anchor); ``Snapshot(path)``.
- ``depth``: one entry nesting JSON arrays ``n`` deep (refused); ``Snapshot(path)``.
- ``chunks``: a tensor of ``n`` float32 elements stored in ``n`` chunks of one element;
  ``Snapshot(path)`` and ``read_object`` of it.

Three costs are measured. Time is the process's CPU time (every thread's), the best of a few
runs: CPU time leaves out the waits for a core that a busy machine adds to wall-clock time,
and the short run at ``n`` is more likely than the long one to find a quiet moment, which
inflated the wall-clock ratio threefold under a loaded test run. Calls are the Python and
builtin function calls made on the calling thread during one run (``sys.setprofile`` events):
a count, the same on any machine, that grows with any loop which calls a function. Memory is
the peak of Python's allocations during one run (``tracemalloc``: the decoded manifest,
entries, plans and values, where the growth would show). A cost linear in the input grows
about tenfold from ``n`` to ``10 n``; a quadratic one a hundredfold. Run from the repository root::

    python -m benchmarks.hostile_growth            # the table, markdown
    python -m benchmarks.hostile_growth --json     # the same rows as JSON (tests read these)
    python -m benchmarks.hostile_growth --scale 0.2  # every n a fifth as large
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from snapshot import Snapshot, StateDict
from snapshot.sharding.mapping import ShardedTensor

MANIFEST = "manifest.yaml"
RUNS = 3

# Each input's n (the measurement is at n and 10 n): large enough that the work, not opening a
# snapshot, dominates the time at n.
SIZES = {"entries": 5000, "shards": 2500, "aliases": 2500, "depth": 10_000, "chunks": 2500}


def _seal(body: str) -> bytes:
    data = body.encode()
    return data + b"# crc32 %08x\n" % zlib.crc32(data)


def _body(root: Path) -> str:
    text = (root / MANIFEST).read_text()
    return text[: text.rindex("# crc32")]


def _take(root: Path, state: dict[str, StateDict]) -> None:
    Snapshot.take(str(root), state)


def _entries(root: Path, n: int) -> Callable[[], object]:
    _take(root, {"m": StateDict({f"k{i}": i for i in range(n)})})
    path = str(root)
    return lambda: Snapshot(path).read_object("0/m")


def _shards(root: Path, n: int) -> Callable[[], object]:
    st = ShardedTensor.from_rank_offsets("w", torch.arange(16.0).reshape(4, 4))
    _take(root, {"m": StateDict(w=st)})
    empty = "".join(
        f', {{"offsets": [{i % 4}, 0], "sizes": [0, 4], "chunks": []}}' for i in range(n)
    )
    body, count = re.subn(
        r'("chunks": \[\[[^\]]*\]\]\})\]', lambda m: m.group(1) + empty + "]", _body(root)
    )
    assert count == 1
    (root / MANIFEST).write_bytes(_seal(body))
    path = str(root)
    return lambda: Snapshot(path).read_object("0/m/w")


def _aliases(root: Path, n: int) -> Callable[[], object]:
    _take(root, {"m": StateDict(w=torch.zeros(1))})
    body = _body(root)
    line = next(x for x in body.splitlines() if x.startswith('  "0/m/w"'))
    chunks = re.search(r'"chunks": \[(\[[^\]]*\])\]\}', line)
    assert chunks is not None
    # One anchored list of n locations, and n entries naming it: n**2 locations once expanded.
    anchored = line.replace(chunks.group(0), f'"chunks": &c [{", ".join([chunks.group(1)] * n)}]}}')
    aliased = "".join(
        f'\n  "0/m/a{i}": {{"type": "tensor", "dtype": "float32", "shape": [1], "chunks": *c}}'
        for i in range(n)
    )
    (root / MANIFEST).write_bytes(_seal(body.replace(line, anchored + aliased)))
    return _refused(str(root))


def _depth(root: Path, n: int) -> Callable[[], object]:
    _take(root, {"m": StateDict(step=1)})
    deep = '"value": ' + "[" * n + "]" * n
    body = _body(root).replace('"value": 1', deep, 1)
    (root / MANIFEST).write_bytes(_seal(body))
    return _refused(str(root))


def _chunks(root: Path, n: int) -> Callable[[], object]:
    values = torch.arange(n, dtype=torch.float32)
    _take(root, {"m": StateDict(w=values)})
    body = _body(root)
    line = next(x for x in body.splitlines() if x.startswith('  "0/m/w"'))
    blob = re.search(r'"chunks": \[\["([^"]+)", (\d+),', line)
    assert blob is not None
    name, base = blob.group(1), int(blob.group(2))
    raw = values.numpy().tobytes()
    locations = ", ".join(
        f'["{name}", {base + 4 * i}, 4, {zlib.crc32(raw[4 * i : 4 * i + 4])}]' for i in range(n)
    )
    head = f'  "0/m/w": {{"type": "tensor", "dtype": "float32", "shape": [{n}], '
    new = f'{head}"chunks": [{locations}]}}'
    (root / MANIFEST).write_bytes(_seal(body.replace(line, new)))
    path = str(root)
    return lambda: Snapshot(path).read_object("0/m/w")


def _refused(path: str) -> Callable[[], object]:
    """Opening the snapshot at ``path``; the outcome is the error's class ("opened": none)."""

    def run() -> object:
        try:
            Snapshot(path).get_manifest()
        except Exception as e:  # any class is reported: a SnapshotError is the right one
            return type(e).__name__
        return "opened"

    return run


BUILDERS: dict[str, Callable[[Path, int], Callable[[], object]]] = {
    "entries": _entries,
    "shards": _shards,
    "aliases": _aliases,
    "depth": _depth,
    "chunks": _chunks,
}


def _seconds(op: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(RUNS):
        t0 = time.process_time()
        op()
        best = min(best, time.process_time() - t0)
    return best


def _calls(op: Callable[[], object]) -> int:
    """Profile events (calls and returns, Python and builtin) on this thread during ``op``."""
    count = 0

    def tally(frame: object, event: str, arg: object) -> None:
        nonlocal count
        count += 1

    sys.setprofile(tally)
    try:
        op()
    finally:
        sys.setprofile(None)
    return count


def _peak_bytes(op: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        op()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure(name: str, n: int, where: Path) -> dict[str, object]:
    """One row: ``name``'s input at ``n`` and ``10 n``, its time and peak memory at each."""
    row: dict[str, object] = {"input": name, "n": n, "10n": 10 * n}
    ops = {}
    for label, size in (("n", n), ("10n", 10 * n)):
        ops[label] = BUILDERS[name](where / f"{name}-{size}", size)
    for label, op in ops.items():
        outcome = op()  # warm: the first run pays for imports and caches
        row[f"outcome_{label}"] = outcome if isinstance(outcome, str) else "read"
        row[f"seconds_{label}"] = _seconds(op)
        row[f"peak_bytes_{label}"] = _peak_bytes(op)
        row[f"calls_{label}"] = _calls(op)
    row["time_ratio"] = row["seconds_10n"] / row["seconds_n"]  # type: ignore[operator]
    row["calls_ratio"] = row["calls_10n"] / row["calls_n"]  # type: ignore[operator]
    row["memory_ratio"] = row["peak_bytes_10n"] / row["peak_bytes_n"]  # type: ignore[operator]
    return row


def _table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| input | n | 10n | CPU at n | CPU at 10n | CPU ratio | calls ratio | peak at n "
        "| peak at 10n | memory ratio | outcome |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['input']} | {r['n']:,} | {r['10n']:,} | {r['seconds_n'] * 1e3:.1f} ms "
            f"| {r['seconds_10n'] * 1e3:.1f} ms | {r['time_ratio']:.1f} | {r['calls_ratio']:.1f} "
            f"| {r['peak_bytes_n'] / 2**20:.2f} MiB | {r['peak_bytes_10n'] / 2**20:.2f} MiB "
            f"| {r['memory_ratio']:.1f} | {r['outcome_10n']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every n by this")
    parser.add_argument("--only", nargs="*", choices=sorted(BUILDERS), help="these inputs only")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or list(BUILDERS):
            n = max(10, int(SIZES[name] * args.scale))
            rows.append(measure(name, n, Path(tmp)))
            print(f"{name}: done", file=sys.stderr)
    print(json.dumps(rows, indent=1) if args.json else _table(rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("STATESNAP_LOG_LEVEL", "WARNING")
    sys.exit(main())
