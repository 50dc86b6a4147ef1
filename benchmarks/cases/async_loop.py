"""``--case async-loop``: a small MLP trained on CPU (``benchmarks.train_loop``): steps/s
without snapshots, with a take and with an async_take every ``--interval`` steps."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from benchmarks.cases.async_stall import ASYNC_MODE_TITLES
from benchmarks.common import (
    fmt_size,
)
from benchmarks.harness import (
    CaseResult,
    Row,
    Runner,
    StateCase,
    fmt_ratio,
    fmt_rounds,
    fmt_s,
    group,
    log,
    median,
    status,
)
from benchmarks.harness.cli import int_list
from benchmarks.train_loop import METHODS as LOOP_METHODS
from benchmarks.train_loop import LoopConfig

NAME = "async-loop"
DEFAULTS = {"modes": ["fsync"], "temps": []}
LIBRARY_VARIANTS = False
LOOP_LABELS = {
    "none": "no snapshots",
    "take": "statesnap take",
    "async_take": "statesnap async_take",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=300, help="async-loop: timed training steps")
    parser.add_argument(
        "--interval", type=int, default=25, help="async-loop: steps between snapshots"
    )
    parser.add_argument("--batch", type=int, default=64, help="async-loop: batch size")
    parser.add_argument(
        "--dims",
        type=int_list,
        default=[512, 1536, 1536, 512],
        help="async-loop: MLP layer widths, e.g. 512,1536,1536,512",
    )


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    env = args.statesnap_env

    methods = args.methods or list(LOOP_METHODS)
    for m in methods:
        if m not in LOOP_METHODS:
            raise SystemExit(f"--case async-loop: unknown method {m!r}; known: {LOOP_METHODS}")
    rows: list[Row] = []
    for mode in args.modes:
        cfg = LoopConfig(
            steps=args.steps,
            interval=args.interval,
            batch=args.batch,
            dims=tuple(args.dims),
            seed=args.seed,
            fsync=mode == "fsync",
        )
        state = StateCase(f"loop {mode}", {"kind": "loop"})
        for rnd in range(args.reps):
            log(f"round {rnd + 1}/{args.reps} ({mode})")
            for m in methods:
                path = runner.data_dir(f"loop-{m}")
                shutil.rmtree(path, ignore_errors=True)
                os.makedirs(path)
                try:
                    result = runner.job(
                        {"op": "train", "method": m, "loop": asdict(cfg), "path": path}, env
                    )
                finally:
                    shutil.rmtree(path, ignore_errors=True)
                check = result.get("check") or {}
                row = Row(
                    case=NAME,
                    state=state.label,
                    round=rnd,
                    variant=LOOP_LABELS[m],
                    writer=m,
                    op="train",
                    mode=mode,
                    method=m,
                    ok=bool(result.get("ok")) and bool(check.get("ok", True)),
                    seconds=result.get("seconds"),
                    check=check.get("detail", ""),
                    error=result.get("error", ""),
                    extra={
                        k: result[k]
                        for k in (
                            "steps",
                            "steps_per_s",
                            "step_median",
                            "state_bytes",
                            "snapshots",
                            "traceback",
                        )
                        if k in result
                    },
                )
                log(
                    f"  [loop {mode} round {rnd + 1}] {LOOP_LABELS[m]}: "
                    + (
                        f"{result['steps_per_s']:.2f} steps/s, {len(result['snapshots'])} snapshots"
                        if row.ok
                        else f"FAILED {row.error}\n{result.get('traceback', '')}"
                    )
                )
                rows.append(row)
    out = [
        "",
        f"MLP {'-'.join(str(d) for d in args.dims)} (Linear + GELU), Adam, batch {args.batch}, "
        f"synthetic data, CPU; {args.steps} timed steps after 10 untimed; a snapshot before "
        f"every {args.interval}th step ({(args.steps - 1) // args.interval} per run).",
    ]
    for mode in args.modes:
        sel = [r for r in rows if r.mode == mode]
        out += ["", f"**{ASYNC_MODE_TITLES[mode].split(' (')[0].capitalize()}**", ""]
        out += loop_table(sel, args.interval)
    return rows, out


def loop_table(rows: Sequence[Row], interval: int) -> list[str]:
    """Steps per second of each loop, its ratio to the loop without snapshots (per round), and
    what the snapshots cost it."""
    groups = group(rows)
    ref = groups.get(LOOP_LABELS["none"], [])
    ref_rate = {r.round: r.extra["steps_per_s"] for r in ref if r.ok}
    ref_step = {r.round: r.extra["step_median"] for r in ref if r.ok}
    head = [
        "loop",
        "steps/s",
        "÷ no snapshots (per round)",
        "loop s",
        "median step ms",
        "median step ÷ no snapshots (per round)",
        "loop blocked by snapshots (calls + waits), % of loop time",
        "call blocks per snapshot s (median, max)",
        "blocked in wait per snapshot s (median, max)",
        "snapshot write time s (median)",
        "check",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    state_bytes = None
    for label, mine in groups.items():
        ok = [r for r in mine if r.ok]
        rate = {r.round: r.extra["steps_per_s"] for r in ok}
        step = {r.round: r.extra["step_median"] for r in ok}
        blocked = {
            r.round: 100
            * sum(s["call"] + s["blocked_in_wait"] for s in r.extra.get("snapshots", []))
            / r.seconds
            for r in ok
            if r.seconds
        }
        snaps = [s for r in ok for s in r.extra.get("snapshots", [])]
        state_bytes = state_bytes or next((r.extra.get("state_bytes") for r in ok), None)

        def med_max(key: str, snaps: list[dict[str, Any]] = snaps) -> str:
            vals = [s[key] for s in snaps if s.get(key) is not None]
            return f"{fmt_s(statistics.median(vals))}, {fmt_s(max(vals))}" if vals else "—"

        if mine[0].method == "take":
            write = [s["call"] for s in snaps]
        else:
            write = [s["seen_done"] for s in snaps if s.get("seen_done") is not None]
        out.append(
            "| "
            + " | ".join(
                [
                    label,
                    fmt_rounds(rate, lambda v: f"{v:.2f}"),
                    fmt_ratio([rate[k] / ref_rate[k] for k in sorted(rate) if k in ref_rate]),
                    fmt_s(median(r.seconds for r in ok if r.seconds)),
                    fmt_rounds(step, lambda v: f"{v * 1000:.1f}"),
                    fmt_ratio([step[k] / ref_step[k] for k in sorted(step) if k in ref_step]),
                    fmt_rounds(blocked, lambda v: f"{v:.1f}") if snaps else "—",
                    med_max("call"),
                    med_max("blocked_in_wait") if mine[0].method == "async_take" else "—",
                    fmt_s(statistics.median(write)) if write else "—",
                    status(mine, "train"),
                ]
            )
            + " |"
        )
    step = median(r.extra["step_median"] for r in ref if r.ok)
    if step is not None:
        out += [
            "",
            f"Compute per interval: {interval} steps x {step * 1000:.1f} ms (median step of the "
            f"loop without snapshots) = {interval * step:.2f} s. State: "
            f"{fmt_size(state_bytes or 0)} (model + Adam). Snapshot write time: the whole call "
            "for take; for async_take, from the call until `done()` was first seen true (polled "
            "after every step, so up to one step late).",
        ]
    return out
