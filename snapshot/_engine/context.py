"""What surrounds an operation: errors that name the snapshot they were met in, and the
garbage collector paused while a phase builds many small objects."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

from snapshot._engine.format.text import printable_message
from snapshot.errors import RankFailedError, SnapshotError


@contextlib.contextmanager
def naming_snapshot(where: str) -> Iterator[None]:
    """Errors about an entry (which name its logical path) also name the snapshot they were
    met in."""
    try:
        yield
    except SnapshotError as e:
        if isinstance(e, RankFailedError):
            raise
        text = str(e)
        named = text if where in text else f"snapshot {where}: {text}"
        # The logical paths and names in the message come from the manifest: escaped, so that
        # a traceback or a log line shows a hostile key's control characters instead of
        # obeying them.
        shown = printable_message(named)
        if shown == text:
            raise
        raise type(e)(shown) from e.__cause__


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = False


class gc_paused:  # used as a function: ``with gc_paused():``
    """Pauses the cyclic garbage collector while a phase builds many small acyclic objects.

    Planning or decoding 100,000 entries allocates several objects per entry; each allocation
    burst triggers full collections that walk every object of the process (the model's included)
    and cost more than the work itself. Reference counting still frees everything at once; the
    collector resumes, with its previous setting, when the last overlapping phase (any thread)
    ends.

    The first allocation after the collector resumes runs a collection over every object made
    during the pause that is still alive. A class rather than a generator: leaving it makes no
    object (a generator's exit raises ``StopIteration``), so the operation that paused it
    returns first, and what it alone held (a manifest decoded for one restore) is freed before
    that collection could walk it.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        global _gc_depth, _gc_was_enabled
        with _gc_lock:
            if _gc_depth == 0:
                _gc_was_enabled = gc.isenabled()
                gc.disable()
            _gc_depth += 1

    def __exit__(self, *exc: object) -> None:
        global _gc_depth
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()
