"""What the commands of the command line print: ``ls``, ``show``, ``verify``, ``du`` and
``diff`` (:mod:`snapshot.cli` parses the arguments and calls ``run_<command>``). Each computes
with :mod:`snapshot._engine.tools.inspection`, :mod:`snapshot._engine.tools.verify` or
:mod:`snapshot._engine.tools.diff`, and formats the data they return as text: aligned tables, sizes
for people, a progress line on a terminal.

Whatever comes from a snapshot (logical paths, blob names, type names, values, error messages
quoting them) is printed through :mod:`snapshot._engine.format.text`, so that a hostile key's control
characters are shown as escapes instead of being obeyed by the terminal.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import torch

from snapshot._engine.format.manifest_io import load_manifest
from snapshot._engine.format.text import printable, printable_message, unescape
from snapshot._engine.tools.diff import diff
from snapshot._engine.tools.inspection import (
    disk_usage,
    format_shape,
    human_bytes,
    list_entries,
    read_entry,
    summarize_tensor,
    summarize_value,
)
from snapshot._engine.tools.verify import verify
from snapshot.errors import EntryNotFoundError

# ---------------------------------------------------------------------------------------------
# Output helpers


class _ProgressLine:
    """One line on a terminal, rewritten as a long operation advances; nothing at all when the
    stream is not a terminal (a pipe, a file, a CI log)."""

    _INTERVAL_SECS = 0.1

    def __init__(self, stream: TextIO, label: str, unit: str) -> None:
        self.stream = stream
        self.label = label
        self.unit = unit
        try:
            self.enabled = bool(stream.isatty())
        except (AttributeError, ValueError, OSError):
            self.enabled = False
        self._last = -math.inf
        self._shown = False

    def __call__(self, done: int, total: int, done_bytes: int, total_bytes: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < self._INTERVAL_SECS:
            return
        self._last = now
        self.stream.write(
            f"\r{self.label}: {done}/{total} {self.unit}, "
            f"{human_bytes(done_bytes)} / {human_bytes(total_bytes)}\x1b[K"
        )
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Aligned text columns; column indices in ``right`` are right-aligned. Lines carry no
    trailing spaces."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    template = "  ".join(f"{{:{'>' if i in right else '<'}{w}}}" for i, w in enumerate(widths))
    fmt = template.format
    return [fmt(*header).rstrip(), *(fmt(*row).rstrip() for row in rows)]


def _count(n: int, noun: str) -> str:
    """``"1 entry"``, ``"3 entries"``, ``"2 blobs"``."""
    if n == 1:
        return f"1 {noun}"
    return f"{n:,} {noun[:-1] + 'ies' if noun.endswith('y') else noun + 's'}"


def _size(n: int, exact: bool) -> str:
    return str(n) if exact else human_bytes(n)


def _write_lines(lines: Sequence[str]) -> None:
    """Writes ``lines`` to stdout in one call (fast for 100,000 of them).

    A reader that went away (``statesnap ls ... | head``) ends the output quietly: the command
    still returns its own exit code, which the output being cut short does not change."""
    if not lines:
        return
    try:
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()


# ---------------------------------------------------------------------------------------------
# ls


def run_ls(args: argparse.Namespace) -> int:
    listing = list_entries(load_manifest(args.path, args.storage_options), prefix=args.prefix)
    exact = args.bytes
    header = ["PATH", "KIND", "DTYPE", "SHAPE", "SIZE"]
    replicated = listing.any_replicated
    if replicated:
        header.append("REPLICATED")
    in_base = listing.any_in_base
    if in_base:
        header.append("IN BASE")
    rows = []
    for r in listing.rows:
        row = [
            printable(r.path),
            r.kind,
            printable(r.dtype) if r.dtype else "-",
            format_shape(r.shape) if r.shape is not None else "-",
            _size(r.nbytes, exact) if r.nbytes or r.kind in ("tensor", "object") else "-",
        ]
        if replicated:
            row.append("yes" if r.replicated else "")
        if in_base:
            row.append(printable(r.base))
        rows.append(row)
    lines = _table(header, rows, right={4})
    total = (
        f"total: {_count(listing.entries, 'entry')}, {_count(listing.tensors, 'tensor')}, "
        f"{_size(listing.nbytes, exact)}"
    )
    if not exact:
        total += f" ({listing.nbytes:,} bytes)"
    if listing.stored_bytes != listing.nbytes:
        total += (
            f"; {_size(listing.stored_bytes, exact)} stored "
            "(shared and replicated ranges counted once)"
        )
    if listing.base_bytes:
        total += (
            f"; {_size(listing.base_bytes, exact)} of it in base snapshots "
            f"({', '.join(map(printable, listing.metadata.bases))})"
        )
    lines.append(total)
    _write_lines(lines)
    return 0


# ---------------------------------------------------------------------------------------------
# show


def _number(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        text = f"{value:.6g}"
        # 1.0, not 1: say it is a float
        return text if any(c in text for c in ".enia") else text + ".0"
    if isinstance(value, complex):
        return f"({value.real:.6g}{value.imag:+.6g}j)"
    return str(value)


def _read_shown_key(args: argparse.Namespace) -> tuple[str, Any, Any]:
    """The entry at KEY, which may be given as ``ls`` shows it (control characters escaped,
    :func:`~snapshot._engine.format.text.printable`) or as it is: the logical path, its entry and its
    value."""
    try:
        return args.key, *read_entry(args.path, args.key, args.storage_options)
    except EntryNotFoundError as not_found:
        key = unescape(args.key)
        if key == args.key:
            raise
        try:
            return key, *read_entry(args.path, key, args.storage_options)
        except EntryNotFoundError:
            raise not_found from None  # the message about KEY as it was typed


def run_show(args: argparse.Namespace) -> int:
    key, entry, value = _read_shown_key(args)
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
        v = summarize_value(value, max_chars=args.max_chars)
        about = [printable(v.type_name)] if v.type_name != entry.type else []
        if v.length is not None:
            about.append(f"length {v.length:,}")
        if entry.nbytes:
            about.append(f"{human_bytes(entry.nbytes)} stored")
        lines.append(f"{name}: {printable(entry.type)} ({', '.join(about)})")
        # A repr escapes a str's control characters itself, but not every type's repr does;
        # backslashes stay as the repr wrote them.
        lines.append(
            printable_message(v.text)
            + (f"... ({v.omitted_chars:,} more characters)" if v.omitted_chars else "")
        )
    _write_lines(lines)
    return 0


# ---------------------------------------------------------------------------------------------
# verify


def run_verify(args: argparse.Namespace) -> int:
    progress = _ProgressLine(sys.stderr, "verify", "blobs")
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
        names = ", ".join(map(printable, unknown[:5])) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        lines.append(
            f"note: size not checked for {_count(len(unknown), 'blob')} ({names}): the store "
            "cannot tell their size, so bytes added after the take go unnoticed"
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
        names = ", ".join(map(printable, report.not_decoded[:5])) + (
            f" and {len(report.not_decoded) - 5} more" if len(report.not_decoded) > 5 else ""
        )
        lines.append(
            f"note: not decoded, so not checked: {names} (a type the safe loader does not "
            "allow; see `statesnap show` for the type to pass to "
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
    total = f"total: {_count(usage.entries, 'entry')}, {_size(usage.nbytes, exact)}"
    if not exact:
        total += f" ({usage.nbytes:,} bytes)"
    if usage.stored_bytes != usage.nbytes:
        total += (
            f"; {_size(usage.stored_bytes, exact)} stored "
            "(replicated entries and shared tensors counted once)"
        )
    if usage.base_bytes:
        total += (
            f"; {_size(usage.base_bytes, exact)} of it in base snapshots "
            f"({', '.join(map(printable, usage.bases))})"
        )
    lines.append(total)
    _write_lines(lines)
    return 0


# ---------------------------------------------------------------------------------------------
# diff


def run_diff(args: argparse.Namespace) -> int:
    progress = _ProgressLine(sys.stderr, "diff", "entries")
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


def _silence_stdout() -> None:
    """Points stdout at the null device: the reader went away, and further writes, the
    interpreter's flush at exit included, would fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    finally:
        os.close(devnull)
