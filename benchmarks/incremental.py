"""Incremental takes against full takes of the same state, in one run.

Run from the repository root::

    python -m benchmarks.incremental                  # 1 GiB, 4 rounds, fsync and page cache
    python -m benchmarks.incremental --size-mib 256 --rounds 2   # about half a minute

Two cases, each round measuring every variant in turn (the order reversed every other round):

- frozen: a fine-tuning job's state, ``--frozen`` (95%) of the tensor bytes in a backbone that
  does not change, the rest (a head and its optimizer state) changing every step. An
  incremental take on the previous snapshot (``Snapshot.take(..., base=...)``) against a full
  take (``Snapshot.take`` as most scripts call it, and with ``Options(digests=True)``, what a
  take must record to serve as a later base).
- changed: every tensor changes between two takes (full training): the incremental take
  compares everything, reuses nothing, and writes everything.

Reports, per case and mode, the median seconds of each variant, the bytes it wrote (the
snapshot's own blobs), and per-round ratios against the full take. Prints Markdown; ``--json``
also writes the raw rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from snapshot import Options, Snapshot, StateDict

MIB = 1 << 20
TENSOR_MIB = 16  # the backbone's tensors: a transformer layer's matrices are of this order


def build_state(size_mib: int, frozen: float) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A state of about ``size_mib`` MiB of float32 tensors; returns it and the tensors that
    change each step (about ``1 - frozen`` of the bytes, plus a step counter)."""
    g = torch.Generator().manual_seed(0)
    total = size_mib * MIB // 4  # float32 elements
    frozen_elems = int(total * frozen)
    per = TENSOR_MIB * MIB // 4
    sizes = [per] * (frozen_elems // per) + ([frozen_elems % per] if frozen_elems % per else [])
    backbone = {f"layer{i}.weight": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    # The rest changes each step: a head and the optimizer's two moments of it.
    head_elems = (total - frozen_elems) // 3
    head = {"weight": torch.randn(head_elems, generator=g)}
    optim = {
        "exp_avg": torch.zeros(head_elems),
        "exp_avg_sq": torch.zeros(total - frozen_elems - 2 * head_elems),
    }
    state = {
        "backbone": StateDict(**backbone),
        "head": StateDict(**head),
        "optim": StateDict(**optim, step=0),
    }
    changing = [*head.values(), *optim.values()]
    return state, changing


def step(state: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.add_(0.001)
    state["optim"]["step"] += 1


def own_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def drop(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_case(
    case: str, size_mib: int, frozen: float, rounds: int, mode: str, scratch: str
) -> dict[str, list[dict[str, float]]]:
    """Rounds of one case in one mode: per variant, each round's seconds and bytes."""
    state, changing = build_state(size_mib, frozen)
    all_tensors = [v for sd in state.values() for v in sd.values() if isinstance(v, torch.Tensor)]
    storage = None if mode == "fsync" else {"fsync": False}
    digests = Options(digests=True)
    out: dict[str, list[dict[str, float]]] = {"full": [], "full+digests": [], "incremental": []}
    for rnd in range(rounds):
        base = os.path.join(scratch, f"r{rnd}-base")
        Snapshot.take(base, state, storage_options=storage, options=digests)
        step(state, changing if case == "frozen" else all_tensors)

        def full(rnd: int = rnd) -> tuple[str, Callable[[], Any]]:
            path = os.path.join(scratch, f"r{rnd}-full")
            return path, lambda: Snapshot.take(path, state, storage_options=storage)

        def full_digests(rnd: int = rnd) -> tuple[str, Callable[[], Any]]:
            path = os.path.join(scratch, f"r{rnd}-fulld")
            return path, lambda: Snapshot.take(
                path, state, storage_options=storage, options=digests
            )

        def incremental(rnd: int = rnd, base: str = base) -> tuple[str, Callable[[], Any]]:
            path = os.path.join(scratch, f"r{rnd}-incr")
            return path, lambda: Snapshot.take(path, state, storage_options=storage, base=base)

        variants = [("full", full), ("full+digests", full_digests), ("incremental", incremental)]
        if rnd % 2:
            variants.reverse()
        for name, make in variants:
            path, call = make()
            seconds = timed(call)
            out[name].append({"seconds": seconds, "bytes": own_bytes(path)})
            drop(path)
        drop(base)
    return out


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return f"{cpu}, {os.cpu_count()} logical cores, {mem:.1f} GiB RAM, torch {torch.__version__}"


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(results: dict[str, dict[str, dict[str, list[dict[str, float]]]]], args: Any) -> str:
    lines = [
        f"### incremental — {time.strftime('%Y-%m-%d %H:%M')}, library commit {commit()}",
        "",
        f"Command: `python -m benchmarks.incremental --size-mib {args.size_mib} --frozen "
        f"{args.frozen} --rounds {args.rounds} --modes {','.join(args.modes)}`",
        "",
        f"Machine: {machine()}. State: {args.size_mib} MiB of float32 tensors "
        f"({TENSOR_MIB} MiB each in the backbone). Medians of {args.rounds} rounds; per-round "
        "ratios ÷ the full take in parentheses.",
        "",
    ]
    for case, modes in results.items():
        title = (
            f"frozen: {args.frozen:.0%} of the bytes unchanged since the base"
            if case == "frozen"
            else "changed: every tensor changed since the base"
        )
        lines += [f"**{title}**", ""]
        lines += [
            "| mode | variant | median s | ÷ full take | MiB written | ÷ full take's bytes |",
            "|---|---|---|---|---|---|",
        ]
        for mode, variants in modes.items():
            full = variants["full"]
            for name, rows in variants.items():
                secs = [r["seconds"] for r in rows]
                ratios = [r["seconds"] / f["seconds"] for r, f in zip(rows, full, strict=True)]
                byte_ratio = statistics.median(
                    r["bytes"] / f["bytes"] for r, f in zip(rows, full, strict=True)
                )
                lines.append(
                    f"| {mode} | {name} | {statistics.median(secs):.3f} | "
                    f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)}) | "
                    f"{statistics.median(r['bytes'] for r in rows) / MIB:.1f} | {byte_ratio:.3f} |"
                )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--frozen", type=float, default=0.95)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["fsync", "cache"])
    parser.add_argument("--cases", type=lambda s: s.split(","), default=["frozen", "changed"])
    parser.add_argument("--scratch", default=None, help="folder for the snapshots (a temp dir)")
    parser.add_argument("--json", default=None, help="also write the raw rounds here")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="statesnap-incr-", dir=args.scratch)
    results: dict[str, dict[str, Any]] = {}
    try:
        for case in args.cases:
            results[case] = {}
            for mode in args.modes:
                results[case][mode] = run_case(
                    case, args.size_mib, args.frozen, args.rounds, mode, scratch
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(report(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
