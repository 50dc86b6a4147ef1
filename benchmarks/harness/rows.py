"""What a case runs and what it measured: variants (a writer, its readers, their workers'
environment; one per library tree with ``--library``), generated states, and a :class:`Row` per
measured operation; :func:`run_rounds`, the rounds of takes and restores most cases share."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from benchmarks.common import fsync_tree, resident_fraction, set_page_cache
from benchmarks.library_tree import LIBRARY_ENV
from benchmarks.methods import WRITERS, readers_of

if TYPE_CHECKING:
    from benchmarks.harness.runner import Runner


@dataclass
class Variant:
    """A row family: one writer, the readers that load its files, and env for its workers;
    ``library`` names the tree of the library its workers import ("" for the working tree)."""

    label: str
    writer: str
    readers: list[str]
    env: dict[str, str] = field(default_factory=dict)
    library: str = ""


@dataclass(frozen=True)
class Library:
    """Another source tree of the library (``--library NAME=PATH``): its statesnap methods run
    beside the working tree's, labelled ``<method>@NAME``."""

    name: str
    path: str

    def env(self) -> dict[str, str]:
        """What a worker needs to import the library from this tree (see benchmarks.worker)."""
        return {LIBRARY_ENV: self.path}


def is_statesnap(method: str) -> bool:
    """Whether a method (writer, reader or async method name) runs statesnap."""
    return method.startswith("statesnap")


def with_libraries(variants: Sequence[Variant], libraries: Sequence[Library]) -> list[Variant]:
    """The variants, each statesnap one followed by a copy per other tree (interleaved in the
    rounds right after it, so that each round pairs them)."""
    out: list[Variant] = []
    for v in variants:
        out.append(v)
        if not is_statesnap(v.writer):
            continue
        for lib in libraries:
            out.append(
                Variant(
                    f"{v.label}@{lib.name}",
                    v.writer,
                    list(v.readers),
                    {**v.env, **lib.env()},
                    library=lib.name,
                )
            )
    return out


@dataclass
class StateCase:
    """A generated state to run the variants on."""

    label: str
    args: dict[str, Any]


@dataclass
class Row:
    """One measured operation."""

    case: str
    state: str
    round: int
    variant: str
    writer: str  # the variant's writer
    op: str  # take | restore | read-object
    mode: str  # cache | fsync | warm | cold
    method: str  # writer or reader name
    ok: bool
    seconds: float | None = None
    payload_bytes: int = 0
    peak_rss: int | None = None
    baseline_rss: int | None = None
    disk: dict[str, int] | None = None
    check: str = ""
    in_place: bool | None = None
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    library: str = ""  # the variant's tree of the library ("" for the working tree)

    @property
    def label(self) -> str:
        """Table label: the reader's name, or the variant's for its main reader/writer; a
        reader of another tree of the library carries that tree's ``@NAME``."""
        if self.method == self.writer:
            return self.variant
        return f"{self.method}@{self.library}" if self.library else self.method


# A case's measurements and the markdown lines it prints.
CaseResult = tuple[list[Row], list[str]]


def variants_of(
    methods: Sequence[str], env: dict[str, str], readers: dict[str, list[str]] | None = None
) -> list[Variant]:
    """A variant per writer of ``methods`` (``WRITERS``), with the readers of ``readers`` or
    else every reader of its files; ``env`` goes to statesnap's workers only."""
    out = []
    for m in methods:
        if m not in WRITERS:
            raise SystemExit(f"unknown method {m!r}; known: {', '.join(WRITERS)}")
        rs = readers.get(m, readers_of(m)) if readers is not None else readers_of(m)
        out.append(Variant(m, m, rs, dict(env) if m == "statesnap" else {}))
    return out


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_row(
    case: str,
    state: StateCase,
    rnd: int,
    variant: Variant,
    op: str,
    mode: str,
    method: str,
    result: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Row:
    check = result.get("check") or {}
    ok = bool(result.get("ok")) and bool(check.get("ok", True))
    row = Row(
        case=case,
        state=state.label,
        round=rnd,
        variant=variant.label,
        writer=variant.writer,
        op=op,
        mode=mode,
        method=method,
        ok=ok,
        seconds=result.get("seconds"),
        payload_bytes=result.get("payload_bytes", 0),
        peak_rss=result.get("peak_rss_above_baseline"),
        baseline_rss=result.get("baseline_rss"),
        disk=result.get("disk"),
        check=check.get("detail", ""),
        in_place=result.get("in_place"),
        error=result.get("error", "") or ("" if check.get("ok", True) else check.get("detail")),
        extra={
            k: v
            for k, v in result.items()
            if k
            in (
                "io",
                "phases",
                "manifest_bytes",
                "snapshot_bytes",
                "rss_method",
                "ranks",
                "traceback",
                "library",
            )
        }
        | (extra or {}),
        library=variant.library,
    )
    speed = (
        f"{row.seconds:.3f} s ({row.payload_bytes / row.seconds / 1e9:.2f} GB/s)"
        if row.ok and row.seconds
        else ""
    )
    log(
        f"  [{state.label} round {rnd + 1}] {row.label} {op} {mode}: "
        f"{speed if row.ok else 'FAILED ' + row.error}"
    )
    return row


def run_rounds(
    runner: Runner,
    case: str,
    states: Sequence[StateCase],
    variants: Sequence[Variant],
    modes: Sequence[str],
    temps: Sequence[str],
    reps: int,
) -> list[Row]:
    """For each round, each state and each variant: a take in every mode (the last one's files
    stay), then every reader warm, then every reader cold; then the files are removed."""
    rows: list[Row] = []
    for rnd in range(reps):
        log(f"round {rnd + 1}/{reps}")
        for state in states:
            # Every other round runs the variants in reverse order: what the first worker of a
            # round pays and the next ones do not (memory the kernel has not handed out since it
            # was freed, the page cache of the files) then falls on each variant in turn.
            for v in variants if rnd % 2 == 0 else variants[::-1]:
                path = runner.data_dir(v.label)
                take: dict[str, Any] = {"ok": False, "error": "no take ran"}
                try:
                    for mode in modes:
                        shutil.rmtree(path, ignore_errors=True)
                        take = runner.job(
                            {
                                "op": "take",
                                "method": v.writer,
                                "mode": mode,
                                "state": state.args,
                                "path": path,
                            },
                            v.env,
                        )
                        rows.append(make_row(case, state, rnd, v, "take", mode, v.writer, take))
                    if not v.readers or not temps:
                        continue
                    if take.get("ok"):
                        fsync_tree(path)  # untimed: no dirty pages of the take linger
                    for temp in temps:
                        for reader in v.readers:
                            if not take.get("ok"):
                                failed = {"ok": False, "error": "its take failed"}
                                rows.append(
                                    make_row(case, state, rnd, v, "restore", temp, reader, failed)
                                )
                                continue
                            set_page_cache(path, temp)
                            cached = resident_fraction(path)
                            result = runner.job(
                                {
                                    "op": "restore",
                                    "method": reader,
                                    "mode": temp,
                                    "state": state.args,
                                    "path": path,
                                },
                                v.env,
                            )
                            rows.append(
                                make_row(
                                    case,
                                    state,
                                    rnd,
                                    v,
                                    "restore",
                                    temp,
                                    reader,
                                    result,
                                    {"cached_before": cached},
                                )
                            )
                finally:
                    shutil.rmtree(path, ignore_errors=True)
    return rows
