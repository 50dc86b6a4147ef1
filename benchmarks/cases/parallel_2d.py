"""``--case parallel-2d``: real parallel jobs (a small MLP with AdamW, ~64 MiB of parameters
and moments by default) saved on one layout and restored on others, statesnap against DCP,
both through the Stateful an FSDP2 / TP job writes (``get_state_dict`` / ``set_state_dict``,
DTensors kept; :mod:`benchmarks.methods.parallel`):

``fsdp-tp``  FSDP2 x TP on a 2x2 mesh, restored at 2x2, 1x2, 2x1, 1-D FSDP2 on 2 ranks, 1 rank;
``hsdp``     HSDP on a 2x2 mesh, restored at 2x2, 1-D FSDP2 on 4 ranks, 1 rank;
``fsdp``     FSDP2 on 2 ranks, restored on 2 and on 4.

Each take and restore is timed as the first call in a fresh process, then ``--later-calls``
times again in the same process. The first restore of each job is its same layout: every other
restore's time is also given ÷ that one's (per round and method). A take or restore that fails
is reported with its error in the tables; the job's other figures still run."""

from __future__ import annotations

import argparse
import shutil
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.common import fmt_size
from benchmarks.harness import (
    CaseResult,
    Row,
    Runner,
    StateCase,
    Variant,
    fmt_ratio,
    fmt_s,
    log,
    make_row,
    median,
    mib,
    round_ratios,
    status,
    with_libraries,
)
from benchmarks.harness.cli import csv_list
from benchmarks.methods.parallel import PARALLEL_METHODS, Layout, model_bytes

NAME = "parallel-2d"
DEFAULTS = {"modes": ["fsync"], "temps": ["warm"]}
LIBRARY_VARIANTS = True


@dataclass(frozen=True)
class Job:
    name: str
    title: str
    saved: str
    restores: tuple[str, ...]  # the first is the saved layout itself


JOBS = {
    j.name: j
    for j in (
        Job(
            "fsdp-tp",
            "FSDP2 x TP (fc1 Colwise, fc2 Rowwise on tp; fully_shard over dp; head FSDP only)",
            "fsdp-tp:2x2",
            ("fsdp-tp:2x2", "fsdp-tp:1x2", "fsdp-tp:2x1", "fsdp:2", "plain:1"),
        ),
        Job(
            "hsdp",
            "HSDP (fully_shard on a 2-D mesh)",
            "hsdp:2x2",
            ("hsdp:2x2", "fsdp:4", "plain:1"),
        ),
        Job("fsdp", "FSDP2 on a 1-D mesh", "fsdp:2", ("fsdp:2", "fsdp:4")),
    )
}

LAYOUT_TITLES = {
    "fsdp-tp": "FSDP2 x TP, dp x tp = {}",
    "hsdp": "HSDP, replicate x shard = {}",
    "fsdp": "FSDP2, {} ranks",
    "plain": "1 rank, plain tensors",
}


