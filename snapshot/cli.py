"""Command line: ``python -m snapshot`` (and the ``statesnap`` console script).

``demo`` runs the demonstration; ``ls``, ``show``, ``verify``, ``du`` and ``diff`` look into an
existing snapshot without restoring it (their logic is :mod:`snapshot._engine.inspection`;
this module parses arguments and formats what it returns). The exit codes are :data:`EXIT_CODES`.

Whatever comes from a snapshot (logical paths, blob names, type names, values, error messages
quoting them) is printed through :mod:`snapshot._engine.text`, so that a hostile key's control
characters are shown as escapes instead of being obeyed by the terminal.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any, TextIO

import torch

from snapshot import __version__
from snapshot._engine.inspection import (
    diff,
    disk_usage,
    format_shape,
    human_bytes,
    list_entries,
    read_entry,
    summarize_tensor,
    summarize_value,
    verify,
)
from snapshot._engine.operations import load_manifest
from snapshot._engine.text import printable, printable_message, unescape
from snapshot.errors import CorruptSnapshotError, EntryNotFoundError, SnapshotError

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_ERROR = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130

EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}    success; verify: no problem; diff: identical
  {EXIT_PROBLEM}    verify found a problem; diff found a difference; any command met a damaged
       or unsafe snapshot (CorruptSnapshotError, ChecksumError, UnsafeSnapshotError)
  {EXIT_ERROR}    usage error; no snapshot at the path; no such entry; any other error the
       library or the system reports (other SnapshotErrors, OSError)
  {EXIT_INTERNAL}    internal error: an exception statesnap did not raise on purpose (a bug)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)
output cut short by a closed pipe (statesnap ls ... | head) keeps the command's code."""

# ---------------------------------------------------------------------------------------------
# demo


def _demo(args: argparse.Namespace) -> int:
    from snapshot.demo import run_demo

    if args.path:
        return run_demo(args.path, steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="statesnap-demo-") as tmp:
        return run_demo(f"{tmp}/snapshot", steps=args.steps)


# ---------------------------------------------------------------------------------------------
# --storage-option


def _storage_option(text: str) -> tuple[tuple[str, ...], Any]:
    """``"a.b=1"`` -> ``(("a", "b"), 1)``: the value is JSON when it parses as JSON (numbers,
    true / false / null, quoted strings, lists, objects), else the string itself."""
    key, sep, raw = text.partition("=")
    parts = tuple(key.split("."))
    if not sep or not key or not all(parts):
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE (KEY may be dotted, as in client_kwargs.region_name=x), "
            f"got {text!r}"
        )
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return parts, value


def storage_options_from(pairs: Sequence[tuple[tuple[str, ...], Any]]) -> dict[str, Any] | None:
    """Nested ``storage_options`` from parsed ``--storage-option`` pairs (a later value of the
    same key wins); None when there are none.

    Raises:
        ValueError: a key is both a value and a parent of other keys (``a=1`` and ``a.b=2``).
    """
    if not pairs:
        return None
    options: dict[str, Any] = {}
    for parts, value in pairs:
        node = options
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(
                    f"storage option {'.'.join(parts[: i + 1])} is given a value and also "
                    f"the sub-key {'.'.join(parts)}"
                )
            node = child
        last = parts[-1]
        if isinstance(node.get(last), dict) and not isinstance(value, dict):
            raise ValueError(f"storage option {'.'.join(parts)} is given a value and also sub-keys")
        node[last] = value
    return options


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


def _ls(args: argparse.Namespace) -> int:
    listing = list_entries(load_manifest(args.path, args.storage_options), prefix=args.prefix)
    exact = args.bytes
    header = ["PATH", "KIND", "DTYPE", "SHAPE", "SIZE"]
    replicated = listing.any_replicated
    if replicated:
        header.append("REPLICATED")
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
    :func:`~snapshot._engine.text.printable`) or as it is: the logical path, its entry and its
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


def _show(args: argparse.Namespace) -> int:
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


