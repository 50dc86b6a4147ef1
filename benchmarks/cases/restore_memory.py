"""``--case restore-memory``: peak RSS above baseline of an in-place statesnap restore of the
``--size`` state (default 2 GiB) with ``STATESNAP_MEMORY_BUDGET_BYTES=--budget`` (default 64 MiB)
and with the default budget, against torch.load (with and without mmap) and raw reads."""

from __future__ import annotations

import argparse

from benchmarks.common import (
    GIB,
    MIB,
    build_spec,
    describe_spec,
    fmt_size,
    parse_size,
)
from benchmarks.harness import (
    CaseResult,
    Runner,
    StateCase,
    Variant,
    fmt_s,
    group_by,
    library_sections,
    median,
    run_rounds,
    state_tables,
    status,
    with_libraries,
)

NAME = "restore-memory"
DEFAULTS = {"modes": ["cache"], "temps": ["warm"]}
LIBRARY_VARIANTS = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--budget",
        type=parse_size,
        default=64 * MIB,
        help="restore-memory: STATESNAP_MEMORY_BUDGET_BYTES for the low-budget run",
    )


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    env = args.statesnap_env
    size = (args.size or [2 * GIB])[0]
    state = StateCase(fmt_size(size), {"kind": "model", "size": size, "seed": args.seed})
    budget = args.budget
    low = f"statesnap (budget {fmt_size(budget)})"
    variants = [
        Variant(
            low, "statesnap", ["statesnap"], {**env, "STATESNAP_MEMORY_BUDGET_BYTES": str(budget)}
        ),
        Variant("statesnap (default budget)", "statesnap", ["statesnap"], dict(env)),
        Variant("torch.save", "torch.save", ["torch.load", "torch.load mmap"]),
        Variant("raw", "raw", ["raw", "raw fresh"]),
    ]
    variants = with_libraries(variants, args.libraries)
    rows = run_rounds(runner, NAME, [state], variants, args.modes, args.temps, args.reps)
    head = [
        "method",
        "op",
        "peak RSS above baseline (median)",
        "per round",
        "baseline RSS",
        "median s",
        "check",
    ]
    out = [
        "",
        f"#### {describe_spec(build_spec(state.args))}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for (label, op, mode), sel in group_by(rows, lambda r: (r.label, r.op, r.mode)).items():
        ok = [r for r in sel if r.ok]
        rss = median(r.peak_rss for r in ok if r.peak_rss is not None)
        base = median(r.baseline_rss for r in ok if r.baseline_rss is not None)
        med = median(r.seconds for r in ok if r.seconds)
        out.append(
            "| "
            + " | ".join(
                [
                    label,
                    f"{op} {mode}",
                    fmt_size(rss) if rss is not None else "—",
                    ", ".join(
                        fmt_size(r.peak_rss) if r.ok and r.peak_rss is not None else "✗"
                        for r in sel
                    ),
                    fmt_size(base) if base is not None else "—",
                    fmt_s(med),
                    status(sel, op),
                ]
            )
            + " |"
        )
    out += [
        "",
        "Baseline RSS is the worker's RSS right before the operation: the generated "
        "state for a take, the preallocated targets (if any) for a restore.",
    ]
    out += library_sections(rows, [state.label], [lib.name for lib in args.libraries])
    out += state_tables(rows, state.label, args.modes, args.temps)
    return rows, out
