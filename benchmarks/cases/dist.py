"""``--case dist``: a process group of ``--worlds`` ranks (default 1, 2 and 4; gloo, CPU, real
processes, one worker per rank): statesnap take/restore with the model marked replicated
against DCP save/load, which also writes keys that every rank has once; time statesnap ÷ DCP
per world size, bytes on disk, and each rank's own figures."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.common import (
    GIB,
    build_spec,
    describe_spec,
    fmt_size,
)
from benchmarks.harness import (
    SHORT_TITLES,
    CaseResult,
    Row,
    Runner,
    StateCase,
    Variant,
    fmt_ratio,
    fmt_s,
    group,
    library_sections,
    median,
    method_notes,
    mib,
    round_ratios,
    run_rounds,
    state_tables,
    status,
    with_libraries,
)
from benchmarks.harness.cli import int_list
from benchmarks.methods import (
    GROUP_READERS,
    GROUP_WRITERS,
    REPLICATED,
)

NAME = "dist"
DEFAULTS = {"modes": ["cache", "fsync"], "temps": ["warm"]}
LIBRARY_VARIANTS = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worlds",
        type=int_list,
        default=[1, 2, 4],
        help="dist: world sizes, e.g. 1,2,4 (that many processes per operation)",
    )


def _per_rank(rows: Sequence[Row], key: Any) -> list[float]:
    """Median over the rounds that worked of ``key(one rank's figures)``, per rank, rank 0
    first."""
    by_rank: dict[int, list[float]] = {}
    for r in rows:
        for fig in r.extra.get("ranks", []):
            value = key(fig)
            if r.ok and value is not None:
                by_rank.setdefault(fig["rank"], []).append(value)
    return [statistics.median(by_rank[k]) for k in sorted(by_rank)]


def dist_tables(
    rows: Sequence[Row],
    states: Sequence[StateCase],
    num: str,
    den: str,
    ops: Sequence[tuple[str, str]],
) -> list[str]:
    """The dist case's summary: time ``num`` ÷ ``den`` per world size and op, bytes on disk
    against the expected (model once, each rank's own state once per rank), and per-rank
    figures."""
    out = [
        "",
        f"**{num} ÷ {den}** (median of the per-round ratios, each round in parentheses; below 1 "
        f"means {num} is faster; seconds are the medians, each the slowest rank's time from a "
        "barrier before the call to a barrier after it)",
        "",
        f"| world size | op | {num} s | {den} s | {num} ÷ {den} |",
        "|---|---|---|---|---|",
    ]
    for st in states:
        for op, mode in ops:
            sel = [r for r in rows if r.state == st.label and (r.op, r.mode) == (op, mode)]
            mine = [r for r in sel if r.label == num]
            ref = [r for r in sel if r.label == den]
            fails = [r for r in mine + ref if not r.ok]
            note = f" — {status(fails, op)} ({fails[0].label})" if fails else ""
            med_num = median(r.seconds for r in mine if r.ok and r.seconds)
            med_den = median(r.seconds for r in ref if r.ok and r.seconds)
            out.append(
                f"| {st.args['world_size']} | {SHORT_TITLES[mode]} | {fmt_s(med_num)} | "
                f"{fmt_s(med_den)} | {fmt_ratio(round_ratios(mine, ref))}{note} |"
            )
    labels = list(group(rows))
    out += [
        "",
        "**Bytes on disk** after the take (every file under the snapshot directory; expected = "
        "the model's tensors once + each rank's own tensors x world size, so a method that "
        "wrote the model once per rank would show about world size x the model)",
        "",
        "| world size | expected | " + " | ".join(labels) + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for st in states:
        spec = build_spec(st.args)
        model = spec.group_nbytes("model")
        expected = model + st.args["world_size"] * (spec.nbytes - model)
        cells = [str(st.args["world_size"]), mib(expected)]
        for label in labels:
            takes = [r for r in rows if r.state == st.label and r.label == label and r.op == "take"]
            disk = next((r.disk for r in reversed(takes) if r.ok and r.disk), None)
            cells.append(
                f"{mib(disk['apparent'])} in {disk['files']} files "
                f"({disk['apparent'] / expected:.3f}x expected)"
                if disk
                else "—"
            )
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "**Per rank** (medians over rounds, rank 0 first): how long each rank's own call took "
        "(to its return, before the closing barrier), and what each rank wrote (take: `wchar`, "
        "bytes through write calls) or read (restore: `rchar`, bytes through read calls, page "
        "cache included)",
        "",
        "| world size | method | op | own call s per rank | bytes per rank |",
        "|---|---|---|---|---|",
    ]
    for st in states:
        if st.args["world_size"] < 2:
            continue
        for label in labels:
            for op, mode in ops:
                sel = [
                    r
                    for r in rows
                    if r.state == st.label and r.label == label and (r.op, r.mode) == (op, mode)
                ]
                counter = "wchar" if op == "take" else "rchar"
                secs = _per_rank(sel, lambda f: f.get("own_seconds"))
                nbytes = _per_rank(sel, lambda f, c=counter: (f.get("io") or {}).get(c))
                out.append(
                    f"| {st.args['world_size']} | {label} | {op} {mode} | "
                    f"{', '.join(fmt_s(x) for x in secs) or '—'} | "
                    f"{counter} {', '.join(mib(x) for x in nbytes) or '—'} |"
                )
    return out


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    env = args.statesnap_env
    size = (args.size or [GIB])[0]
    states = [
        StateCase(
            f"world size {w}", {"kind": "dp", "size": size, "seed": args.seed, "world_size": w}
        )
        for w in args.worlds
    ]
    methods = args.methods or ["statesnap", "dcp"]
    for m in methods:
        if m not in GROUP_WRITERS:
            raise SystemExit(
                f"--case dist: unknown method {m!r}; known: {', '.join(GROUP_WRITERS)}"
            )
    variants = with_libraries(
        [Variant(m, m, [m], dict(env) if m == "statesnap" else {}) for m in methods],
        args.libraries,
    )
    rows = run_rounds(runner, NAME, states, variants, args.modes, args.temps, args.reps)
    spec0 = build_spec({**states[0].args, "rank": 0})
    model = spec0.group_nbytes("model")
    own = spec0.nbytes - model
    out = [
        "",
        f"World sizes {', '.join(str(w) for w in args.worlds)}: one gloo process group of "
        "that many processes on this machine (CPU), new for every operation. Each rank holds "
        f"the same model ({fmt_size(model)}, replicated: statesnap is told "
        f"`replicated={REPLICATED}`) and its own state ({fmt_size(own)}, different on every "
        f"rank). Rank 0: {describe_spec(spec0)}.",
        "",
        "GB/s: takes count the bytes the group must write (the model once, each rank's own "
        "state once); restores the bytes loaded into every rank's tensors.",
    ]
    ops = [("take", m) for m in args.modes] + [("restore", t) for t in args.temps]
    if "statesnap" in methods and "dcp" in methods:
        out += dist_tables(rows, states, "statesnap", "dcp", ops)
    out += library_sections(rows, [st.label for st in states], [lib.name for lib in args.libraries])
    for st in states:
        out += ["", f"#### {st.label}"]
        out += state_tables(rows, st.label, args.modes, args.temps, refs=("dcp", "statesnap"))
    out += ["", method_notes(variants, GROUP_WRITERS, GROUP_READERS)]
    return rows, out
