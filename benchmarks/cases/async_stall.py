"""``--case async``: how long statesnap's async_take blocks the caller (first call in a process,
later calls), against its take, plain CPU copies of the state, torchsnapshot's async_take and
DCP's async_save; totals to completion; whether each wrote the state as it was at call time
while the caller changed every tensor; RSS and staging-pool bytes over a series of async takes
in one process. With ``--library``, every statesnap method runs from each other tree too."""

from __future__ import annotations

import argparse
import shutil
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks.common import (
    MIB,
    build_spec,
    describe_spec,
    fmt_size,
)
from benchmarks.harness import (
    CaseResult,
    Row,
    Runner,
    StateCase,
    Variant,
    fmt_ratio,
    fmt_rounds,
    fmt_s,
    group,
    is_statesnap,
    log,
    mib,
    with_libraries,
)
from benchmarks.methods import (
    ASYNC_METHODS,
)

NAME = "async"
DEFAULTS = {"modes": ["fsync", "cache"], "temps": []}
LIBRARY_VARIANTS = True
DEFAULT_ASYNC_METHODS = [
    "statesnap-async",
    "statesnap-async-budget",
    "statesnap-take",
    "copy-fresh",
    "copy-prealloc",
    "torchsnapshot-async",
    "dcp-async",
]
# Modes do not apply to the plain copies (they write nothing): they run once per round.
MEMORY = "memory"
ASYNC_MODE_TITLES = {
    "fsync": "fsync'd (every library's default: statesnap fsyncs, DCP `sync_files=True`; "
    "torchsnapshot's files are fsync'd by the harness after its wait, timed)",
    "cache": 'to the page cache (statesnap `storage_options={"fsync": False}`, DCP '
    "`sync_files=False`, torchsnapshot as it is)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--calls",
        type=int,
        default=3,
        help="async: calls per worker (the first in a fresh process, then later ones)",
    )
    parser.add_argument(
        "--series",
        type=int,
        default=10,
        help="async: calls of statesnap's async_take per worker (its RSS and pool series)",
    )


def _async_rows(
    state: StateCase, rnd: int, run: Variant, mode: str, result: dict[str, Any]
) -> list[Row]:
    """One row per call of an async worker (``seconds`` is the stall), and one failed row for
    the call that raised or the worker that died. A call whose check failed keeps ``ok``
    (its timings are valid); its check verdict is in ``extra["check_ok"]``."""
    rows: list[Row] = []
    common = {
        "case": NAME,
        "state": state.label,
        "round": rnd,
        "variant": run.label,
        "writer": run.writer,
        "op": "async",
        "mode": mode,
        "method": run.writer,
        "library": run.library,
        "payload_bytes": result.get("payload_bytes", 0),
        "baseline_rss": result.get("baseline_rss"),
    }
    for c in result.get("calls", []):
        check = c.get("check") or {"ok": False, "detail": "no check"}
        rows.append(
            Row(
                **common,
                ok=True,
                seconds=c["stall"],
                peak_rss=c.get("peak_rss_above_call"),
                check=check["detail"],
                extra={k: v for k, v in c.items() if k != "check"} | {"check_ok": check["ok"]},
            )
        )
        log(
            f"  [{state.label} {mode} round {rnd + 1}] {run.label} call {c['call'] + 1}: "
            f"stall {c['stall']:.3f} s, total {c['total']:.3f} s, check {check['detail']}"
        )
    if not result.get("ok"):
        n = len(result.get("calls", []))
        rows.append(
            Row(
                **common,
                ok=False,
                error=result.get("error", "no result"),
                extra={"call": n, "traceback": result.get("traceback", "")},
            )
        )
        log(
            f"  [{state.label} {mode} round {rnd + 1}] {run.label} call {n + 1}: FAILED "
            f"{result.get('error')}\n{result.get('traceback', '')}"
        )
    return rows


