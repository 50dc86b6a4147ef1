"""What a method is: a :class:`Writer` saves a generated state, a :class:`Reader` loads it back;
the harness times their calls (see :mod:`benchmarks.methods`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.common import (
    CheckResult,
    StateSpec,
    check_restored,
)

State = dict[str, dict[str, Any]]


def quiet() -> None:
    """DCP warns that it runs without a process group; torchsnapshot about TypedStorage."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def nothing() -> None:
    return None


@dataclass(frozen=True)
class Writer:
    """One way of saving a state.

    ``self_fsync``: in the "fsync'd" mode the method makes its own files durable; otherwise the
    harness fsyncs every file and directory it wrote, inside the timed region.
    """

    name: str
    objects: bool
    self_fsync: bool
    save: Callable[[StateSpec, State, str, bool], None]
    prepare: Callable[[], None] = nothing
    note: str = ""


@dataclass(frozen=True)
class Reader:
    """One way of loading what ``writer`` saved.

    ``into_targets``: loads into preallocated, already-touched tensors (the worker allocates
    them before the timed region); else the reader allocates what it returns.
    """

    name: str
    writer: str
    objects: bool
    into_targets: bool
    load: Callable[[StateSpec, str, State | None], Any]
    prepare: Callable[[], None] = nothing
    verify: Callable[[StateSpec, Any, bool], CheckResult] = check_restored
    note: str = ""
