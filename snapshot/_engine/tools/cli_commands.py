"""What the command line's commands compute and print (:mod:`snapshot.cli` parses the
arguments and calls ``run_<command>``): ``ls``, ``show``, ``verify``, ``du``, ``diff``,
``export``, ``steps`` and ``prune``, formatted as aligned tables, sizes for people and a
progress line on a terminal. Whatever comes from a snapshot is printed through
:mod:`snapshot._engine.format.text`, so a hostile key's control characters are shown escaped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from snapshot._engine.format.manifest_io import load_manifest
from snapshot._engine.format.text import printable, printable_message
from snapshot._engine.manager.retention import Policy, Step, to_delete
from snapshot._engine.manager.steps import INCOMPLETE, LEFT, UNREADABLE, Steps
from snapshot._engine.tools.inspection import (
    Listing,
    Usage,
    disk_usage,
    format_shape,
    human_bytes,
    list_entries,
    read_entry,
    summarize_tensor,
)
from snapshot._engine.tools.verify import diff, verify
from snapshot.errors import InvalidArgumentError, SnapshotError
from snapshot.options import Options


class _ProgressLine:
    """One line on stderr when it is a terminal, rewritten at most every tenth of a second as a
    long operation advances; nothing at all on a pipe, a file, a CI log."""

    def __init__(self, label: str, unit: str) -> None:
        self.label, self.unit, self.last, self.shown = label, unit, -math.inf, False
        try:
            self.enabled = bool(sys.stderr.isatty())
        except (AttributeError, ValueError, OSError):
            self.enabled = False

    def __call__(self, done: int, total: int, done_bytes: int, total_bytes: int) -> None:
        now = time.monotonic()
        if not self.enabled or (done < total and now - self.last < 0.1):
            return
        self.last, self.shown = now, True
        sys.stderr.write(
            f"\r{self.label}: {done}/{total} {self.unit}, "
            f"{human_bytes(done_bytes)} / {human_bytes(total_bytes)}\x1b[K"
        )
        sys.stderr.flush()

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Aligned text columns (those in ``right`` right-aligned), without trailing spaces."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:{'>' if i in right else '<'}{w}}}" for i, w in enumerate(widths)).format
    return [fmt(*header).rstrip(), *(fmt(*row).rstrip() for row in rows)]


def _count(n: int, noun: str) -> str:
    """``"1 entry"``, ``"3 entries"``, ``"2 blobs"``."""
    if n == 1:
        return f"1 {noun}"
    return f"{n:,} {noun[:-1] + 'ies' if noun.endswith('y') else noun + 's'}"


def _some(names: Sequence[str]) -> str:
    """The first five ``names``, and how many more."""
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return ", ".join(map(printable, names[:5])) + more


def _size(n: int, exact: bool) -> str:
    return str(n) if exact else human_bytes(n)


def _write_lines(lines: Sequence[str]) -> None:
    """Writes ``lines`` to stdout in one call. A reader that went away (``statesnap ls | head``)
    ends the output quietly; the command still returns its own exit code."""
    try:
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # Stdout pointed at the null device: the flush at exit would fail too.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass


# ---------------------------------------------------------------------------------------------
# ls


def run_ls(args: argparse.Namespace) -> int:
    listing = list_entries(load_manifest(args.path, args.storage_options), prefix=args.prefix)
    exact = args.bytes
    header = ["PATH", "KIND", "DTYPE", "SHAPE", "SIZE"]
    replicated = any(r.replicated for r in listing.rows)
    in_base = any(r.base for r in listing.rows)
    header += ["REPLICATED"] * replicated + ["IN BASE"] * in_base
    rows = []
    for r in listing.rows:
        row = [
            printable(r.path),
            r.kind,
            printable(r.dtype) if r.dtype else "-",
            format_shape(r.shape) if r.shape is not None else "-",
            _size(r.nbytes, exact) if r.nbytes or r.kind in ("tensor", "object") else "-",
        ]
        row += ["yes" if r.replicated else ""] * replicated + [printable(r.base)] * in_base
        rows.append(row)
    lines = _table(header, rows, right={4})
    counts = f"{_count(len(rows), 'entry')}, {_count(listing.tensors, 'tensor')}"
    lines.append(_total(counts, listing, "shared and replicated ranges counted once", exact))
    _write_lines(lines)
    return 0


def _total(counts: str, totals: Listing | Usage, once: str, exact: bool) -> str:
    """The last line of ``ls`` and ``du``: what is listed, and what the blobs hold of it."""
    nbytes, stored, in_bases = totals.nbytes, totals.stored_bytes, totals.base_bytes
    total = f"total: {counts}, {_size(nbytes, exact)}" + ("" if exact else f" ({nbytes:,} bytes)")
    if stored != nbytes:
        total += f"; {_size(stored, exact)} stored ({once})"
    if in_bases:
        names = ", ".join(map(printable, totals.bases))
        total += f"; {_size(in_bases, exact)} of it in base snapshots ({names})"
    return total


# ---------------------------------------------------------------------------------------------
# show


def _number(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        text = f"{value:.6g}"
        # 1.0, not 1: say it is a float
        return text if any(c in text for c in ".enia") else text + ".0"
    if isinstance(value, complex):
        return f"({value.real:.6g}{value.imag:+.6g}j)"
    return str(value)


def run_show(args: argparse.Namespace) -> int:
    key, entry, value = read_entry(args.path, args.key, args.storage_options)
    name = printable(key)
    lines = []
    if isinstance(value, torch.Tensor):
        s = summarize_tensor(value, values=args.values)
        lines.append(f"{name}: tensor")
        lines.append(f"  dtype   {printable(s.dtype)}")
        lines.append(f"  shape   {format_shape(s.shape)}")
        lines.append(f"  numel   {s.numel:,}")
        lines.append(f"  size    {human_bytes(s.nbytes)} ({s.nbytes:,} bytes)")
        lines.append(f"  min     {_number(s.min)}")
        lines.append(f"  max     {_number(s.max)}")
        lines.append(f"  mean    {_number(s.mean)}")
        if s.nonfinite:
            lines.append(f"  nan/inf {s.nonfinite:,} (min, max and mean are of the finite values)")
        if s.values is None:
            lines.append("  values  n/a")
        else:
            shown = ", ".join(_number(v) for v in s.values)
            more = f", ... ({s.numel - len(s.values):,} more)" if s.numel > len(s.values) else ""
            lines.append(f"  values  [{shown}{more}]")
    else:
        # Its type, length (containers, str, bytes) and repr, cut at --max-chars.
        cls = type(value)
        qualified = f"{cls.__module__}.{cls.__name__}"
        type_name = cls.__qualname__ if cls.__module__ == "builtins" else qualified
        about = [printable(type_name)] if type_name != entry.type else []
        if isinstance(value, (dict, list, tuple, set, str, bytes)):
            about.append(f"length {len(value):,}")
        if entry.nbytes:
            about.append(f"{human_bytes(entry.nbytes)} stored")
        lines.append(f"{name}: {printable(entry.type)} ({', '.join(about)})")
        text = repr(value)
        more = len(text) - args.max_chars
        cut = f"... ({more:,} more characters)" if more > 0 else ""
        lines.append(printable_message(text[: args.max_chars]) + cut)
    _write_lines(lines)
    return 0


# ---------------------------------------------------------------------------------------------
# verify


def run_verify(args: argparse.Namespace) -> int:
    progress = _ProgressLine("verify", "blobs")
    try:
        report = verify(args.path, args.storage_options, jobs=args.jobs, progress=progress)
    finally:
        progress.clear()
    lines = []
    for p in report.problems:
        who = ", ".join(map(printable, p.paths)) + ": " if p.paths else ""
        lines.append(
            f"{who}blob {printable(p.blob)}, bytes [{p.start}, {p.end}): "
            f"{printable_message(p.what)}"
        )
    unknown = report.sizes_unknown
    if unknown:
        lines.append(
            f"note: size not checked for {_count(len(unknown), 'blob')} ({_some(unknown)}): the "
            "store cannot tell their size, so bytes added after the take go unnoticed"
        )
    if report.checksums_missing:
        why = (
            f"{printable(report.foreign)} records none"
            if report.foreign
            else "taken with checksums off (Options(checksums=False) or STATESNAP_CHECKSUMS=0)"
        )
        decoded = (
            f" (and the {_count(report.decoded, 'pickled value')} among them by decoding)"
            if report.decoded
            else ""
        )
        lines.append(
            f"note: checksums were not recorded for {report.checksums_missing:,} of "
            f"{report.ranges:,} byte ranges ({why}): those were checked for size and "
            f"readability only{decoded}"
        )
    if report.not_decoded:
        lines.append(
            f"note: not decoded, so not checked: {_some(report.not_decoded)} (a type the safe "
            "loader does not allow; see `statesnap show` for the type to pass to "
            "torch.serialization.add_safe_globals)"
        )
    summary = (
        f"{_count(report.entries, 'entry')}, {_count(report.blobs, 'blob')}, "
        f"{human_bytes(report.bytes_read)} read, "
        f"{_count(report.checksums_checked, 'checksum')} checked"
    )
    if report.ok:
        lines.append(f"verify: OK: {summary}")
    else:
        problems = _count(len(report.problems), "problem")
        blobs = _count(len({p.blob for p in report.problems}), "blob")
        affected = _count(len({path for p in report.problems for path in p.paths}), "entry")
        lines.append(f"verify: FAILED: {problems} in {blobs}, {affected} affected; {summary}")
    _write_lines(lines)
    return 0 if report.ok else 1


# ---------------------------------------------------------------------------------------------
# du


def run_du(args: argparse.Namespace) -> int:
    usage = disk_usage(load_manifest(args.path, args.storage_options))
    exact = args.bytes
    header = ["RANK", "KEY", "ENTRIES", "SIZE", "REPLICATED", "SHARE"]
    rows = [
        [
            printable(r.rank),
            printable(r.key),
            f"{r.entries:,}",
            _size(r.nbytes, exact),
            _size(r.replicated_bytes, exact) if r.replicated_bytes else "-",
            f"{100 * r.nbytes / usage.nbytes:.1f}%" if usage.nbytes else "-",
        ]
        for r in usage.rows
    ]
    lines = _table(header, rows, right={2, 3, 4, 5})
    if len(usage.rank_bytes) > 1:
        lines.append(
            "per rank: "
            + ", ".join(
                f"rank {printable(k)} {_size(v, exact)}" for k, v in usage.rank_bytes.items()
            )
        )
    once = "replicated entries and shared tensors counted once"
    lines.append(_total(_count(usage.entries, "entry"), usage, once, exact))
    _write_lines(lines)
    return 0


# ---------------------------------------------------------------------------------------------
# diff


def run_diff(args: argparse.Namespace) -> int:
    progress = _ProgressLine("diff", "entries")
    try:
        report = diff(
            args.path_a, args.path_b, args.storage_options, jobs=args.jobs, progress=progress
        )
    finally:
        progress.clear()
    lines = [f"A: {printable(report.path_a)}", f"B: {printable(report.path_b)}"]
    width = max((len(d.what) for d in report.differences), default=0)
    for d in report.differences:
        detail = (
            f": {printable_message(d.detail)}" if d.detail and not d.what.startswith("only") else ""
        )
        lines.append(f"{d.what.ljust(width)}  {printable(d.path)}{detail}")
    read = (
        f"; {_count(report.compared_by_reading, 'entry')} compared by reading their bytes "
        "(no checksums recorded)"
        if report.compared_by_reading
        else ""
    )
    if report.identical:
        lines.append(f"identical: {_count(report.entries_a, 'entry')}{read}")
    else:
        a, b = _count(report.entries_a, "entry"), _count(report.entries_b, "entry")
        lines.append(f"{_count(len(report.differences), 'difference')} (A: {a}, B: {b}){read}")
    _write_lines(lines)
    return 0 if report.identical else 1


# ---------------------------------------------------------------------------------------------
# export


def run_export(args: argparse.Namespace) -> int:
    from snapshot.export import export

    names = ("format", "key", "strip_prefix", "dtype", "max_shard_size", "overwrite")
    flags = {name: getattr(args, name) for name in names}
    files = export(args.snapshot, args.out, storage_options=args.storage_options, **flags)
    _write_lines([f"wrote {printable(f)}" for f in files])
    return 0


# ---------------------------------------------------------------------------------------------
# steps and prune: a checkpoint manager's step folders (``snapshot.manager``)


def run_steps(args: argparse.Namespace) -> int:
    found = Steps(args.root, args.storage_options, Options.from_env()).scan()
    exact = args.bytes
    rows = []
    for s in found:
        metrics = json.dumps(s.metrics, sort_keys=True) if s.metrics else "-"
        rows.append(
            [
                str(s.step),
                s.state.replace(" ", "-"),
                _size(s.nbytes, exact) if s.committed else "-",
                printable(metrics),
                printable(",".join(s.bases)) or "-",
                printable(s.name),
            ]
        )
    lines = _table(["STEP", "STATE", "SIZE", "METRICS", "BASES", "FOLDER"], rows, right={0, 2})
    committed = [s for s in found if s.committed]
    latest = committed[-1].step if committed else None
    lines.append(
        f"{len(committed)} committed, {len(found) - len(committed)} incomplete, unreadable "
        f"or left alone; latest: {latest if latest is not None else 'none'}"
    )
    for s in found:
        if s.state in (UNREADABLE, LEFT):
            lines.append(f"{printable(s.name)}: {s.state}: {printable(s.reason)}")
    _write_lines(lines)
    return 0


def run_prune(args: argparse.Namespace) -> int:
    policy = Policy(args.keep_last, args.keep_every, args.keep_best, args.metric, args.mode)
    if policy.keeps_everything:
        raise InvalidArgumentError(
            "prune: give at least one of --keep-last, --keep-every, --keep-best"
        )
    steps = Steps(args.root, args.storage_options, Options.from_env())
    found = steps.scan()
    committed = [Step(s.step, s.name, s.metrics, s.bases) for s in found if s.committed]
    unreadable = [s.name for s in found if s.state == UNREADABLE]
    doomed = to_delete(policy, committed, unreadable=unreadable)
    # Debris of takes only when asked (a running job's take may be under way in one).
    debris = [s for s in found if s.state == INCOMPLETE] if args.incomplete else []
    lines = []
    verb = "would delete" if args.dry_run else "deleted"
    gone = set()
    for name in [s.name for s in doomed] + [s.name for s in debris]:
        path = printable(steps.path(name))
        if not args.dry_run:
            try:
                steps.delete(name)
            except SnapshotError as e:
                lines.append(f"kept {path}: {printable(str(e))}")
                continue
        gone.add(name)
        lines.append(f"{verb} {path}")
    for s in found:
        if s.state in (UNREADABLE, LEFT):
            lines.append(f"left alone {printable(steps.path(s.name))}: {printable(s.reason)}")
    if unreadable and to_delete(policy, committed):
        lines.append(
            "no committed step deleted: a step that cannot be read may need any other as its base"
        )
    kept = sorted(s.step for s in committed if s.name not in gone)
    lines.append(f"kept {len(kept)} committed step(s): {', '.join(map(str, kept)) or 'none'}")
    _write_lines(lines)
    return 0


# ---------------------------------------------------------------------------------------------
# the parsers


def _positive(text: str) -> int:
    try:
        if int(text) >= 1:
            return int(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")


# Each positional argument's help; its metavar is its name in capitals.
_POSITIONALS = {
    "path": "the snapshot (local path or URL)",
    "snapshot": "the snapshot (local path or URL)",
    "key": "the entry's logical path, as ls shows it",
    "path_a": "the first snapshot (A)",
    "path_b": "the second snapshot (B)",
    "out": "the folder to write into (made if missing)",
    "root": "the manager's root (local path or URL)",
}


def add_commands(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Registers every command but ``demo`` on the command line's sub-parsers (``common``: the
    options every command takes)."""

    def command(
        name: str,
        func: Callable[[argparse.Namespace], int],
        positionals: str,
        help: str,
        description: str,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=description)
        for dest in positionals.split():
            p.add_argument(dest, metavar=dest.upper(), help=_POSITIONALS[dest])
        p.set_defaults(func=func)
        return p

    p_ls = command(
        "ls",
        run_ls,
        "path",
        "list the entries of a snapshot (from its manifest; reads no blob)",
        "One row per manifest entry: logical path, kind, dtype (or the type of an object or "
        "primitive), shape, bytes stored; totals at the end.",
    )
    p_ls.add_argument(
        "--prefix", metavar="LOGICAL_PATH", help="only this entry and those below it (0/model)"
    )
    p_show = command(
        "show",
        run_show,
        "path key",
        "show one entry: a tensor's summary, any other value's repr",
        "Reads one entry (a container: everything below it) and shows it: for a tensor its "
        "dtype, shape, min/max/mean where the dtype allows them and its first values; for "
        "anything else its repr, cut when long.",
    )
    p_show.add_argument(
        "--values", type=_positive, default=8, help="tensor elements to show (default 8)"
    )
    p_show.add_argument(
        "--max-chars", type=_positive, default=2000, help="cut a repr after this many characters"
    )
    p_verify = command(
        "verify",
        run_verify,
        "path",
        "read every blob and check sizes and checksums against the manifest",
        "Reads every blob in pieces of at most 16 MiB and checks its length and every byte "
        "range's CRC-32 against the manifest, naming each damaged entry. Exit code 0 when all "
        "is well, 1 on any problem.",
    )
    p_du = command(
        "du",
        run_du,
        "path",
        "bytes per app_state key and rank, largest first",
        "Bytes per top-level key per rank, largest first, with the total. Replicated entries "
        "count for every rank that restores them, and once in 'stored'.",
    )
    p_diff = command(
        "diff",
        run_diff,
        "path_a path_b",
        "which entries of two snapshots differ",
        "Compares two snapshots entry by entry: paths only in one, kind, dtype, shape, "
        "primitive values, and bytes (through the recorded CRC-32s; entries without them are "
        "read and compared). Exit code 0 when identical, 1 when they differ.",
    )
    for p in (p_verify, p_diff):
        p.add_argument("--jobs", type=_positive, default=4, help="reads at once (default 4)")
    p_steps = command(
        "steps",
        run_steps,
        "root",
        "list the step folders under a checkpoint manager's root",
        "One row per step folder (step_<N>) under ROOT: committed, incomplete (a take that "
        "never finished: its pending marker and blobs), unreadable (a manifest that cannot be "
        "read: damaged, or of a newer statesnap) or left-alone (a link, another library's or a "
        "user's folder), its size, the metrics it was saved with, and the bases it needs "
        "(incremental snapshots).",
    )
    for p in (p_ls, p_du, p_steps):
        p.add_argument("--bytes", action="store_true", help="sizes as exact byte counts")
    p = command(
        "prune",
        run_prune,
        "root",
        "delete the steps a retention policy lets go",
        "Keeps the union of what each policy keeps (and always the newest committed step, and "
        "every base a kept step needs); deletes the other committed steps. Never deletes a step "
        "it cannot read (and, while there is one, no step), a link, or a folder holding files "
        "no take writes. Run it only while no job is saving under ROOT.",
    )
    p.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N steps")
    p.add_argument("--keep-every", type=int, metavar="N", help="keep multiples of N")
    p.add_argument("--keep-best", type=int, metavar="N", help="keep the N best by --metric")
    p.add_argument("--metric", help="the metric --keep-best ranks by")
    p.add_argument("--mode", choices=("min", "max"), default="min", help="min: lower is better")
    p.add_argument(
        "--incomplete",
        action="store_true",
        help="also delete the debris of takes that never finished (pending marker and blobs)",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted")
    p = command(
        "export",
        run_export,
        "snapshot out",
        "write a snapshot's tensors as safetensors (or torch) files",
        "Writes the tensors of SNAPSHOT (rank 0's; sharded ones consolidated) into the local "
        "folder OUT, streamed within the memory budget (STATESNAP_MEMORY_BUDGET_BYTES): "
        "model.safetensors, or model-0000i-of-0000N.safetensors files with "
        "model.safetensors.index.json when larger than --max-shard-size. The export is put in "
        "place only once every file is whole; a folder holding an earlier export is refused "
        "unless --overwrite. Values that are not tensors are skipped.",
    )
    p.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
    p.add_argument("--key", help="only this app_state key, named as its module names them (model)")
    p.add_argument("--strip-prefix", help="removed from the start of names (module.)")
    p.add_argument("--dtype", help="cast floating point tensors (bf16, fp16, fp32, fp8)")
    p.add_argument(
        "--max-shard-size", default="5GB", help="the largest file (default 5GB; 500MiB...)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in OUT (only the files an export recorded writing, "
        "once the new one is complete)",
    )