def run_async_rounds(
    runner: Runner,
    states: Sequence[StateCase],
    runs: Sequence[Variant],
    modes: Sequence[str],
    calls: int,
    series: int,
    reps: int,
) -> list[Row]:
    """Per round, state and mode, each run (an ``ASYNC_METHODS`` entry, its ``writer``, from
    the tree of the library its ``env`` names) in a fresh worker (statesnap's async take makes
    ``series`` calls, the others ``calls``); the plain copies only in the first mode."""
    rows: list[Row] = []
    for rnd in range(reps):
        log(f"round {rnd + 1}/{reps}")
        for state in states:
            for i, mode in enumerate(modes):
                # Reversed every other round (see ``harness.rows.run_rounds``): a fresh
                # process's first call pays more in the first worker of a round.
                for run in runs if rnd % 2 == 0 else runs[::-1]:
                    m = ASYNC_METHODS[run.writer]
                    if not m.files and i > 0:
                        continue
                    path = runner.data_dir(f"{run.label}-{mode}")
                    shutil.rmtree(path, ignore_errors=True)
                    try:
                        result = runner.job(
                            {
                                "op": "async",
                                "method": m.name,
                                "mode": mode,
                                "state": state.args,
                                "path": path,
                                "calls": series if m.name == "statesnap-async" else calls,
                            },
                            run.env,
                        )
                    finally:
                        shutil.rmtree(path, ignore_errors=True)
                    rows += _async_rows(state, rnd, run, mode if m.files else MEMORY, result)
    return rows


def _first(rows: Iterable[Row], key: str = "") -> dict[int, float]:
    """Round -> the first call's stall (or ``extra[key]``)."""
    return {
        r.round: (r.extra[key] if key else r.seconds)
        for r in rows
        if r.ok and r.extra.get("call") == 0 and r.seconds is not None
    }


def _later(rows: Iterable[Row], key: str = "") -> dict[int, float]:
    """Round -> median over the later calls (2nd on) of the stall (or ``extra[key]``)."""
    by_round: dict[int, list[float]] = {}
    for r in rows:
        if r.ok and (r.extra.get("call") or 0) >= 1 and r.seconds is not None:
            by_round.setdefault(r.round, []).append(r.extra[key] if key else r.seconds)
    return {k: statistics.median(v) for k, v in by_round.items()}


def _ratios(num: dict[int, float], den: dict[int, float]) -> list[float]:
    return [num[k] / den[k] for k in sorted(num) if den.get(k)]


def _async_check(rows: Sequence[Row]) -> str:
    """Check column: calls whose written state equals the state at call time; failures."""
    done = [r for r in rows if r.ok]
    bad = [r for r in done if not r.extra.get("check_ok")]
    text = ""
    if done and not bad:
        text = f"ok: {len(done)}/{len(done)} calls bitwise equal to the state at call time"
    elif bad:
        details = list(dict.fromkeys(r.check.replace("|", "\\|")[:200] for r in bad))
        text = f"**INCONSISTENT in {len(bad)}/{len(done)} calls**: " + "; ".join(details[:3])
    failed = [r for r in rows if not r.ok]
    if failed:
        err = failed[0].error.replace("|", "\\|").replace("\n", " ")[:200]
        text = f"FAILED {len(failed)} worker(s): {err}" + (f"; otherwise {text}" if text else "")
    return text


