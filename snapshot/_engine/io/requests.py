"""What the planners ask of the I/O: one blob to write (``WriteRequest``), one scatter read
(``ReadRequest`` of ``Segment``s, or ``DirectRequest``: straight into tensors' memory, kept as
columns). Both the planners and the I/O (``pipeline``: the write pipeline and ``read_all``)
import this module; neither imports the other."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, compress
from operator import attrgetter
from operator import call as call_it
from typing import Any

from snapshot._engine.format.serialization import raw_memoryviews
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

    def destinations(self) -> list[memoryview]:
        """Where the bytes land, one buffer per segment: each ``dest()``, in order (a slab's
        read has thousands: one C-level pass)."""
        return list(map(call_it, map(segment_dest, self.segments)))


@dataclass(slots=True)
class DirectRequest:
    """One scatter read of ``blob`` from ``offset`` on, straight into the memory of tensors:
    the ``sizes[i]`` bytes of member ``i`` land at ``addresses[i]`` (the caller keeps that
    memory alive), with ``gaps[i]`` bytes skipped after it (dropped into ``junk``; ``gaps`` is
    None where the members follow one another). What a ``ReadRequest`` of needs from
    ``reads.direct_need`` does, for a slab's thousands of small tensors, without an object per
    member: the columns are slices of ``direct_reads.DirectReads``.

    ``expected``: each member's recorded CRC-32, which the bytes that land must have (None:
    not checked); ``paths`` and ``chunks``: each member's entry path and stored range (for an
    error). ``owners``: the app_state keys whose live state the members are; ``starting``, set
    by ``RestoreProgress.watch``, runs just before the read.
    """

    blob: str
    offset: int
    addresses: list[int]
    sizes: list[int]
    gaps: list[int] | None
    junk: memoryview | None
    expected: list[int] | None
    paths: list[str]
    chunks: list[Any]
    owners: tuple[str, ...]
    label: str
    starting: Callable[[], None] | None = None
    scratch_bytes: int = 0
    done: Callable[[], None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.sizes) + (sum(self.gaps) if self.gaps is not None else 0)

    def destinations(self) -> list[memoryview]:
        """Views of the members' memory, with a piece of ``junk`` for each gap between them;
        runs ``starting`` first."""
        if self.starting is not None:
            self.starting()
        views = raw_memoryviews(self.addresses, self.sizes)
        if self.gaps is None:
            return views
        junk = self.junk
        assert junk is not None
        skipped = [junk[:n] if n else None for n in self.gaps]
        skipped.append(None)
        return list(filter(None, chain.from_iterable(zip(views, skipped, strict=True))))

    def layout(self) -> tuple[list[int], list[bool]]:
        """The lengths of the buffers ``destinations`` gives, and whether each is a member (not
        a gap): how a digest finds the members' bytes among them."""
        if self.gaps is None:
            return self.sizes, [True] * len(self.sizes)
        # Member, gap, member, ... (members are never empty; a gap of 0 is no buffer).
        both = list(chain.from_iterable(zip(self.sizes, [*self.gaps, 0], strict=True)))
        return list(compress(both, both)), list(compress([True, False] * len(self.sizes), both))


AnyReadRequest = ReadRequest | DirectRequest
"""Either kind of read request: both have ``blob``, ``offset``, ``nbytes``, ``scratch_bytes``,
``done``, ``label`` and ``destinations()``."""
