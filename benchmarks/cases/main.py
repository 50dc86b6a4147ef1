"""``--case main``: the generated model+optimizer state at each ``--size`` (default 512 MiB and
2 GiB), taken by every method to the page cache and fsync'd, then restored warm (files cached)
and cold (dropped from the cache) by each of its readers."""

from __future__ import annotations

import argparse

from benchmarks.common import GIB, MIB, build_spec, describe_spec, fmt_size
from benchmarks.harness import (
    CaseResult,
    Runner,
    StateCase,
    library_sections,
    method_notes,
    run_rounds,
    state_tables,
    variants_of,
    with_libraries,
)

NAME = "main"
DEFAULTS = {"modes": ["cache", "fsync"], "temps": ["warm", "cold"]}
LIBRARY_VARIANTS = True
DEFAULT_METHODS = [
    "raw",
    "raw-direct",
    "torch.save",
    "dcp",
    "safetensors",
    "torchsnapshot",
    "statesnap",
    "statesnap-buffered",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options of its own: ``--size``, ``--methods``, ``--modes``, ``--temps``."""


def run(args: argparse.Namespace, runner: Runner) -> CaseResult:
    env = args.statesnap_env
    sizes = args.size or [512 * MIB, 2 * GIB]
    states = [
        StateCase(fmt_size(s), {"kind": "model", "size": s, "seed": args.seed}) for s in sizes
    ]
    variants = with_libraries(variants_of(args.methods or DEFAULT_METHODS, env), args.libraries)
    rows = run_rounds(runner, NAME, states, variants, args.modes, args.temps, args.reps)
    out: list[str] = []
    names = [lib.name for lib in args.libraries]
    for s in states:
        out += ["", f"#### {describe_spec(build_spec(s.args))}"]
        out += library_sections(rows, [s.label], names)
        out += state_tables(rows, s.label, args.modes, args.temps)
    out += ["", method_notes(variants)]
    return rows, out
