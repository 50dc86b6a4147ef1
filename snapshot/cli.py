"""Command line: ``python -m snapshot`` (and the ``statesnap`` console script).

This module parses the arguments, runs the command (``snapshot._engine.tools``; the demo is
here) and turns an error into one line on stderr and an exit code (:data:`EXIT_CODES`).
Whatever comes from a snapshot is printed escaped (``snapshot._engine.format.text``): a hostile
key's control characters must not reach the terminal.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from snapshot import RNGState, Snapshot, StateDict, __version__
from snapshot._engine.format.text import printable_message
from snapshot._engine.tools.cli_commands import add_commands
from snapshot.errors import CorruptSnapshotError, SnapshotError

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
# demo: train a little, snapshot, restore into fresh objects, and check training continues
# exactly as it would have without the interruption.


def _build(seed: int) -> dict[str, Any]:
    """A fresh app_state: model, optimizer, LR scheduler, progress and the global RNGs."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    progress = StateDict(step=0, note="statesnap demo")
    return {
        "model": model,
        "optim": optimizer,
        "sched": scheduler,
        "progress": progress,
        "rng": RNGState(),
    }


def _train(state: dict[str, Any], steps: int) -> list[float]:
    model, optimizer = state["model"], state["optim"]
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32)  # drawn from the global RNG, which the snapshot restores
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state["sched"].step()
        state["progress"]["step"] += 1
        losses.append(loss.item())
    return losses


def _demo(args: argparse.Namespace) -> int:
    """Runs the demo with the snapshot at ``--path`` (or in a temporary folder); returns a
    process exit code."""
    if not args.path:
        with tempfile.TemporaryDirectory(prefix="statesnap-demo-") as tmp:
            args.path = f"{tmp}/snapshot"
            return _demo(args)
    path, steps = args.path, args.steps
    app_state = _build(seed=0)
    _train(app_state, steps)
    t0 = time.perf_counter()
    snapshot = Snapshot.take(path, app_state)
    took = time.perf_counter() - t0
    entries = snapshot.get_manifest()
    size = sum(e.nbytes for e in entries.values())
    print(f"took snapshot at {path}: {len(entries)} entries, {size} bytes, {took * 1e3:.1f} ms")

    expected = _train(app_state, steps)

    # A fresh process would build everything from scratch; so do we, with another seed.
    fresh = _build(seed=1)
    t0 = time.perf_counter()
    Snapshot(path).restore(fresh)
    print(
        f"restored into fresh objects in {(time.perf_counter() - t0) * 1e3:.1f} ms "
        f"(step {fresh['progress']['step']})"
    )
    resumed = _train(fresh, steps)

    for i, (a, b) in enumerate(zip(expected, resumed, strict=True)):
        print(f"step {steps + i + 1}: uninterrupted loss {a:.6f}   restored loss {b:.6f}")
    if expected != resumed:
        print("FAILED: training after restore differs from uninterrupted training")
        return 1
    print("OK: training continued bitwise identically after restore")
    return 0


# ---------------------------------------------------------------------------------------------
# the command line


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
    p_demo.set_defaults(func=_demo)
    add_commands(sub, common)
    return parser


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
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        _say("statesnap: interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        if args.verbose:  # escaped: its messages may quote a snapshot's keys
            _say(printable_message("".join(traceback.format_exception(e)).rstrip("\n")))
        _say(_error_line(e))
        return _exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
