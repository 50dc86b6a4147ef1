"""``--case checksums``: what checksums cost: the ``--size`` state (default 2 GiB) taken and
restored by statesnap with and without them (``STATESNAP_CHECKSUMS=0``), and by raw, in one
run."""

from __future__ import annotations

import argparse

from benchmarks.common import (
    GIB,
    build_spec,
    describe_spec,
    fmt_size,
)
from benchmarks.harness import (
    CaseResult,
    Runner,
    StateCase,
    Variant,
    library_sections,
    run_rounds,
    state_tables,
    with_libraries,
)

NO_CHECKSUMS = "statesnap (STATESNAP_CHECKSUMS=0)"

NAME = "checksums"
DEFAULTS = {"modes": ["cache", "fsync"], "temps": ["warm", "cold"]}
LIBRARY_VARIANTS = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options of its own."""


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    """What checksums cost: statesnap with and without them, on the same state, in one run."""
    env = args.statesnap_env
    size = (args.size or [2 * GIB])[0]
    state = StateCase(fmt_size(size), {"kind": "model", "size": size, "seed": args.seed})
    variants = [
        Variant("statesnap", "statesnap", ["statesnap"], dict(env)),
        Variant(NO_CHECKSUMS, "statesnap", ["statesnap"], {**env, "STATESNAP_CHECKSUMS": "0"}),
        Variant("raw", "raw", ["raw"]),
    ]
    variants = with_libraries(variants, args.libraries)
    rows = run_rounds(runner, NAME, [state], variants, args.modes, args.temps, args.reps)
    out = [
        "",
        f"#### {describe_spec(build_spec(state.args))}",
        "",
        f"The cost of checksums is the column `time ÷ {NO_CHECKSUMS}` of the statesnap row: "
        "computing a CRC-32 of every range as it is written (take), verifying every range "
        "as it is read (restore).",
    ]
    out += library_sections(rows, [state.label], [lib.name for lib in args.libraries])
    out += state_tables(rows, state.label, args.modes, args.temps, refs=(NO_CHECKSUMS, "raw"))
    return rows, out
