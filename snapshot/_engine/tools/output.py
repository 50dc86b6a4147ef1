"""How the command line's commands write: aligned tables, sizes for people, lines cut to the
terminal's width, one JSON document, and a progress bar on a terminal (tqdm, imported only when
a bar is shown). Imports nothing heavy: ``snapshot.cli`` stays quick to start.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from snapshot._engine.format.text import printable

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(n: int) -> str:
    """``n`` bytes for people: ``"512 B"``, ``"10.0 KiB"``, ``"3.4 GiB"`` (powers of 1024)."""
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{n} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    """Aligned text columns (those in ``right`` right-aligned), without trailing spaces."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:{'>' if i in right else '<'}{w}}}" for i, w in enumerate(widths)).format
    return [fmt(*header).rstrip(), *(fmt(*row).rstrip() for row in rows)]


def count(n: int, noun: str) -> str:
    """``"1 entry"``, ``"3 entries"``, ``"2 blobs"``."""
    if n == 1:
        return f"1 {noun}"
    return f"{n:,} {noun[:-1] + 'ies' if noun.endswith('y') else noun + 's'}"


def some(names: Sequence[str]) -> str:
    """The first five ``names``, and how many more."""
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return ", ".join(map(printable, names[:5])) + more


def size(n: int, exact: bool) -> str:
    return str(n) if exact else human_bytes(n)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def width() -> int | None:
    """The width to cut lines at when stdout is a terminal (``COLUMNS`` when set, else the
    terminal's: ``shutil.get_terminal_size``); None (no cut) on a pipe or a file, whatever
    ``COLUMNS`` says: test runners and CI systems set it for output no terminal shows."""
    if not _isatty(sys.stdout):
        return None
    return max(shutil.get_terminal_size().columns, 10)


def fit(lines: Sequence[str], columns: int | None) -> list[str]:
    """``lines`` each cut to ``columns`` characters, the last of a cut one an ellipsis (``...``
    where the output's encoding has no ``…``); as they are for None."""
    if columns is None:
        return list(lines)
    mark = "…"
    try:
        mark.encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        mark = "..."
    keep = columns - len(mark)
    return [line if len(line) <= columns else line[:keep] + mark for line in lines]


def write_lines(lines: Sequence[str]) -> None:
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


def _plain(value: Any) -> Any:
    """``value`` with what JSON has no number for written as text: a non-finite float as
    ``"nan"``, ``"inf"``, ``"-inf"``; a complex number as Python writes it (``"(1+2j)"``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, complex):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_json(document: dict[str, Any]) -> None:
    """``document`` as one JSON document on stdout, ASCII only (any other character, control
    characters included, as a ``\\u`` escape: a hostile name cannot reach the terminal, and a
    reader gets it back exactly)."""
    write_lines([json.dumps(_plain(document), indent=2, allow_nan=False)])


class Progress:
    """A tqdm bar on stderr when it is a terminal (and ``quiet`` is not set), cleared when
    done; nothing at all on a pipe, a file, a CI log. Called as the engine's progress callback:
    ``bar(items_done, items_total, bytes_done, bytes_total)``; ``bytes_total`` 0 counts items.
    """

    def __init__(self, label: str, unit: str, quiet: bool = False) -> None:
        self.label, self.unit, self.bar = label, unit, None
        self.enabled = not quiet and _isatty(sys.stderr)

    def __call__(self, done: int, total: int, done_bytes: int = 0, total_bytes: int = 0) -> None:
        if not self.enabled:
            return
        bar = self.bar
        by_bytes = total_bytes > 0
        if bar is None:
            try:  # imported only when a bar is shown
                from tqdm import tqdm  # type: ignore[import-untyped]
            except ImportError:  # a dependency, but the report matters more than its bar
                self.enabled = False
                return
            bar = self.bar = tqdm(
                total=total_bytes if by_bytes else total,
                desc=self.label,
                unit="B" if by_bytes else f" {self.unit}",
                unit_scale=by_bytes,
                unit_divisor=1024,
                file=sys.stderr,
                leave=False,
                dynamic_ncols=True,
            )
        if by_bytes:
            bar.set_postfix_str(f"{done}/{total} {self.unit}", refresh=False)
        bar.update((done_bytes if by_bytes else done) - bar.n)

    def close(self) -> None:
        """Shows the last count (tqdm draws at most ten times a second), then clears the bar."""
        if self.bar is not None:
            self.bar.refresh()
            self.bar.close()
            self.bar = None


def say(text: str) -> None:
    """``text`` as a line on stderr; nothing when stderr is closed too."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
