"""CRC-32 checksums of stored bytes: computed as blobs are written, verified as they are read.

Every location (a tensor chunk, a slab member, an object) carries the CRC-32 of its bytes in the
manifest. The CRCs are computed by the storage plugin's I/O threads, piece by piece, right after
each piece is written or read (``StoragePlugin.write_observed`` / ``readv_observed``), while
the bytes are likely still in the CPU's caches, where the CRC runs faster than memory delivers
bytes (the local plugin reads in 4 MiB pieces; it writes in 8 MiB ones through the page cache, as
smaller write calls cost more than they save, and in 4 MiB ones past it, from an aligned
buffer). A ``RangeDigest`` turns that stream of pieces into one running CRC per location. The
members of a slab being written are the exception: they are checksummed when the slab is
staged, on the caller's thread (``placement.Placer`` says why).
Reads may split one location over several requests (a large chunk read by several workers,
budget-sized tiles); ``LocationCheck`` combines their CRCs into the location's, in any order of
arrival.

CRC-32 (the gzip / zlib polynomial) comes from ISA-L through the ``isal`` package: folding with
carry-less multiplication, faster on cached bytes than xxh3 (``xxhash``) and the ``crc32c``
package (CRC-32C with the SSE4.2 instruction) were where they were compared; from main memory
all of them run at about memory speed, which is why the CRC is taken while the bytes are
cached. It releases the GIL for more than 5 KiB, and combines CRCs of pieces
(``crc32_combine``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import accumulate, compress
from operator import attrgetter

from isal import isal_zlib

from manifest import Location
from snapshot.errors import ChecksumError

# One thread at a time digests the pieces of a call in bulk (``RangeDigest.many``: a slab's
# members, thousands of CRCs of a few KiB, each dropping and retaking the GIL). The work is
# Python between short C calls, which the GIL serializes anyway; when several I/O threads did
# it at once they handed the GIL back and forth at every member, a context switch each. With
# this lock one thread digests a whole call while the others wait once, and the same work
# takes far fewer switches.
_MANY_LOCK = threading.Lock()

crc32 = isal_zlib.crc32
"""``crc32(data, value=0)``: the CRC-32 of ``data``; with ``value``, of the bytes whose CRC was
``value`` followed by ``data``."""

combine = isal_zlib.crc32_combine
"""``combine(crc_a, crc_b, nbytes_b)``: the CRC-32 of bytes A followed by bytes B."""


class RangeDigest:
    """The running CRC-32 of given ranges of a stream of bytes that arrives in pieces.

    ``ranges`` are ``(offset, nbytes)`` within the stream, ascending and not overlapping (the
    members of a slab, with padding between them; the wanted parts of a read, with gaps). Call
    the digest with each piece of the stream, in order; ``values`` then holds each range's CRC.

    ``segments``, when given, says how the stream was cut: ``(sizes, chosen)``, the lengths of
    its consecutive buffers and whether each is one of ``ranges`` (truthy: a read's segments'
    ``verify``; the ranges are then exactly the chosen buffers, in order). While the pieces
    are those buffers, ``many`` takes the chosen ones' CRCs by comparing the lengths, instead
    of finding each range among the pieces.
    """

    __slots__ = ("_chosen", "_next", "_pos", "_segment", "_sizes", "ranges", "values")

    def __init__(
        self,
        ranges: Sequence[tuple[int, int]],
        segments: tuple[list[int], Sequence[object]] | None = None,
    ) -> None:
        self.ranges = ranges
        self.values = [0] * len(ranges)
        self._pos = 0  # where the next piece starts in the stream
        self._next = 0  # the first range not yet complete
        self._sizes, self._chosen = segments if segments is not None else (None, None)
        self._segment = 0  # the buffer the next piece starts, while the pieces are the buffers

    def __call__(self, piece: memoryview) -> None:
        start = self._pos
        n = len(piece)
        end = start + n
        self._pos = end
        self._sizes = None  # a piece at a time: by the ranges from here on
        ranges, values = self.ranges, self.values
        i = self._next
        if i < len(ranges) and ranges[i] == (start, n):
            # The piece is exactly the next range (a slab member written from its own view):
            # the common case when a slab holds thousands of small tensors.
            values[i] = crc32(piece)
            self._next = i + 1
            return
        while i < len(ranges):
            offset, nbytes = ranges[i]
            if offset >= end and nbytes:
                break
            lo = max(offset, start)
            hi = min(offset + nbytes, end)
            if hi > lo:
                values[i] = crc32(piece[lo - start : hi - start], values[i])
            if offset + nbytes > end:
                break
            i += 1
        self._next = i

    def many(self, pieces: Sequence[memoryview]) -> None:
        """The same as calling the digest on each of ``pieces``, in order (the next pieces of
        the stream), in bulk where it can be: pieces that are the next buffers of
        ``segments`` by one comparison of lengths; else the ranges that are exactly some of
        these pieces (slab members, with padding pieces between them) from one C-level pass;
        what follows the last of them goes piece by piece."""
        if len(pieces) == 1:
            self(pieces[0])
            return
        with _MANY_LOCK:
            if not self._as_segments(pieces):
                self._many(pieces)

    def _as_segments(self, pieces: Sequence[memoryview]) -> bool:
        """Digests ``pieces`` if they are the next buffers of ``segments`` (a read of a slab's
        members into their targets, each a piece of one system call): the chosen ones' CRCs,
        in one pass. False, and ``segments`` no longer used, otherwise."""
        sizes, chosen = self._sizes, self._chosen
        if sizes is None or chosen is None:
            return False
        lens = list(map(len, pieces))
        first = self._segment
        last = first + len(lens)
        if lens != sizes[first:last]:
            self._sizes = None
            return False
        picked = list(compress(pieces, chosen[first:last]))
        i = self._next
        self.values[i : i + len(picked)] = map(crc32, picked)
        self._next = i + len(picked)
        self._segment = last
        self._pos += sum(lens)
        return True

    def _many(self, pieces: Sequence[memoryview]) -> None:
        self._sizes = None
        i, start = self._next, self._pos
        lens = list(map(len, pieces))
        starts = list(accumulate(lens, initial=start))
        # Which piece is each of the next ranges, while they are whole pieces.
        index = dict(zip(zip(starts, lens, strict=False), range(len(pieces)), strict=True))
        hits = list(map(index.get, self.ranges[i : i + len(pieces)]))
        matched = hits.index(None) if None in hits else len(hits)
        if matched:
            hits = hits[:matched]
            self.values[i : i + matched] = map(crc32, map(pieces.__getitem__, hits))
            self._next = i + matched
            last = hits[-1] + 1
            self._pos = starts[last]
            pieces = pieces[last:]
        for piece in pieces:
            self(piece)


def _mismatch(label: str, loc: Location, got: int) -> ChecksumError:
    return ChecksumError(
        f"{label}: checksum mismatch in blob {loc.blob}, bytes "
        f"[{loc.offset}, {loc.offset + loc.nbytes}): the manifest records crc32 "
        f"{loc.crc32:#010x}, the bytes read have {got:#010x}; the blob is damaged"
    )


class LocationCheck:
    """Verifies one location's bytes as its pieces arrive, in any order.

    ``add`` takes each piece's offset (within the location), length and CRC; once the pieces
    cover the location, their combined CRC must be the one the manifest records, or
    ``ChecksumError`` names ``label`` (the logical path) and the blob.
    """

    __slots__ = ("_got", "_pieces", "label", "location")

    def __init__(self, label: str, location: Location, pieces: int) -> None:
        self.label = label
        self.location = location
        self._pieces = pieces
        self._got: list[tuple[int, int, int]] = []

    def add(self, offset: int, nbytes: int, value: int) -> None:
        self._got.append((offset, nbytes, value))
        if len(self._got) < self._pieces:
            return
        self._got.sort()
        total = 0
        for _, n, v in self._got:
            total = combine(total, v, n)  # the CRC of nothing is 0
        if total != self.location.crc32:
            raise _mismatch(self.label, self.location, total)


class WholeCheck:
    """Verifies a location read in one piece: called with that piece's CRC, which must be the
    recorded one. The same check as a ``LocationCheck`` of one piece, at a fraction of its
    cost (a restore of many small tensors makes one per tensor)."""

    __slots__ = ("label", "location")

    def __init__(self, label: str, location: Location) -> None:
        self.label = label
        self.location = location

    def __call__(self, value: int) -> None:
        if value != self.location.crc32:
            raise _mismatch(self.label, self.location, value)


whole_crc = attrgetter("location.crc32")
"""The CRC-32 a ``WholeCheck`` expects."""
