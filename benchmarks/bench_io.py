"""Save/restore benchmarks of statesnap against raw file I/O, torch.save, DCP, safetensors and
torchsnapshot, in one process or across a process group. Prints paste-ready markdown tables;
see benchmarks/README.md.

This module is the command line: it parses the arguments (the shared ones here, each case's own
from its module in ``benchmarks/cases/``), runs the case with a :class:`~benchmarks.harness.Runner`,
prints the header (command, machine, library trees) and the case's tables, and writes every
measurement as JSON. The harness is in ``benchmarks/harness/``, the methods compared in
``benchmarks/methods/``, the worker process in ``benchmarks/worker.py``.

Every measured operation runs in a fresh process (``benchmarks.worker``); methods are
interleaved in rounds (A B C ... A B C ...), and tables give medians over the rounds together
with each round's ratio to the ``raw`` method and to statesnap. Before its timed call each worker
waits until the kernel has stopped handing freed memory back to the host (``--settle-memory``,
on by default; a no-op on a machine without free page reporting): on a VM that reports free
pages, what the previous seconds freed otherwise decides how fast the next write to the page
cache runs (``common.settle_memory``).

``--library NAME=PATH`` (repeatable) runs every statesnap method of the cases main, many-small,
restore-memory, checksums, scaling, dist and async a second time from the library's source tree
at PATH (a ``git worktree`` of another commit, say), in the same rounds, labelled
``<method>@NAME``; the tables show both, with the per-round ratio of the working tree's time to
the other tree's. Each worker checks that it imported the tree it was meant to measure.

Cases (``--case``):
  main            the generated model+optimizer state at each ``--size``: take to the page cache
                  and fsync'd, restore warm (files cached) and cold (dropped from the cache).
  many-small      20,000 tensors totalling 200 MiB vs one 200 MiB tensor; ratio many / single.
  restore-memory  peak RSS above baseline of an in-place statesnap restore of the 2 GiB state
                  with STATESNAP_MEMORY_BUDGET_BYTES=64MiB, against torch.load and raw reads.
  read-object     one 4 KiB tensor out of a 2 GiB snapshot: bytes read and time, separately
                  for Snapshot(path) (reads the manifest) and read_object.
  scaling         10,000 vs 100,000 leaves: take, restore, Snapshot(path)+get_manifest.
  dist            a process group of 1, 2 and 4 ranks (gloo, CPU, real processes): statesnap
                  take/restore with the model marked replicated against DCP save/load, which
                  also writes keys that every rank has once; time statesnap ÷ DCP per world size.
  async           how long statesnap's async_take blocks the caller (first call in a process,
                  later calls), against its take, plain CPU copies of the state, torchsnapshot's
                  async_take and DCP's async_save; totals to completion; whether each wrote the
                  state as it was at call time while the caller changed every tensor; RSS and
                  staging-pool bytes over a series of async takes in one process.
  async-loop      a small MLP trained on CPU: steps/s without snapshots, with a take and with
                  an async_take every N steps.
  async-training  an MLP and a small transformer (AdamW) trained on CPU, snapshotting with
                  statesnap's async_take and take and DCP's async_save (thread, process,
                  DefaultStager): blocking ÷ a plain copy, step time, peak RSS, a series of 50.
  checksums       the 2 GiB state taken and restored by statesnap with and without checksums
                  (STATESNAP_CHECKSUMS=0), and raw: what computing and verifying them costs.
  s3              the state at 128 MiB and 1 GiB taken to and restored from a local S3 server
                  (moto's, in a process of its own): statesnap's S3 plugin against one raw
                  multipart upload stream / one streaming GET, torch.save + s3fs pipe,
                  torchsnapshot's S3 plugin and DCP's fsspec writer/reader; the server's CPU
                  time during each call, and the targets.
  reshard         a state of DTensors (1 GiB of global tensors) saved by 4 ranks as [Shard(0)]
                  and restored into another sharding: 4 ranks [Shard(1)], 2 ranks, 1 process
                  (plain full tensors), and, saved by 2 ranks, 4 ranks; statesnap against DCP,
                  ratio DCP ÷ statesnap per scenario.
  parallel-2d     real parallel jobs (an MLP with AdamW, ~64 MiB): FSDP2 x TP on 2x2 restored
                  at 2x2, 1x2, 2x1, FSDP2 on 2 ranks and 1 rank; HSDP 2x2 -> 2x2, 4, 1; FSDP2
                  2 -> 2, 4; statesnap against DCP through the same Stateful (get_state_dict /
                  set_state_dict), first call and later calls, peak RSS per rank, resharded ÷
                  same-layout restore.

Example: ``python -m benchmarks.bench_io --case main --size 512MiB --reps 1``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from benchmarks.cases import CASES
from benchmarks.common import (
    GIB,
    MIB,
    SETTLE_QUIET_SECONDS,
    fmt_size,
    library_commit,
    machine_description,
    parse_size,
)
from benchmarks.harness import REPO, Library, Runner, log
from benchmarks.harness.cli import csv_list
from benchmarks.methods import ASYNC_METHODS, RESHARD_METHODS, S3_WRITERS, WRITERS


def _sizes(values: list[str] | None) -> list[int]:
    return [parse_size(x) for v in values or [] for x in csv_list(v)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Each case prints markdown to stdout (progress goes to stderr).",
    )
    p.add_argument("--case", choices=list(CASES), default="main")
    p.add_argument(
        "--size",
        "--sizes",
        dest="size",
        action="append",
        metavar="SIZE",
        help="state size(s), e.g. 512MiB,2GiB (repeatable). main: 512MiB,2GiB; "
        "many-small: total 200MiB; restore-memory, read-object, checksums: 2GiB; dist: 1GiB "
        "(the model; each rank's own state is a tenth of it); async: 512MiB; s3: 128MiB,1GiB; "
        "reshard: 1GiB (the global tensors)",
    )
    p.add_argument("--reps", type=int, default=3, help="rounds (median over them); default 3")
    p.add_argument(
        "--methods",
        type=csv_list,
        help=f"comma-separated writers: {','.join(WRITERS)} (their readers follow); "
        f"async: {','.join(ASYNC_METHODS)}; async-loop: none,take,async_take; "
        "async-training: none,ss-async,ss-take,dcp-thread,dcp-process,dcp-stager; "
        f"s3: {','.join(S3_WRITERS)}; reshard: {','.join(RESHARD_METHODS)}",
    )
    p.add_argument(
        "--modes", type=csv_list, help="take modes: cache (no fsync), fsync; default per case"
    )
    p.add_argument(
        "--temps",
        type=csv_list,
        help="restore page-cache states: warm, cold, as-left (right after the take)",
    )
    p.add_argument(
        "--dir",
        default="/tmp/statesnap-bench",
        help="scratch directory (a run-<pid> subdirectory is made and removed)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="STATESNAP_* variable for the statesnap workers (repeatable)",
    )
    p.add_argument(
        "--library",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also run every statesnap method from the library's source tree at PATH (e.g. a "
        "git worktree of another commit), labelled <method>@NAME, in the same rounds "
        "(repeatable; cases "
        + ", ".join(name for name, case in CASES.items() if case.LIBRARY_VARIANTS)
        + ")",
    )
    p.add_argument("--json", metavar="PATH", help="save every measurement as JSON")
    p.add_argument("--seed", type=int, default=0)
    for case in CASES.values():
        case.add_arguments(p)
    p.add_argument(
        "--settle-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before each timed operation, wait until the kernel has stopped handing freed "
        "memory back to the host (VMs with free page reporting; elsewhere a no-op); default on",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds before a worker is killed and its op reported failed",
    )
    args = p.parse_args(argv)
    args.size = _sizes(args.size)
    defaults = CASES[args.case].DEFAULTS
    args.modes = args.modes or defaults["modes"]
    args.temps = args.temps if args.temps is not None else defaults["temps"]
    for m in args.modes:
        if m not in ("cache", "fsync"):
            p.error(f"unknown mode {m!r}")
    for t in args.temps:
        if t not in ("warm", "cold", "as-left"):
            p.error(f"unknown restore temperature {t!r}")
    args.libraries = _parse_libraries(p, args.library)
    if args.libraries and not CASES[args.case].LIBRARY_VARIANTS:
        p.error(f"--library: the case {args.case} runs the working tree only")
    return args


def _parse_libraries(p: argparse.ArgumentParser, items: Sequence[str]) -> list[Library]:
    """``NAME=PATH`` -> a :class:`Library` each; PATH must hold the library's ``snapshot``."""
    out: list[Library] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9._-]+", name) or not path:
            p.error(f"--library wants NAME=PATH (NAME of letters, digits, . _ -), got {item!r}")
        path = os.path.realpath(os.path.expanduser(path))
        if not os.path.isfile(os.path.join(path, "snapshot", "__init__.py")):
            p.error(f"--library {item}: {path} has no snapshot/__init__.py")
        if path == os.path.realpath(REPO) or name in [lib.name for lib in out]:
            p.error(f"--library {item}: the working tree, or a name given twice")
        out.append(Library(name, path))
    return out


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("STATESNAP_"):
            raise SystemExit(f"--env wants STATESNAP_NAME=VALUE, got {item!r}")
        # The library parses plain integers; accept sizes like 64MiB for convenience.
        if value and not value.isdigit() and re.fullmatch(r"[0-9.]+\s*[A-Za-z]+", value):
            value = str(parse_size(value))
        env[key] = value
    return env


