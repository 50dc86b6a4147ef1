"""The harness the cases share (``benchmarks/cases/``).

Every measured operation runs in a fresh process (``benchmarks.worker``); methods are
interleaved in rounds (A B C ... A B C ...), and tables give medians over the rounds together
with each round's ratio to a reference method.

- :mod:`~benchmarks.harness.runner`: :class:`Runner` starts the workers (one per operation, one
  per rank for a process group) and never leaves one behind; :func:`merge_ranks`.
- :mod:`~benchmarks.harness.rows`: :class:`Variant` (a writer, its readers, their workers'
  environment), :class:`Library` and :func:`with_libraries` (the statesnap variants run from
  another tree of the library, ``--library NAME=PATH``), :class:`StateCase`, :class:`Row` (one
  measured operation) and :func:`run_rounds` (takes, then warm and cold restores, per round).
- :mod:`~benchmarks.harness.tables`: medians, per-round ratios and the markdown tables.
"""

from benchmarks.harness.rows import (
    CaseResult,
    Library,
    Row,
    StateCase,
    Variant,
    is_statesnap,
    log,
    make_row,
    run_rounds,
    variants_of,
    with_libraries,
)
from benchmarks.harness.runner import REPO, Runner, merge_ranks
from benchmarks.harness.tables import (
    MODE_TITLES,
    SHORT_TITLES,
    fmt_ratio,
    fmt_rounds,
    fmt_s,
    group,
    group_by,
    library_sections,
    library_table,
    loads_into,
    median,
    method_notes,
    mib,
    op_table,
    ratio_table,
    round_ratios,
    state_tables,
    status,
)

__all__ = [
    "MODE_TITLES",
    "REPO",
    "SHORT_TITLES",
    "CaseResult",
    "Library",
    "Row",
    "Runner",
    "StateCase",
    "Variant",
    "fmt_ratio",
    "fmt_rounds",
    "fmt_s",
    "group",
    "group_by",
    "is_statesnap",
    "library_sections",
    "library_table",
    "loads_into",
    "log",
    "make_row",
    "median",
    "merge_ranks",
    "method_notes",
    "mib",
    "op_table",
    "ratio_table",
    "round_ratios",
    "run_rounds",
    "state_tables",
    "status",
    "variants_of",
    "with_libraries",
]