def _verify(args: argparse.Namespace) -> int:
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
            else "taken with STATESNAP_CHECKSUMS=0"
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


def _du(args: argparse.Namespace) -> int:
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
    lines.append(total)
    _write_lines(lines)
    return 0


# ---------------------------------------------------------------------------------------------
# diff


def _diff(args: argparse.Namespace) -> int:
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


# ---------------------------------------------------------------------------------------------
# main


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="statesnap",
        description="Take a look into statesnap snapshots (or run the demo).",
        epilog=EXIT_CODES,
        # The epilog is a table: printed as written, not re-wrapped.
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging, and tracebacks of errors"
    )
    parser.add_argument(
        "--storage-option",
        dest="storage_option",
        metavar="KEY=VALUE",
        action="append",
        type=_storage_option,
        default=[],
        help="an option for the storage plugin (repeatable); VALUE is parsed as JSON when it "
        "can be, else kept as a string; a dotted KEY (client_kwargs.region_name=us-east-1) "
        "makes nested options",
    )
    parser.add_argument("--version", action="version", version=f"statesnap {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # The storage option is accepted after the command too (``statesnap ls PATH --storage-option
    # ...``), under another name: a sub-parser's default would overwrite the main parser's value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage-option",
        dest="sub_storage_option",
        metavar="KEY=VALUE",
        action="append",
        type=_storage_option,
        default=[],
        help="as before the command",
    )

    p_demo = sub.add_parser(
        "demo", help="train a small model, snapshot it, restore it, check training continues"
    )
    p_demo.add_argument(
        "--path", help="where to take the snapshot (default: a temporary directory)"
    )
    p_demo.add_argument("--steps", type=int, default=5, help="training steps before and after")
    p_demo.set_defaults(func=_demo)

    p_ls = sub.add_parser(
        "ls",
        parents=[common],
        help="list the entries of a snapshot (from its manifest; reads no blob)",
        description="One row per manifest entry: logical path, kind, dtype (or the type of an "
        "object or primitive), shape, bytes stored; totals at the end.",
    )
    p_ls.add_argument("path", metavar="PATH", help="the snapshot (local path or URL)")
    p_ls.add_argument(
        "--prefix", metavar="LOGICAL_PATH", help="only this entry and those below it (0/model)"
    )
    p_ls.add_argument("--bytes", action="store_true", help="sizes as exact byte counts")
    p_ls.set_defaults(func=_ls)

    p_show = sub.add_parser(
        "show",
        parents=[common],
        help="show one entry: a tensor's summary, any other value's repr",
        description="Reads one entry (a container: everything below it) and shows it: for a "
        "tensor its dtype, shape, min/max/mean where the dtype allows them and its first "
        "values; for anything else its repr, cut when long.",
    )
    p_show.add_argument("path", metavar="PATH", help="the snapshot (local path or URL)")
    p_show.add_argument("key", metavar="KEY", help="the entry's logical path, as ls shows it")
    p_show.add_argument(
        "--values", type=_positive, default=8, help="tensor elements to show (default 8)"
    )
    p_show.add_argument(
        "--max-chars",
        type=_positive,
        default=2000,
        help="cut a repr after this many characters (default 2000)",
    )
    p_show.set_defaults(func=_show)

    p_verify = sub.add_parser(
        "verify",
        parents=[common],
        help="read every blob and check sizes and checksums against the manifest",
        description="Reads every blob in pieces of at most 16 MiB and checks its length and "
        "every byte range's CRC-32 against the manifest, naming each damaged entry. Exit code "
        "0 when all is well, 1 on any problem.",
    )
    p_verify.add_argument("path", metavar="PATH", help="the snapshot (local path or URL)")
    p_verify.add_argument(
        "--jobs", type=_positive, default=4, help="blobs read at once (default 4)"
    )
    p_verify.set_defaults(func=_verify)

    p_du = sub.add_parser(
        "du",
        parents=[common],
        help="bytes per app_state key and rank, largest first",
        description="Bytes per top-level key per rank, largest first, with the total. "
        "Replicated entries count for every rank that restores them, and once in 'stored'.",
    )
    p_du.add_argument("path", metavar="PATH", help="the snapshot (local path or URL)")
    p_du.add_argument("--bytes", action="store_true", help="sizes as exact byte counts")
    p_du.set_defaults(func=_du)

    p_diff = sub.add_parser(
        "diff",
        parents=[common],
        help="which entries of two snapshots differ",
        description="Compares two snapshots entry by entry: paths only in one, kind, dtype, "
        "shape, primitive values, and bytes (through the recorded CRC-32s; entries without "
        "them are read and compared). Exit code 0 when identical, 1 when they differ.",
    )
    p_diff.add_argument("path_a", metavar="PATH_A", help="the first snapshot (A)")
    p_diff.add_argument("path_b", metavar="PATH_B", help="the second snapshot (B)")
    p_diff.add_argument(
        "--jobs", type=_positive, default=4, help="entries read at once when needed (default 4)"
    )
    p_diff.set_defaults(func=_diff)
    return parser


