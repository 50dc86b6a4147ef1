"""CRC-32 checksums of stored bytes: computed as blobs are written, verified as they are read.

Every location (a tensor chunk, a slab member, an object) carries the CRC-32 of its bytes in the
manifest. The CRCs are computed by the storage plugin's I/O threads, piece by piece, right after
each piece is written or read (``StoragePlugin.write_observed`` / ``readv_observed``), while
the bytes are likely still in the CPU's caches, where the CRC runs faster than memory delivers
bytes (the local plugin reads in 4 MiB pieces, and writes in 4 MiB ones from an aligned buffer
of its own). A write's CRC is always of the copy the bytes are written from (the plugin's
buffer, the body sent), never of the application's memory, which another thread may change
during the take. A ``RangeDigest`` turns that stream of pieces into one running CRC per
location. The members of a slab being written are the exception: they are checksummed when the
slab is staged, on the caller's thread, from the slab's copy that is written
(``plan.Placer`` says why).
Reads may split one location over several requests (a large chunk read by several workers,
budget-sized tiles); ``LocationCheck`` combines their CRCs into the location's, in any order of
arrival.

CRC-32 (the gzip / zlib polynomial) comes from ISA-L through the ``isal`` package: folding with
carry-less multiplication, faster on cached bytes than xxh3 (``xxhash``) and the ``crc32c``
package (CRC-32C with the SSE4.2 instruction) were where they were compared; from main memory
all of them run at about memory speed, which is why the CRC is taken while the bytes are
cached. It combines CRCs of pieces (``crc32_combine``), and gives up the GIL while it checksums
more than 5 KiB: ``crc32_held`` and ``crc32_each`` keep it for buffers up to 64 KiB while
another thread keeps the GIL busy (see there).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from itertools import accumulate, compress, repeat
from operator import attrgetter, getitem
from time import perf_counter

from isal import isal_zlib

from manifest import Location
from snapshot.errors import ChecksumError

crc32 = isal_zlib.crc32
"""``crc32(data, value=0)``: the CRC-32 of ``data``; with ``value``, of the bytes whose CRC was
``value`` followed by ``data``."""

combine = isal_zlib.crc32_combine
"""``combine(crc_a, crc_b, nbytes_b)``: the CRC-32 of bytes A followed by bytes B."""

# ``crc32`` keeps the GIL for at most this many bytes; above, it gives the GIL up for the
# computation and must take it back after. Taking it back is what costs: while another thread
# runs Python (a training loop beside an async take, any busy thread of the application),
# the interpreter hands it back only at that thread's next switch, and a thread that gives
# the GIL up at every small buffer (a slab's members: thousands of CRCs of a few KiB) waits
# for such a switch each time (``benchmarks/busy_thread.py``).
HELD_BYTES = 5 << 10
# Buffers up to this size can be checksummed in pieces of ``HELD_BYTES``, the GIL held
# throughout; a larger one is computed with the GIL given up once, a wait that its own time
# makes small.
HOLD_MAX_BYTES = 64 << 10
# The pieces cost each buffer a slice and a call per piece, more than the CRC of its bytes
# alone, so they are used only while a wait was seen, and then for ``_HOLD_FOR_S``: a CRC
# that took longer than ``_WAITED`` of the switch interval waited for a thread that kept the
# GIL until the interpreter made it switch (cached bytes are checksummed at several GB/s: a
# few microseconds per buffer). In a run of ``_RUN`` CRCs, the waits behind the library's own
# threads add up too: a restore's readers, several threads on two cores, each give the GIL
# back within microseconds, yet one run in some forty took 4-22 ms. Beside a busy thread about
# half the runs wait several intervals. So two runs in a row must each take over
# ``_RUN_WAITED`` intervals: with one run over ``_WAITED`` interval as the sign, a quiet restore
# of 20,000 small tensors held the GIL through most CRCs of its reads and took some 40 ms
# longer (benchmarks/results/2026-11-28-direct-reads.md).
_RUN = 32
_WAITED = 0.8
_RUN_WAITED = 1.6
_HOLD_FOR_S = 1.0
_held_until = 0.0  # ``perf_counter()`` time until which small buffers keep the GIL
# ``crc32_each`` cuts every buffer at the same offsets, one C-level pass per cut, while the
# longest needs at most this many pieces (more passes would mostly slice short buffers).
_EACH_MAX_PIECES = 4


def _saw_wait(start: float) -> None:
    """Turns the pieces on when the CRCs begun at ``start`` took long enough to have waited
    for the GIL."""
    global _held_until
    now = perf_counter()
    if now - start > _WAITED * sys.getswitchinterval():
        _held_until = now + _HOLD_FOR_S


def crc32_held(data: memoryview, value: int = 0) -> int:
    """``crc32(data, value)``; for a byte view of at most ``HOLD_MAX_BYTES`` while the GIL is
    contended, without giving it up (other data goes to ``crc32`` as it is)."""
    n = len(data)
    if n <= HELD_BYTES or n > HOLD_MAX_BYTES or type(data) is not memoryview or data.itemsize != 1:
        return crc32(data, value)
    start = perf_counter()
    if start >= _held_until:
        value = crc32(data, value)
        _saw_wait(start)
        return value
    for lo in range(0, n, HELD_BYTES):
        value = crc32(data[lo : lo + HELD_BYTES], value)
    return value


def crc32_each(views: Sequence[memoryview]) -> list[int]:
    """The CRC-32 of each of ``views`` (byte views, such as a slab's members); for those of at
    most ``HOLD_MAX_BYTES`` while the GIL is contended, without giving it up: in runs of
    ``_RUN`` views, each run checksummed in one C-level pass, or, once two runs in a row have
    waited (``_run_waited``), one pass per piece offset where every view fits in a few pieces
    of ``HELD_BYTES`` (a slice past a view's end is empty and leaves its CRC as it is), else
    view by view (``crc32_held``)."""
    if not views:
        return []
    longest = max(map(len, views))
    if longest <= HELD_BYTES or longest > HOLD_MAX_BYTES:
        return list(map(crc32, views))
    values: list[int] = []
    waited = False
    for at in range(0, len(views), _RUN):
        run = views[at : at + _RUN]
        start = perf_counter()
        if start >= _held_until:
            values += map(crc32, run)
            waited = _run_waited(start, waited)
        else:
            values += _held_passes(run, longest)
    return values


def _run_waited(start: float, before: bool) -> bool:
    """Whether the run of CRCs begun at ``start`` waited for the GIL (took over
    ``_RUN_WAITED`` switch intervals); after a run that did (``before``), turns the pieces
    on."""
    global _held_until
    now = perf_counter()
    waited = now - start > _RUN_WAITED * sys.getswitchinterval()
    if waited and before:
        _held_until = now + _HOLD_FOR_S
    return waited


def _held_passes(views: Sequence[memoryview], longest: int) -> list[int]:
    if longest > _EACH_MAX_PIECES * HELD_BYTES:
        return list(map(crc32_held, views))
    values = list(map(crc32, map(getitem, views, repeat(slice(0, HELD_BYTES)))))
    for lo in range(HELD_BYTES, longest, HELD_BYTES):
        cut = slice(lo, lo + HELD_BYTES)
        values = list(map(crc32, map(getitem, views, repeat(cut)), values))
    return values


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
            values[i] = crc32_held(piece)
            self._next = i + 1
            return
        while i < len(ranges):
            offset, nbytes = ranges[i]
            if offset >= end and nbytes:
                break
            lo = max(offset, start)
            hi = min(offset + nbytes, end)
            if hi > lo:
                values[i] = crc32_held(piece[lo - start : hi - start], values[i])
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
        self.values[i : i + len(picked)] = crc32_each(picked)
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
            self.values[i : i + matched] = crc32_each(list(map(pieces.__getitem__, hits)))
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
