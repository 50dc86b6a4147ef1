"""``--case many-small``: ``--count`` tensors (default 20,000) totalling ``--size`` (default
200 MiB) against one tensor of the same bytes; the ratio many ÷ single per method and op shows
what each method pays per tensor."""

from __future__ import annotations

import argparse

from benchmarks.common import MIB, build_spec, describe_spec
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

NAME = "many-small"
DEFAULTS = {"modes": ["cache", "fsync"], "temps": ["warm", "cold"]}
LIBRARY_VARIANTS = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--count", type=int, default=20_000, help="many-small: number of tensors")


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    env = args.statesnap_env
    total = (args.size or [200 * MIB])[0]
    many = StateCase(
        "many", {"kind": "tensors", "size": total, "count": args.count, "seed": args.seed}
    )
    single = StateCase("single", {"kind": "tensors", "size": total, "count": 1, "seed": args.seed})
    methods = args.methods or ["raw", "torch.save", "statesnap"]
    variants = with_libraries(
        variants_of(
            methods,
            env,
            {
                "raw": ["raw", "raw 4 readers", "raw 16 readers", "raw 4 readers 1MiB"],
                "torch.save": ["torch.load"],
            },
        ),
        args.libraries,
    )
    rows = run_rounds(runner, NAME, [many, single], variants, args.modes, args.temps, args.reps)
    out = [
        "",
        f"many = {describe_spec(build_spec(many.args))}; "
        f"single = {describe_spec(build_spec(single.args))}",
        "",
        "**Ratio many / single (time of the many-tensor state ÷ time of the single tensor; "
        "per round in parentheses)**",
        "",
    ]
    out += ratio_table(rows, "many", "single", "many ÷ single")
    out += library_sections(rows, ["many", "single"], [lib.name for lib in args.libraries])
    for s in (many, single):
        out += ["", f"#### {s.label}: {describe_spec(build_spec(s.args))}"]
        out += state_tables(rows, s.label, args.modes, args.temps)
    return rows, out
