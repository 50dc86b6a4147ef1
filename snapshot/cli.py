"""Command line: ``python -m snapshot`` (and the ``statesnap`` console script).

This module parses the arguments, runs the command (``snapshot._engine.tools.cli_commands``,
the demo ``snapshot._engine.tools.demo``) and turns an error into one line on stderr and an exit
code (:data:`EXIT_CODES`). It imports nothing heavy: ``--help`` and ``--version`` load no torch,
and a command loads what it needs when it runs.
Whatever comes from a snapshot is printed escaped (``snapshot._engine.format.text``): a hostile
key's control characters must not reach the terminal.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from snapshot._engine.format.text import printable_message
from snapshot._engine.tools.output import say
from snapshot.errors import CorruptSnapshotError, SnapshotError
from snapshot.version import __version__

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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="statesnap",
        description="Take a look into statesnap snapshots and checkpoint roots (or run the demo).",
        epilog=EXIT_CODES,
        # The epilog is a table: printed as written, not re-wrapped.
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging, and tracebacks of errors"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The storage option is accepted after the command too (``statesnap ls PATH --storage-option
    # ...``), under another name: a sub-parser's default would overwrite the main parser's value.
    common = argparse.ArgumentParser(add_help=False)
    option: dict[str, Any] = dict(
        metavar="KEY=VALUE", action="append", type=_storage_option, default=[]
    )
    parser.add_argument(
        "--storage-option",
        dest="storage_option",
        help="an option for the storage plugin (repeatable); VALUE is parsed as JSON when it "
        "can be, else kept as a string; a dotted KEY (client_kwargs.region_name=us-east-1) "
        "makes nested options",
        **option,
    )
    common.add_argument(
        "--storage-option", dest="sub_storage_option", help="as before the command", **option
    )
    parser.add_argument("--version", action="version", version=f"statesnap {__version__}")
    p_demo = sub.add_parser(
        "demo", help="train a small model, snapshot it, restore it, check training continues"
    )
    p_demo.add_argument(
        "--path", help="where to take the snapshot (default: a temporary directory)"
    )
    p_demo.add_argument("--steps", type=int, default=5, help="training steps before and after")
    p_demo.set_defaults(run="snapshot._engine.tools.demo:demo")
    add_commands(sub, common)
    return parser


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
    options every command takes). A command runs ``run_<name>`` of
    ``snapshot._engine.tools.cli_commands``, imported only then."""

    def command(
        name: str, positionals: str, help: str, description: str, json: bool = True
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help, description=description)
        for dest in positionals.split():
            p.add_argument(dest, metavar=dest.upper(), help=_POSITIONALS[dest])
        if json:
            p.add_argument(
                "--json",
                action="store_true",
                help="one JSON document on stdout (docs/cli.md gives its keys); no progress bar",
            )
        p.set_defaults(run=f"snapshot._engine.tools.cli_commands:run_{name}")
        return p

    p_ls = command(
        "ls",
        "path",
        "list the entries of a snapshot (from its manifest; reads no blob)",
        "One row per manifest entry: logical path, kind, dtype (or the type of an object or "
        "primitive), shape, bytes stored; totals at the end. On a terminal "
        "each line is cut to its width (COLUMNS when set), the cut marked with an ellipsis.",
    )
    p_ls.add_argument(
        "--prefix", metavar="LOGICAL_PATH", help="only this entry and those below it (0/model)"
    )
    p_ls.add_argument("--wide", action="store_true", help="never cut lines to the terminal")
    p_show = command(
        "show",
        "path key",
        "show one entry: a tensor's summary, any other value summarized",
        "Reads one entry (a container: everything below it) and shows it: for a tensor its "
        "dtype, shape, min/max/mean where the dtype allows them and its first values; for "
        "anything else its repr, with long containers, strings and bytes cut (--full: whole).",
    )
    p_show.add_argument(
        "--values",
        type=_positive,
        default=8,
        help="a tensor's elements, or a container's items, to show (default 8)",
    )
    p_show.add_argument(
        "--max-chars",
        type=_positive,
        default=200,
        help="cut a string, bytes or repr after this many characters (default 200)",
    )
    p_show.add_argument("--full", action="store_true", help="print the whole repr, nothing cut")
    p_verify = command(
        "verify",
        "path",
        "read every blob and check sizes and checksums against the manifest",
        "Reads every blob in pieces of at most 16 MiB and checks its length and every byte "
        "range's CRC-32 against the manifest, naming each damaged entry. Exit code 0 when all "
        "is well, 1 on any problem.",
    )
    p_du = command(
        "du",
        "path",
        "bytes per app_state key and rank, largest first",
        "Bytes per top-level key per rank, largest first, with the total. Replicated entries "
        "count for every rank that restores them, and once in 'stored'.",
    )
    p_diff = command(
        "diff",
        "path_a path_b",
        "which entries of two snapshots differ",
        "Compares two snapshots entry by entry: paths only in one, kind, dtype, shape, "
        "primitive values, and bytes (through the recorded CRC-32s; entries without them are "
        "read and compared). Exit code 0 when identical, 1 when they differ.",
    )
    p_verify.add_argument(
        "--signature",
        action="store_true",
        help="check the snapshot's signature (manifest.sig.json) and the SHA-256 of its "
        "manifest, every blob and its bases' instead (docs/signing.md); needs --key",
    )
    p_verify.add_argument(
        "--key", metavar="KEYFILE", help="with --signature: a PEM Ed25519 key or an HMAC secret"
    )
    p_sign = command(
        "sign",
        "path",
        "sign a snapshot: write manifest.sig.json (SHA-256 of the manifest and every blob)",
        "Reads the manifest and every blob, hashes them with SHA-256 and writes a detached "
        "signature beside the manifest (manifest.sig.json, replacing one there), signed with "
        "--key: a PEM Ed25519 private key, or any other file as an HMAC-SHA256 secret. An "
        "incremental snapshot's unsigned bases are signed first. `statesnap verify "
        "--signature` checks it.",
    )
    p_sign.add_argument(
        "--key", metavar="KEYFILE", required=True, help="a PEM Ed25519 private key or HMAC secret"
    )
    for p in (p_verify, p_diff):
        p.add_argument("--jobs", type=_positive, default=4, help="reads at once (default 4)")
    p_steps = command(
        "steps",
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
        "root",
        "delete the steps a retention policy lets go",
        "Keeps the union of what each policy keeps (and always the newest committed step, and "
        "every base a kept step needs); deletes the other committed steps. Never deletes a step "
        "it cannot read (and, while there is one, no step), a link, or a folder holding files "
        "no take writes. Run it only while no job is saving under ROOT.",
        json=False,
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
        "snapshot out",
        "write a snapshot's tensors as safetensors (or torch) files",
        "Writes the tensors of SNAPSHOT (rank 0's; sharded ones consolidated) into the local "
        "folder OUT, streamed within the memory budget (STATESNAP_MEMORY_BUDGET_BYTES): "
        "model.safetensors, or model-0000i-of-0000N.safetensors files with "
        "model.safetensors.index.json when larger than --max-shard-size. The export is put in "
        "place only once every file is whole; a folder holding an earlier export is refused "
        "unless --overwrite. Values that are not tensors are skipped.",
        json=False,
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
    escaped (it may quote what a snapshot holds). The library's errors say what happened on
    their own; others get their type's name."""
    text = str(error)
    if not (isinstance(error, SnapshotError) and text):
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    text = _LINE_BREAK.sub(" ", text.strip())
    if len(text) > _MESSAGE_CHARS:
        more = len(text) - _MESSAGE_CHARS
        text = f"{text[:_MESSAGE_CHARS]}... ({more:,} more characters; -v shows them)"
    text = printable_message(text)
    if _exit_code(error) == EXIT_INTERNAL:
        return f"statesnap: internal error: {text} (a bug in statesnap; -v shows the traceback)"
    return f"statesnap: error: {text}"


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
    try:
        module, _, name = args.run.partition(":")
        return int(getattr(importlib.import_module(module), name)(args))
    except KeyboardInterrupt:
        say("statesnap: interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        if args.verbose:  # escaped: its messages may quote a snapshot's keys
            say(printable_message("".join(traceback.format_exception(e)).rstrip("\n")))
        say(_error_line(e))
        return _exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