def async_stall_table(rows: Sequence[Row], labels: Sequence[str]) -> list[str]:
    """The stall table of one state and mode: each method's first and later stalls, ratios to
    the CPU copies and to statesnap's async take (per round), totals, peak RSS, check."""
    groups = group(rows)
    fresh = groups.get(ASYNC_METHODS["copy-fresh"].label, [])
    prealloc = groups.get(ASYNC_METHODS["copy-prealloc"].label, [])
    ss = groups.get(ASYNC_METHODS["statesnap-async"].label, [])
    head = [
        "method",
        "stall, 1st call s",
        "stall, later calls s",
        "1st ÷ copy into fresh (1st)",
        "later ÷ copy into preallocated (later)",
        "÷ statesnap async_take (1st; later)",
        "total (call + wait), 1st s",
        "total, later s",
        "peak RSS above RSS at call (1st; later)",
        "check: what the call wrote, after the caller changed every tensor",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        mine = groups.get(label)
        if not mine:
            continue
        first, later = _first(mine), _later(mine)
        rss_first = {r.round: float(r.peak_rss) for r in mine if r.ok and r.extra.get("call") == 0}
        rss_later = _later(mine, "peak_rss_above_call")
        vs_ss = f"{fmt_ratio(_ratios(first, _first(ss)))}; {fmt_ratio(_ratios(later, _later(ss)))}"
        out.append(
            "| "
            + " | ".join(
                [
                    label,
                    fmt_rounds(first),
                    fmt_rounds(later),
                    fmt_ratio(_ratios(first, _first(fresh))),
                    fmt_ratio(_ratios(later, _later(prealloc))),
                    vs_ss,
                    fmt_rounds(_first(mine, "total")),
                    fmt_rounds(_later(mine, "total")),
                    f"{_fmt_median_size(rss_first)}; {_fmt_median_size(rss_later)}",
                    _async_check(mine),
                ]
            )
            + " |"
        )
    return out


def _fmt_median_size(values: dict[int, float]) -> str:
    return fmt_size(statistics.median(values.values())) if values else "—"


def async_library_table(rows: Sequence[Row], libraries: Sequence[str]) -> list[str]:
    """Each statesnap method from the working tree beside the same method from each other tree
    (``--library``): first and later stalls, and their per-round ratio working tree ÷ other
    tree (below 1: the working tree blocks the caller for less)."""
    groups = group(rows)
    head = ["method", "stall", "working tree s"]
    for name in libraries:
        head += [f"@{name} s", f"working tree ÷ @{name}"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for base, mine in groups.items():
        if not any(f"{base}@{name}" in groups for name in libraries):
            continue
        for what, pick in (("1st call", _first), ("later calls", _later)):
            cells = [base, what, fmt_rounds(pick(mine))]
            for name in libraries:
                theirs = pick(groups.get(f"{base}@{name}", []))
                cells += [fmt_rounds(theirs), fmt_ratio(_ratios(pick(mine), theirs))]
            out.append("| " + " | ".join(cells) + " |")
    return out if len(out) > 2 else []


def async_targets(rows: Sequence[Row]) -> list[str]:
    """The two targets, per round: statesnap's first stall ≤ 1.3x the copy into fresh tensors,
    its later stalls ≤ 2x the copy into preallocated ones."""
    groups = group(rows)
    ss = groups.get(ASYNC_METHODS["statesnap-async"].label, [])
    fresh = groups.get(ASYNC_METHODS["copy-fresh"].label, [])
    prealloc = groups.get(ASYNC_METHODS["copy-prealloc"].label, [])
    out = []
    for what, mine, ref, limit, name in (
        ("first", _first(ss), _first(fresh), 1.3, "the copy into fresh tensors"),
        ("later", _later(ss), _later(prealloc), 2.0, "the copy into preallocated tensors"),
    ):
        ratios = _ratios(mine, ref)
        if not ratios:
            out.append(f"- statesnap {what} stall ÷ {name}: not measured (a run failed)")
            continue
        med = statistics.median(ratios)
        verdict = "met" if med <= limit else "**NOT met**"
        out.append(
            f"- statesnap async_take, {what} stall ÷ {name}: {fmt_ratio(ratios)} "
            f"(target ≤ {limit}: {verdict}; {fmt_s(statistics.median(mine.values()))} s vs "
            f"{fmt_s(statistics.median(ref.values()))} s)"
        )
    return out


def async_series_table(rows: Sequence[Row], library: str = "") -> list[str]:
    """statesnap's async take (from the tree ``library``, "" for the working tree), call by call
    in one process: stall, peak RSS and RSS after the wait above the RSS before the first call,
    and the staging pool's bytes (every round)."""
    mine = [r for r in rows if r.method == "statesnap-async" and r.library == library and r.ok]
    if not mine:
        return []
    calls = sorted({r.extra["call"] for r in mine})
    rounds = sorted({r.round for r in mine})

    def cells(call: int, key: str, fmt: Any) -> str:
        vals = {r.round: r.extra[key] for r in mine if r.extra["call"] == call and key in r.extra}
        if not vals:
            return "—"
        if len(set(vals.values())) == 1 and len(vals) > 1:
            return f"{fmt(next(iter(vals.values())))} (every round)"
        return ", ".join(fmt(vals[k]) for k in sorted(vals))

    head = [
        "call",
        "stall s (per round)",
        "total s (per round)",
        "peak RSS above the RSS before call 1 (per round)",
        "RSS after the wait, above it (per round)",
        "pool `allocated_bytes` (per round)",
        "pool `free_bytes` (per round)",
        "memory budget before the call (per round)",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in calls:
        out.append(
            "| "
            + " | ".join(
                [
                    str(c + 1),
                    cells(c, "stall", fmt_s),
                    cells(c, "total", fmt_s),
                    cells(c, "peak_rss_above_start", fmt_size),
                    cells(c, "rss_after_above_start", fmt_size),
                    cells(c, "pool_allocated", mib),
                    cells(c, "pool_free", mib),
                    cells(c, "budget_before", mib),
                ]
            )
            + " |"
        )
    verdicts = []
    for rnd in rounds:
        series = [
            r.extra["pool_allocated"]
            for r in sorted(mine, key=lambda r: r.extra["call"])
            if r.round == rnd and "pool_allocated" in r.extra
        ]
        peaks = [
            r.extra["peak_rss_above_start"]
            for r in sorted(mine, key=lambda r: r.extra["call"])
            if r.round == rnd
        ]
        if len(series) < 2:
            continue
        grew = max(series[1:]) - series[0]
        verdicts.append(
            f"round {rnd + 1}: allocated {mib(series[0])} after call 1, "
            f"{mib(max(series[1:]))} at most after calls 2-{len(series)} "
            + ("(**grew** by " + mib(grew) + ")" if grew > 0 else "(no growth)")
            + f"; peak RSS above the start {fmt_size(peaks[0])} after call 1, "
            f"{fmt_size(max(peaks[1:]))} at most after"
        )
    out += ["", "Growth after the first call: " + "; ".join(verdicts) + "."] if verdicts else []
    return out


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    env = args.statesnap_env
    sizes = args.size or [512 * MIB]
    states = [
        StateCase(fmt_size(s), {"kind": "model", "size": s, "seed": args.seed}) for s in sizes
    ]
    names = args.methods or DEFAULT_ASYNC_METHODS
    for n in names:
        if n not in ASYNC_METHODS:
            raise SystemExit(
                f"--case async: unknown method {n!r}; known: {', '.join(ASYNC_METHODS)}"
            )
    methods = [ASYNC_METHODS[n] for n in names]
    runs = with_libraries(
        [Variant(m.label, m.name, [], dict(env) if is_statesnap(m.name) else {}) for m in methods],
        args.libraries,
    )
    rows = run_async_rounds(runner, states, runs, args.modes, args.calls, args.series, args.reps)
    labels = [run.label for run in runs]
    names_of = [lib.name for lib in args.libraries]
    out = [
        "",
        f"Calls per worker: statesnap async_take {args.series}, the others {args.calls} "
        "(call 1 in a fresh process; *later* = the median of calls 2 on, per round). Stall = "
        "the call's duration; total = stall + wait (the caller flips every tensor between "
        "them, timed apart: see the JSON's `mutate`).",
    ]
    for s in states:
        out += ["", f"#### {describe_spec(build_spec(s.args))}"]
        for mode in args.modes:
            sel = [r for r in rows if r.state == s.label and r.mode in (mode, MEMORY)]
            out += ["", f"**Stall and total, {ASYNC_MODE_TITLES[mode]}**", ""]
            out += async_stall_table(sel, labels)
            table = async_library_table(sel, names_of)
            if table:
                out += [
                    "",
                    f"**The stalls, working tree and {', '.join('@' + n for n in names_of)}** "
                    "(median, each round in parentheses; the ratio per round)",
                    "",
                    *table,
                ]
            out += ["", *async_targets(sel)]
            budgets = [
                r.extra["budget_before"]
                for r in sel
                if "budget_before" in r.extra and r.method == "statesnap-async" and not r.library
            ]
            if budgets:
                out.append(
                    "- statesnap async_take's memory budget (`STATESNAP_MEMORY_BUDGET_BYTES` "
                    "unset: a quarter of the available memory, the staging pool's free blocks "
                    "included, clamped to [64 MiB, 4 GiB]) right before its calls: "
                    f"{mib(min(budgets))} to {mib(max(budgets))}"
                )
        for mode, library in [(m, lib) for m in args.modes for lib in ["", *names_of]]:
            sel = [r for r in rows if r.state == s.label and r.mode == mode]
            table = async_series_table(sel, library)
            if table:
                tree = f"@{library}" if library else ""
                out += [
                    "",
                    f"**statesnap async_take{tree}, {args.series} calls in one process, each "
                    f"waited for ({mode})**: RSS above the RSS before the first call (state, check "
                    "targets and libraries already resident; the harness trims the C heap "
                    "after each check), and the staging pool "
                    "(its `default_pool()`, read by `benchmarks.methods.engine`) after each wait",
                    "",
                    *table,
                ]
    notes = [f"- {m.label}: {m.note}" for m in methods]
    out += ["", "Methods:", *notes]
    return rows, out
