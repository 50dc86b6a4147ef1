"""Markdown tables of rows: medians over the rounds, ratios computed within each round (the
median first, each round in parentheses), and the per-op tables most cases print."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks.common import MIB, check_restored, fmt_size
from benchmarks.harness.rows import Row, Variant
from benchmarks.methods import READERS, WRITERS, Reader, Writer

MODE_TITLES = {
    "cache": "Take, to the page cache (no fsync)",
    "fsync": "Take, fsync'd (methods that do not fsync get their files fsync'd by the harness, "
    "timed)",
    "warm": "Restore, warm (files in the page cache)",
    "cold": "Restore, cold (files dropped from the page cache first)",
    "as-left": "Restore right after the take (the page cache as the take left it)",
}


def fmt_s(seconds: float | None) -> str:
    """Seconds with about three significant digits."""
    if seconds is None:
        return "—"
    if seconds < 0.1:
        return f"{seconds:.4f}"
    return f"{seconds:.3f}" if seconds < 10 else f"{seconds:.2f}"


def median(values: Iterable[float]) -> float | None:
    """The median, or None for no values."""
    vals = list(values)
    return statistics.median(vals) if vals else None


def fmt_rounds(values: dict[int, float], fmt: Any = fmt_s) -> str:
    """Median of per-round values, each round in parentheses."""
    if not values:
        return "—"
    med = fmt(statistics.median(values.values()))
    if len(values) == 1:
        return med
    return f"{med} ({', '.join(fmt(values[k]) for k in sorted(values))})"


def fmt_ratio(ratios: Sequence[float]) -> str:
    """The median ratio, then each round's in parentheses."""
    if not ratios:
        return "—"
    med = statistics.median(ratios)
    if len(ratios) == 1:
        return f"{med:.2f}"
    return f"{med:.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"


def round_ratios(mine: Sequence[Row], ref: Sequence[Row]) -> list[float]:
    """Per round in which both worked: my seconds ÷ the reference's."""
    by_round = {r.round: r for r in ref if r.ok and r.seconds}
    return [
        m.seconds / by_round[m.round].seconds
        for m in mine
        if m.ok and m.seconds and m.round in by_round
    ]