def layout_title(text: str) -> str:
    layout = Layout.parse(text)
    return LAYOUT_TITLES[layout.kind].format("x".join(map(str, layout.shape)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--jobs",
        type=csv_list,
        help="parallel-2d: which jobs, default all: " + ", ".join(JOBS),
    )
    parser.add_argument(
        "--dim",
        type=int,
        default=1056,
        help="parallel-2d: the MLP's width (fc1 dim -> 2 dim, fc2 back, head dim -> dim); "
        "1056: 63.8 MiB of parameters and AdamW moments",
    )
    parser.add_argument(
        "--later-calls",
        type=int,
        default=3,
        help="parallel-2d: takes and restores timed again in the same process after the first",
    )
    parser.add_argument(
        "--paired-takes",
        action="store_true",
        help="parallel-2d: each statesnap variant's later takes alternate with DCP's in the "
        "same processes (a row of their own)",
    )


def _state(layout: str, dim: int, seed: int) -> StateCase:
    return StateCase(
        layout,
        {"layout": layout, "world_size": Layout.parse(layout).world, "dim": dim, "seed": seed},
    )


def run_rounds(
    runner: Runner,
    jobs: Sequence[Job],
    variants: Sequence[Variant],
    dim: int,
    seed: int,
    reps: int,
    later_calls: int,
    paired: bool = False,
) -> list[Row]:
    """Per round and job: each variant takes the job's state on its saved layout into a fresh
    directory; then per restore layout, each variant restores it (variants interleaved); then
    the files are removed. Each round starts with the next variant, so that none always runs
    first, after the previous job's files were removed. Rows are labelled ``<job>/<layout>``."""
    rows: list[Row] = []
    for rnd in range(reps):
        variants = [*variants[1:], variants[0]] if rnd else variants
        for job in jobs:
            log(f"round {rnd + 1}/{reps}: {job.name}")
            saved: dict[str, str] = {}
            made: list[str] = []
            try:
                for v in variants:
                    path = runner.data_dir(f"parallel-{job.name}-{v.label}")
                    shutil.rmtree(path, ignore_errors=True)
                    made.append(path)
                    state = _state(job.saved, dim, seed)
                    job_args = {"op": "parallel-take", "method": v.writer, "state": state.args}
                    job_args["later_calls"] = later_calls
                    if paired and v.writer != "dcp":
                        job_args["paired_with"] = "dcp"
                    result = runner.job({**job_args, "path": path}, v.env)
                    state.label = f"{job.name}/take"
                    rows.append(make_row(NAME, state, rnd, v, "take", "fsync", v.writer, result))
                    if result.get("ok"):
                        saved[v.label] = path
                for layout in job.restores:
                    for v in variants:
                        state = _state(layout, dim, seed)
                        if v.label not in saved:
                            result = {"ok": False, "error": "its take failed"}
                        else:
                            job_args = {"op": "parallel-restore", "method": v.writer}
                            job_args["later_calls"] = later_calls
                            job_args |= {"state": state.args, "path": saved[v.label]}
                            result = runner.job(job_args, v.env)
                        state.label = f"{job.name}/{layout}"
                        rows.append(
                            make_row(NAME, state, rnd, v, "restore", "warm", v.writer, result)
                        )
            finally:
                for path in made:
                    shutil.rmtree(path, ignore_errors=True)
    return rows


def _per_rank(rows: Sequence[Row], key: str) -> list[float]:
    """Median over the rounds that worked of each rank's ``key``, rank 0 first."""
    by_rank: dict[int, list[float]] = {}
    for r in rows:
        for fig in r.extra.get("ranks", []):
            if r.ok and fig.get(key) is not None:
                by_rank.setdefault(fig["rank"], []).append(fig[key])
    return [statistics.median(by_rank[k]) for k in sorted(by_rank)]


def _later(row: Row, key: str = "later_seconds") -> float | None:
    """A take's or restore's later calls in the same process (``paired_seconds``: DCP's, paired
    with a take's): the median over calls of the slowest rank's seconds (None: none, or the
    call failed)."""
    ranks = [fig.get(key) or [] for fig in row.extra.get("ranks", [])]
    if not row.ok or not ranks or not all(ranks):
        return None
    return statistics.median(max(calls) for calls in zip(*ranks, strict=True))


def _secs(rows: Sequence[Row]) -> str:
    med = median(r.seconds for r in rows if r.ok and r.seconds)
    per = ", ".join(fmt_s(r.seconds) if r.ok and r.seconds else "✗" for r in rows)
    return f"{fmt_s(med)} ({per})" if rows else "—"


def job_tables(rows: Sequence[Row], job: Job, labels: Sequence[str]) -> list[str]:
    """One job: per take and restore, each variant's seconds, its ratio to DCP, its check;
    peak RSS per rank; each resharded restore ÷ the same-layout restore."""
    ours = [lb for lb in labels if lb != "dcp"]
    head = ["op", "layout", *[f"{lb} s" for lb in labels]]
    head += [f"{lb} ÷ dcp" for lb in ours if "dcp" in labels] + ["check"]
    out = [f"#### {job.name}: {job.title}", "", "| " + " | ".join(head) + " |"]
    out.append("|" + "---|" * len(head))
    ops = [("take", f"{job.name}/take", job.saved)]
    ops += [("restore", f"{job.name}/{lay}", lay) for lay in job.restores]
    for op, state, layout in ops:
        sel = {lb: [r for r in rows if r.state == state and r.label == lb] for lb in labels}
        cells = [op, f"`{layout}` {layout_title(layout)}"]
        cells += [_secs(sel[lb]) for lb in labels]
        if "dcp" in labels:
            cells += [fmt_ratio(round_ratios(sel[lb], sel["dcp"])) for lb in ours]
        checks = []
        for lb in labels:
            bad = [r for r in sel[lb] if not r.ok]
            text = status([r for r in sel[lb] if r.ok], op)
            if bad:  # the error itself is listed under the tables
                text = f"FAILED {len(bad)}/{len(sel[lb])}" + (f"; otherwise {text}" if text else "")
            checks.append(f"{lb}: {text}" if text else "")
        cells.append("; ".join(c for c in checks if c))
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "Later calls in the same process (imports and first-call costs paid; each take into "
        "a folder of its own, each restore into zeroed values, barrier to barrier): the median "
        "of the later calls in each round, median over rounds (each round in parentheses):",
        "",
        "| call | "
        + " | ".join(f"{lb} s" for lb in labels)
        + "".join(f" | {lb} ÷ dcp" for lb in ours if "dcp" in labels)
        + " |",
        "|---|" + "---|" * (len(labels) + (len(ours) if "dcp" in labels else 0)),
    ]
    for op, state, layout in ops:
        sel = {lb: [r for r in rows if r.state == state and r.label == lb] for lb in labels}
        cells = [f"{op} `{layout}`"]
        for lb in labels:
            per = [_later(r) for r in sel[lb]]
            got = [x for x in per if x is not None]
            rounds = ", ".join(fmt_s(x) if x else "✗" for x in per)
            cells.append(f"{fmt_s(statistics.median(got))} ({rounds})" if got else "—")
        if "dcp" in labels:
            ref = {r.round: _later(r) for r in sel["dcp"]}
            for lb in ours:
                ratios = [
                    x / ref[r.round] for r in sel[lb] if (x := _later(r)) and ref.get(r.round)
                ]
                cells.append(fmt_ratio(ratios))
        out.append("| " + " | ".join(cells) + " |")
    take = f"{job.name}/take"
    paired = [(lb, [r for r in rows if r.state == take and r.label == lb]) for lb in ours]
    paired = [(lb, sel) for lb, sel in paired if any(_later(r, "paired_seconds") for r in sel)]
    if paired:
        out += [
            "",
            "Later takes alternating with DCP's in the same processes (`--paired-takes`; the "
            "two take turns going first), the median of each round's calls, median over rounds "
            "(each round in parentheses), and the median of the per-round ratios:",
            "",
            "| take | its s | DCP's s, paired | ÷ DCP |",
            "|---|---|---|---|",
        ]
    for lb, sel in paired:
        pairs = [(_later(r), _later(r, "paired_seconds")) for r in sel]
        got = [(a, b) for a, b in pairs if a and b]
        cells = [f"{lb} `{job.saved}`"]
        for k in (0, 1):
            rounds = ", ".join(fmt_s(p[k]) for p in got)
            cells.append(f"{fmt_s(statistics.median(p[k] for p in got))} ({rounds})")
        cells.append(fmt_ratio([a / b for a, b in got]))
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "Peak RSS above the RSS right before the call, per rank (rank 0 first; medians over "
        "rounds); statesnap's memory budget for the call (`Options().budget()`, the default: "
        "a quarter of the memory available, within [64 MiB, 4 GiB]):",
        "",
        "| op | layout | method | peak RSS per rank | statesnap budget |",
        "|---|---|---|---|---|",
    ]
    for op, state, layout in ops:
        for lb in labels:
            sel = [r for r in rows if r.state == state and r.label == lb]
            peaks = _per_rank(sel, "peak_rss_above_baseline")
            budgets = _per_rank(sel, "budget_bytes")
            if not peaks:
                continue
            out.append(
                f"| {op} | `{layout}` | {lb} | {', '.join(mib(p) for p in peaks)} | "
                f"{fmt_size(min(budgets)) if budgets else '—'} |"
            )
    same = f"{job.name}/{job.restores[0]}"
    out += [
        "",
        f"Each restore ÷ the same-layout restore (`{job.restores[0]}`), per round (4 ranks on "
        "this machine's 2 cores are oversubscribed, so a restore on more ranks than the "
        "same-layout one is slower for that alone):",
        "",
        "| layout | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for layout in job.restores[1:]:
        state = f"{job.name}/{layout}"
        cells = [f"`{layout}`"]
        for lb in labels:
            mine = [r for r in rows if r.state == state and r.label == lb]
            ref = [r for r in rows if r.state == same and r.label == lb]
            cells.append(fmt_ratio(round_ratios(mine, ref)))
        out.append("| " + " | ".join(cells) + " |")
    return out


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    methods = args.methods or list(PARALLEL_METHODS)
    for m in methods:
        if m not in PARALLEL_METHODS:
            raise SystemExit(
                f"--case {NAME}: unknown method {m!r}; known: {', '.join(PARALLEL_METHODS)}"
            )
    names = args.jobs or list(JOBS)
    for n in names:
        if n not in JOBS:
            raise SystemExit(f"--case {NAME}: unknown job {n!r}; known: {', '.join(JOBS)}")
    jobs = [JOBS[n] for n in names]
    base = [
        Variant(m, m, [m], dict(args.statesnap_env) if m == "statesnap" else {}) for m in methods
    ]
    variants = with_libraries(base, args.libraries)
    rows = run_rounds(
        runner, jobs, variants, args.dim, args.seed, args.reps, args.later_calls, args.paired_takes
    )
    labels = [v.label for v in variants]
    out = [
        "",
        f"#### Parallel jobs: an MLP (width {args.dim}) with AdamW, "
        f"{fmt_size(model_bytes(args.dim))} of parameters and moments",
        "",
        "Each rank is a process of a gloo group on the CPU; the model is built on its layout "
        "(`init_device_mesh`, `parallelize_module`, `fully_shard`), AdamW's state made by one "
        "step, then every parameter and moment is set to its piece of a global tensor drawn "
        "from the seed (take) or zeroed (restore). Seconds: the slowest rank's, from a barrier "
        "before the call to a barrier after it, median (each round in parentheses); the call "
        "includes the Stateful's `get_state_dict` / `set_state_dict`. Ratios: median of the "
        "per-round ratios, below 1 means faster than DCP. Takes write fsync'd files (both "
        "methods' default); restores read warm files. Check: every parameter and moment's "
        "`full_tensor()` equal, bitwise, to the global tensor.",
    ]
    for job in jobs:
        out += ["", *job_tables(rows, job, labels)]
    out += ["", "Methods:", *(f"- {m.name}: {m.note}" for m in PARALLEL_METHODS.values())]
    failed = [r for r in rows if not r.ok]
    if failed:
        out += ["", "Errors (first of each):", ""]
        seen: set[tuple[str, str]] = set()
        for r in failed:
            if (r.state, r.label) in seen or r.error == "its take failed":
                continue
            seen.add((r.state, r.label))
            out.append(f"- {r.state} {r.label}: {r.error[:400]}")
    return rows, out