def _needed_bytes(args: argparse.Namespace) -> int:
    case = CASES[args.case]
    if hasattr(case, "needed_bytes"):
        return int(case.needed_bytes(args))
    sizes = args.size or ([2 * GIB] if args.case != "many-small" else [200 * MIB])
    # Every tree's statesnap variant keeps its files only until its own restores are done.
    return int(max(sizes) * 1.2) + GIB


def _settle_line(asked: bool, waits: Sequence[float]) -> str:
    if not asked:
        return "Memory: not settled before the timed operations (`--no-settle-memory`)."
    if not waits:
        return "Memory: no free page reporting seen on this machine; nothing to settle."
    return (
        "Memory: before each timed operation the worker waited until the kernel had handed no "
        f"freed memory back to the host for {SETTLE_QUIET_SECONDS:g} s (waits: median "
        f"{statistics.median(waits):.1f} s, "
        f"{min(waits):.1f}-{max(waits):.1f} s, {len(waits)} operations)."
    )


def _library_lines(
    libraries: Sequence[Library], commits: dict[str, str], imported: dict[str, set[str]]
) -> list[str]:
    """Which tree each label's workers measured, at which commit, and the files they reported
    importing the library from."""
    trees = [("working tree", os.path.realpath(REPO))] + [
        (f"@{lib.name}", lib.path) for lib in libraries
    ]
    out = ["Library trees measured:", ""]
    for label, path in trees:
        files = sorted(imported.get(path, set()))
        seen = ", ".join(f"`{f}`" for f in files) or "no statesnap worker reported"
        out.append(f"- {label}: `{path}`, commit {commits.get(path, '?')}; imported {seen}")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    args.statesnap_env = env = _parse_env(args.env)
    inherited = sorted(k for k in os.environ if k.startswith("STATESNAP_"))
    if inherited:
        log(
            f"note: the harness's own environment sets {', '.join(inherited)}; every worker "
            "inherits them"
        )
    free = shutil.disk_usage(
        args.dir if os.path.isdir(args.dir) else os.path.dirname(os.path.abspath(args.dir))
    ).free
    if free < _needed_bytes(args):
        raise SystemExit(
            f"{args.dir}: {fmt_size(free)} free, this case needs about "
            f"{fmt_size(_needed_bytes(args))}"
        )
    runner = Runner(args.dir, args.timeout, {}, settle_memory=args.settle_memory)
    machine = machine_description(runner.run_dir)
    commit = library_commit(REPO)
    other_commits = {lib.path: library_commit(lib.path) for lib in args.libraries}

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    started = time.time()
    try:
        rows, body = CASES[args.case].run(args, runner)
    finally:
        runner.close()
        signal.signal(signal.SIGTERM, previous)
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    commit_after = library_commit(REPO)
    if commit_after != commit:
        commit = f"{commit} at the start, {commit_after} at the end (it changed during the run)"
    argv_used = list(sys.argv[1:] if argv is None else argv)
    trees: list[str] = []
    if args.libraries:
        commits = {os.path.realpath(REPO): commit, **other_commits}
        trees = [*_library_lines(args.libraries, commits, runner.imported), ""]
    # glibc's allocator settings change every method's peak RSS and speed: they go into the
    # command as they were given, so that a reader can run it again.
    malloc = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")]
    header = [
        f"### {args.case} — {when}, library commit {commit}",
        "",
        "Command: `" + " ".join([*malloc, "python -m benchmarks.bench_io", *argv_used]) + "`",
        "",
        f"Reps: {args.reps} (rounds, methods interleaved; medians, with each round in "
        f"parentheses); statesnap env: {env or 'library defaults'}; wall time "
        f"{(time.time() - started) / 60:.1f} min.",
        "",
        *trees,
        _settle_line(args.settle_memory, runner.settle_waits),
        "",
        "Machine:",
        "",
        *machine,
    ]
    print("\n".join(header + body))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "case": args.case,
                    "date": when,
                    "commit": commit,
                    "libraries": {
                        lib.name: [lib.path, other_commits[lib.path]] for lib in args.libraries
                    },
                    "argv": argv_used,
                    "env": env,
                    "machine": machine,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