def group(rows: Iterable[Row]) -> dict[str, list[Row]]:
    """Rows by table label, in the order the labels first appear."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.label, []).append(r)
    return out


def status(rows: Sequence[Row], op: str) -> str:
    """The check column: ok (with the check's detail for a restore), or the failures."""
    bad = [r for r in rows if not r.ok]
    good = [r for r in rows if r.ok]
    text = ""
    if good:
        text = "ok" if op == "take" else good[0].check.removeprefix("ok ").strip("()")
        text = "ok" if op == "take" else f"ok, {text}"
    if bad:
        err = bad[0].error.replace("|", "\\|").replace("\n", " ")[:200]
        text = f"FAILED {len(bad)}/{len(rows)}: {err}" + (f"; otherwise {text}" if text else "")
    return text


def loads_into(rows: Sequence[Row]) -> str:
    """Whether a reader's rows loaded into the preallocated targets or into new tensors."""
    if rows and rows[0].method in READERS and READERS[rows[0].method].verify is not check_restored:
        return "n/a"
    flags = {r.in_place for r in rows if r.ok}
    if flags == {True}:
        return "preallocated"
    if flags == {None}:
        return "new tensors"
    if flags == {False}:
        return "new tensors (targets replaced)"
    return "—"


def op_table(
    rows: Sequence[Row],
    op: str,
    mode: str,
    refs: Sequence[str] = ("raw", "statesnap"),
) -> list[str]:
    """Markdown table of one op/mode of one state: medians, ratios per round, RSS, disk, check."""
    rows = [r for r in rows if r.op == op and r.mode == mode]
    if not rows:
        return []
    groups = group(rows)
    refs = [ref for ref in refs if ref in groups]
    head = ["method", "median s", "GB/s"] + [f"time ÷ {ref}" for ref in refs]
    head += ["per round s", "peak RSS above baseline"]
    head += ["on disk"] if op == "take" else ["loads into"]
    head += ["check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, mine in groups.items():
        ok = [r for r in mine if r.ok and r.seconds is not None]
        med = median(r.seconds for r in ok)  # type: ignore[misc]
        payload = mine[0].payload_bytes
        cells = [label, fmt_s(med), f"{payload / med / 1e9:.2f}" if med else "—"]
        cells += [fmt_ratio(round_ratios(mine, groups[ref])) for ref in refs]
        cells.append(", ".join(fmt_s(r.seconds) if r.ok and r.seconds else "✗" for r in mine))
        rss = median(r.peak_rss for r in ok if r.peak_rss is not None)
        cells.append(fmt_size(rss) if rss is not None else "—")
        if op == "take":
            disk = next((r.disk for r in reversed(ok) if r.disk), None)
            cells.append(f"{fmt_size(disk['apparent'])} in {disk['files']} files" if disk else "—")
        else:
            cells.append(loads_into(mine))
        cells.append(status(mine, op))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def state_tables(
    rows: Sequence[Row],
    state: str,
    modes: Sequence[str],
    temps: Sequence[str],
    refs: Sequence[str] = ("raw", "statesnap"),
) -> list[str]:
    out: list[str] = []
    mine = [r for r in rows if r.state == state]
    for op, mode in [("take", m) for m in modes] + [("restore", t) for t in temps]:
        table = op_table(mine, op, mode, refs)
        if table:
            out += ["", f"**{MODE_TITLES[mode]}**", "", *table]
    return out


def ratio_table(rows: Sequence[Row], numerator: str, denominator: str, title: str) -> list[str]:
    """Per method and op/mode: median seconds of two states and their per-round ratio."""
    keys: dict[tuple[str, str, str], None] = {}
    for r in rows:
        keys.setdefault((r.label, r.op, r.mode), None)
    head = ["method", "op", denominator + " s", numerator + " s", title]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, op, mode in keys:
        sel = [r for r in rows if (r.label, r.op, r.mode) == (label, op, mode)]
        num = [r for r in sel if r.state == numerator]
        den = [r for r in sel if r.state == denominator]
        mn = median(r.seconds for r in num if r.ok and r.seconds)
        md = median(r.seconds for r in den if r.ok and r.seconds)
        ratios = round_ratios(num, den)
        fail = [r for r in num + den if not r.ok]
        lines.append(
            "| "
            + " | ".join(
                [
                    label,
                    f"{op} {mode}",
                    fmt_s(md),
                    fmt_s(mn),
                    fmt_ratio(ratios) + (f" — FAILED: {fail[0].error[:120]}" if fail else ""),
                ]
            )
            + " |"
        )
    return lines


def group_by(rows: Iterable[Row], key: Any) -> dict[Any, list[Row]]:
    """Rows by ``key(row)``, in the order the keys first appear."""
    out: dict[Any, list[Row]] = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


# Short op titles and byte counts compared across methods (the dist, reshard and async cases).
SHORT_TITLES = {
    "cache": "take to page cache",
    "fsync": "take fsync'd",
    "warm": "restore warm",
    "cold": "restore cold",
    "as-left": "restore after take",
}


def mib(nbytes: float) -> str:
    """MiB with one decimal, for byte counts compared across methods."""
    return f"{nbytes / MIB:,.1f} MiB"


def method_notes(
    variants: Sequence[Variant],
    writers: dict[str, Writer] = WRITERS,
    readers: dict[str, Reader] = READERS,
) -> str:
    """The notes of the variants' writers and readers (each once: a variant of another tree of
    the library makes the same calls)."""
    notes = []
    for v in variants:
        if v.library:
            continue
        w = writers[v.writer]
        notes.append(
            f"- {v.writer} take: {w.note}" + ("" if w.objects else "; Python objects not stored")
        )
        for r in v.readers:
            notes.append(f"- {r} restore: {readers[r].note}")
    return "Methods:\n" + "\n".join(notes)


def library_table(rows: Sequence[Row], libraries: Sequence[str]) -> list[str]:
    """The working tree's statesnap rows beside the same methods run from other trees of the
    library (``--library NAME=PATH``, labelled ``<label>@NAME``): per label and op, medians and
    the per-round ratio of the working tree's time to each other tree's (below 1: the working
    tree is faster). Empty when no label has a counterpart."""
    groups = group(rows)
    bases = [label for label in groups if any(f"{label}@{name}" in groups for name in libraries)]
    if not bases:
        return []
    head = ["method", "op", "working tree s"]
    for name in libraries:
        head += [f"@{name} s", f"working tree ÷ @{name}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for base in bases:
        ops: dict[tuple[str, str], None] = {}
        for r in groups[base]:
            ops.setdefault((r.op, r.mode), None)
        for op, mode in ops:
            mine = [r for r in groups[base] if (r.op, r.mode) == (op, mode)]
            cells = [
                base,
                f"{op} {mode}",
                fmt_s(median(r.seconds for r in mine if r.ok and r.seconds)),
            ]
            for name in libraries:
                theirs = [
                    r for r in groups.get(f"{base}@{name}", []) if (r.op, r.mode) == (op, mode)
                ]
                fails = [r for r in mine + theirs if not r.ok]
                note = f" — {status(fails, op)}" if fails else ""
                cells += [
                    fmt_s(median(r.seconds for r in theirs if r.ok and r.seconds)),
                    fmt_ratio(round_ratios(mine, theirs)) + note,
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def library_sections(
    rows: Sequence[Row], states: Sequence[str], libraries: Sequence[str]
) -> list[str]:
    """Per state, its :func:`library_table` under a title; nothing without other trees."""
    out: list[str] = []
    others = ", ".join(f"@{name}" for name in libraries)
    for state in states:
        table = library_table([r for r in rows if r.state == state], libraries)
        if table:
            out += [
                "",
                f"**{state}: statesnap from the working tree and from {others}** (median "
                "seconds; per-round ratio working tree ÷ other tree, below 1: the working tree "
                "is faster)",
                "",
                *table,
            ]
    return out
