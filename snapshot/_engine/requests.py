"""What the planners ask of the I/O: one blob to write (``WriteRequest``), one scatter read
(``ReadRequest`` of ``Segment``s). Both the planners and the I/O (``pipeline``: the write
pipeline and ``read_all``) import this module; neither imports the other."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from storage_plugins import Buffer


@dataclass(slots=True)
class WriteRequest:
    """One blob to write.

    ``stage`` runs on the caller's thread and returns the buffers to write (their concatenation
    is the blob, ``nbytes`` long) and an object to keep alive until the write is done (the tensor
    the buffers view, or a pooled buffer's lease, released when the write is done).
    ``staging_bytes`` is the memory ``stage`` allocates, held against the budget until the
    write completes: 0 for zero-copy views. The CRC-32 of each ``(offset, nbytes)`` range of
    ``checksum_ranges`` is computed by the plugin as it writes (``write_observed``), and kept
    in the pipeline's ``checksums`` under ``(blob, offset)``. (A request whose ``stage``
    checksums its bytes itself, as a slab's does, lists no ranges.)
    """

    blob: str
    nbytes: int
    staging_bytes: int
    stage: Callable[[], tuple[Sequence[Buffer], object]]
    label: str
    checksum_ranges: Sequence[tuple[int, int]] = ()


@dataclass(slots=True)
class Segment:
    """``nbytes`` consecutive bytes of a read, into ``dest()``. A plain segment is a gap between
    two wanted ranges, cheaper to read than to ask for separately: its ``dest`` is scratch that
    the bytes are dropped into (set once the reads are planned). When ``verify`` is set, it is
    given the CRC-32 of the bytes that landed (computed by the plugin as it reads:
    ``readv_observed``), before the read's ``done`` runs; it raises if they are not the bytes
    expected. ``owner``: the app_state key whose live state the bytes land in (a ``Need``'s),
    None for a gap."""

    nbytes: int
    dest: Callable[[], memoryview] | None
    verify: Callable[[int], None] | None = None
    owner: str | None = None


segment_bytes = attrgetter("nbytes")
segment_verify = attrgetter("verify")
segment_dest = attrgetter("dest")
segment_owner = attrgetter("owner")


@dataclass(slots=True)
class ReadRequest:
    """One scatter read: the bytes of ``blob`` from ``offset`` on, into ``segments`` in order.

    Each segment's ``dest`` is called on the I/O loop just before the read (so memory is
    allocated only when the budget allows); ``done`` runs after the bytes have landed.
    ``scratch_bytes`` is the memory the ``dest`` calls allocate that ``done`` frees (0 when
    reading straight into destination tensors).
    """

    blob: str
    offset: int
    segments: list[Segment]
    scratch_bytes: int
    done: Callable[[], None] | None
    label: str

    @property
    def nbytes(self) -> int:
        return sum(map(segment_bytes, self.segments))
