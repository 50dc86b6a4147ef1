"""``--case scaling``: states of ``--leaves`` leaves (default 10,000 and 100,000): take,
restore, and ``Snapshot(path)`` + ``get_manifest``; the ratio of the largest to the smallest
shows how each grows with the number of leaves."""

from __future__ import annotations

import argparse

from benchmarks.common import (
    build_spec,
    describe_spec,
)
from benchmarks.harness import (
    CaseResult,
    Runner,
    StateCase,
    library_sections,
    ratio_table,
    run_rounds,
    state_tables,
    variants_of,
    with_libraries,
)
from benchmarks.harness.cli import int_list

NAME = "scaling"
DEFAULTS = {"modes": ["cache"], "temps": ["warm"]}
LIBRARY_VARIANTS = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--leaves",
        type=int_list,
        default=[10_000, 100_000],
        help="scaling: leaf counts, e.g. 10000,100000",
    )


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    env = args.statesnap_env
    leaves = args.leaves
    states = [
        StateCase(f"{n:,} leaves", {"kind": "leaves", "leaves": n, "seed": args.seed})
        for n in leaves
    ]
    methods = args.methods or ["statesnap"]
    readers = {
        "statesnap": ["statesnap", "statesnap get_manifest"],
        "raw": ["raw"],
        "torch.save": ["torch.load"],
    }
    variants = with_libraries(variants_of(methods, env, readers), args.libraries)
    rows = run_rounds(runner, NAME, states, variants, args.modes, args.temps, args.reps)
    out: list[str] = []
    if len(states) >= 2:
        lo, hi = states[0].label, states[-1].label
        out += [
            "",
            f"**Ratio {hi} ÷ {lo}** ({leaves[-1] / leaves[0]:.0f}x the leaves; linear "
            f"scaling gives ~{leaves[-1] / leaves[0]:.0f}; per round in parentheses)",
            "",
        ]
        out += ratio_table(rows, hi, lo, f"{hi} ÷ {lo}")
    out += library_sections(rows, [s.label for s in states], [lib.name for lib in args.libraries])
    for s in states:
        out += ["", f"#### {describe_spec(build_spec(s.args))}"]
        out += state_tables(rows, s.label, args.modes, args.temps)
    return rows, out