def _message(error: BaseException) -> str:
    """The library's errors say what happened on their own; others get their type's name."""
    text = str(error)
    if isinstance(error, SnapshotError) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _exit_code(error: BaseException) -> int:
    """The code of an error that stopped a command (:data:`EXIT_CODES`)."""
    if isinstance(error, CorruptSnapshotError):  # damaged or unsafe: checksums, symlinks...
        return EXIT_PROBLEM
    if isinstance(error, (SnapshotError, OSError)):  # raised on purpose, or by the system
        return EXIT_ERROR
    return EXIT_INTERNAL


# The most characters of a message printed on the error line; -v shows all in the traceback.
_MESSAGE_CHARS = 4000
_LINE_BREAK = re.compile(r"\s*\n\s*")


def _error_line(error: BaseException) -> str:
    """The one line on stderr for an error that stopped a command: its message on one line
    (a parser's message quoting the place it failed spans lines), cut when very long, and
    escaped (it may quote what a snapshot holds)."""
    text = _LINE_BREAK.sub(" ", _message(error).strip())
    if len(text) > _MESSAGE_CHARS:
        more = len(text) - _MESSAGE_CHARS
        text = f"{text[:_MESSAGE_CHARS]}... ({more:,} more characters; -v shows them)"
    text = printable_message(text)
    if _exit_code(error) == EXIT_INTERNAL:
        return f"statesnap: internal error: {text} (a bug in statesnap; -v shows the traceback)"
    return f"statesnap: error: {text}"


def _traceback(error: BaseException) -> str:
    """``error``'s traceback, each line escaped: its messages may quote a snapshot's keys."""
    return printable_message("".join(traceback.format_exception(error)).rstrip("\n"))


def _say(text: str) -> None:
    """``text`` as a line on stderr; nothing when stderr is closed too."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class _PrintableFormatter(logging.Formatter):
    """Log lines with their control characters escaped: the library logs logical paths and
    blob names, which come from the snapshot."""

    def format(self, record: logging.LogRecord) -> str:
        return printable_message(super().format(record))


def _setup_output(verbose: int) -> None:
    # A character the stream's encoding lacks is written as an escape, not an error.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (OSError, ValueError):
                pass
    handler = logging.StreamHandler()
    handler.setFormatter(_PrintableFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), handlers=[handler])


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit code
    (:data:`EXIT_CODES`)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        pairs = args.storage_option + getattr(args, "sub_storage_option", [])
        try:
            args.storage_options = storage_options_from(pairs)
        except ValueError as e:
            parser.error(str(e))
    except SystemExit as e:  # --help, --version, usage errors (argparse printed them)
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_ERROR)
    _setup_output(args.verbose)
    if args.command == "demo":
        return int(args.func(args))
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        _say("statesnap: interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        if args.verbose:
            _say(_traceback(e))
        _say(_error_line(e))
        return _exit_code(e)


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


if __name__ == "__main__":
    sys.exit(main())
