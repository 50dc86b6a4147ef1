"""Reads straight into the memory of the caller's tensors, kept as columns.

Most reads of a restore are one stored range read whole into a tensor the caller gave
(``dense.direct_address``): a state of 20,000 small tensors plans 20,000 of them. The loader
keeps each as a row of four columns (entry path, stored range, address, owner) rather than as a
``Need`` with its callbacks, and ``DirectReads.requests`` cuts the rows into ``DirectRequest``s
by C-level passes over the columns: an object per read request (a slab's thousands of members),
not per tensor. Making, merging and freeing an object per tensor cost a restore of 20,000 small
tensors about as much as the rest of its planning (benchmarks/results/2026-11-28-direct-reads.md).

Where a restore works need by need (the first pass of ``verify_first``, replicated reads shared
across ranks), the rows become needs first (``DirectReads.needs``), each the need
``reads.direct_need`` makes with a ``WholeCheck``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from itertools import accumulate, chain, compress, count, islice, pairwise, repeat
from operator import add, attrgetter, ge, gt, le, ne, sub

from manifest import Location
from snapshot._engine.format.serialization import WholeCheck
from snapshot._engine.io.pipeline import DirectRequest
from snapshot._engine.restore.reads import Need, direct_need, label_of

_blob = attrgetter("blob")
_offset = attrgetter("offset")
_nbytes = attrgetter("nbytes")
_crc32 = attrgetter("crc32")


class DirectReads:
    """Reads of whole stored ranges into targets' memory, as columns: row ``i`` reads
    ``chunks[i]`` (a ``Location``, with its CRC-32 when reads are checked) to
    ``addresses[i]``, for the entry at ``paths[i]``, into the live state of app_state key
    ``owners[i]`` (None: no key's). The loader appends to the columns directly while it plans
    (``Loader.add_subtree``), keeping them the same length."""

    __slots__ = ("addresses", "chunks", "owners", "paths")

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.chunks: list[Location] = []
        self.addresses: list[int] = []
        self.owners: list[str | None] = []

    def __len__(self) -> int:
        return len(self.paths)

    def add(self, path: str, chunk: Location, address: int, owner: str | None) -> None:
        self.paths.append(path)
        self.chunks.append(chunk)
        self.addresses.append(address)
        self.owners.append(owner)

    def needs(self, verify: bool) -> list[Need]:
        """The rows as needs (checked against their CRC-32s with ``verify``), in order; the
        columns are emptied."""
        return self._needs(range(len(self.paths)), verify, clear=True)

    def _needs(self, rows: range | list[int], verify: bool, clear: bool = False) -> list[Need]:
        out: list[Need] = []
        for i in rows:
            path, chunk = self.paths[i], self.chunks[i]
            need = direct_need(path, chunk, 0, chunk.nbytes, self.addresses[i])
            if verify:
                need.verify = WholeCheck(path, chunk)
            need.owner = self.owners[i]
            out.append(need)
        if clear:
            self._clear()
        return out

    def _clear(self) -> None:
        self.paths, self.chunks, self.addresses, self.owners = [], [], [], []

    def remove(self, rows: list[int]) -> None:
        """Drops ``rows`` (indices, ascending) from the columns."""
        gone = set(rows)
        keep = [i for i in range(len(self.paths)) if i not in gone]
        self.paths = _pick(self.paths, keep)
        self.chunks = _pick(self.chunks, keep)
        self.addresses = _pick(self.addresses, keep)
        self.owners = _pick(self.owners, keep)

    def requests(
        self, *, verify: bool, max_gap_bytes: int, max_request_bytes: int
    ) -> tuple[list[DirectRequest], list[Need]]:
        """The rows cut into scatter reads, and the rows left to ``reads.coalesce`` as needs.

        The rows of each blob are sorted by offset (they mostly are already: a slab's members
        are planned in the order they were written); a read ends where the next row starts more
        than ``max_gap_bytes`` after it or would take it past ``max_request_bytes``, and the
        gaps within a read are read into one scratch buffer, as large as the largest. A blob
        whose rows overlap (one stored range restored into two targets) goes to ``coalesce``,
        whose reads are each one sequential pass. Every pass over the rows is C-level: a
        bisection per read, not a step per row."""
        n = len(self.paths)
        if not n:
            return [], []
        chunks = self.chunks
        blobs = list(map(_blob, chunks))
        offsets = list(map(_offset, chunks))
        sizes = list(map(_nbytes, chunks))
        # The runs of consecutive rows of one blob, per blob.
        cuts = [0, *compress(count(1), map(ne, blobs[1:], blobs)), n]
        runs: dict[str, list[tuple[int, int]]] = {}
        for lo, hi in pairwise(cuts):
            runs.setdefault(blobs[lo], []).append((lo, hi))
        requests: list[DirectRequest] = []
        leftovers: list[Need] = []
        for blob, spans in runs.items():
            rows: range | list[int]
            if len(spans) == 1:
                rows = range(*spans[0])
            else:
                rows = list(chain.from_iterable(range(lo, hi) for lo, hi in spans))
            starts = _take(offsets, rows)
            if any(map(gt, starts, starts[1:])):
                order = sorted(range(len(starts)), key=starts.__getitem__)
                rows = _pick(list(rows), order)
                starts = _pick(offsets, rows)
            lengths = _take(sizes, rows)
            ends = list(map(add, starts, lengths))
            between = list(map(sub, starts[1:], ends))  # ``ends`` is one longer: map stops first
            if between and min(between) < 0:
                leftovers.extend(self._needs(rows, verify))
                continue
            group = _Group(self, rows, blob, starts, lengths, between, verify)
            # A read never spans a gap over the limit: the rows after one start a new read.
            big = map((1).__add__, compress(count(), map(gt, between, repeat(max_gap_bytes))))
            first = 0
            for stop in (*big, len(starts)):
                while first < stop:
                    # The rows that end within one request's reach of the first (at least
                    # one): ``ends`` ascends, the rows being sorted and apart.
                    reach = starts[first] + max_request_bytes
                    last = min(bisect_right(ends, reach, first + 1), stop)
                    requests.append(group.request(first, last))
                    first = last
        widest = max((max(req.gaps) for req in requests if req.gaps is not None), default=0)
        if widest:
            junk = memoryview(bytearray(widest))
            for req in requests:
                if req.gaps is not None:
                    req.junk = junk
        self._clear()
        return requests, leftovers


def _take(column: list, rows: range | list[int]) -> list:
    """``column``'s values at ``rows``: a slice for a run of rows."""
    if type(rows) is range:
        return column[rows.start : rows.stop]
    return _pick(column, rows)


def _pick(column: list, rows: list[int]) -> list:
    return list(map(column.__getitem__, rows))


class _Group:
    """The columns of one blob's rows, in offset order, that its reads are slices of."""

    __slots__ = (
        "addresses",
        "between",
        "blob",
        "chunks",
        "expected",
        "owners",
        "paths",
        "sizes",
        "starts",
    )

    def __init__(
        self,
        reads: DirectReads,
        rows: range | list[int],
        blob: str,
        starts: list[int],
        sizes: list[int],
        between: list[int],
        verify: bool,
    ) -> None:
        self.blob = blob
        self.starts = starts
        self.sizes = sizes
        self.between = between
        self.paths = _take(reads.paths, rows)
        self.chunks = _take(reads.chunks, rows)
        self.addresses = _take(reads.addresses, rows)
        self.owners = _take(reads.owners, rows)
        self.expected = list(map(_crc32, self.chunks)) if verify else None

    def request(self, first: int, last: int) -> DirectRequest:
        gaps = self.between[first : last - 1]
        owners = set(self.owners[first:last])
        owners.discard(None)
        paths = self.paths[first:last]
        return DirectRequest(
            blob=self.blob,
            offset=self.starts[first],
            addresses=self.addresses[first:last],
            sizes=self.sizes[first:last],
            gaps=gaps if any(gaps) else None,
            junk=None,
            expected=self.expected[first:last] if self.expected is not None else None,
            paths=paths,
            chunks=self.chunks[first:last],
            owners=tuple(owners),  # type: ignore[arg-type]
            label=label_of(paths),
        )


def clashes(starts: list[int], ends: list[int], source: Callable[[int], object]) -> list[list[int]]:
    """The groups of memory ranges ``[starts[i], ends[i])`` (the targets of reads) that overlap
    and would receive different bytes, each a list of indices in ascending order: the ranges
    of a group overlap one another, directly or through others of the group. Ranges that are
    the same memory and read the same stored bytes (``source(i)`` equal: tied weights restored
    from tied weights) write the same values, and are no clash.

    Overlaps are rare: that there is none is found by C-level passes over the ranges in
    address order (each ends where or before the next starts); only when one does not are the
    groups made, in Python.
    """
    n = len(starts)
    if n < 2:
        return []
    if all(map(le, starts, islice(starts, 1, None))):
        first, last = starts, ends
    else:
        bounds = dict(zip(starts, ends, strict=True))
        if len(bounds) == n:  # no two ranges start together
            first = sorted(bounds)
            last = list(map(bounds.__getitem__, first))
        else:
            first = last = []  # the groups below
    if first and all(map(le, last, islice(first, 1, None))):
        return []
    order = sorted(range(n), key=starts.__getitem__)
    first, last = _pick(starts, order), _pick(ends, order)
    reach = list(accumulate(last, max))  # the furthest end of the ranges so far
    # A group starts at each range that starts at or past every earlier range's end; only the
    # groups of two ranges or more are looked at.
    cuts = [0, *compress(count(1), map(ge, islice(first, 1, None), reach)), n]
    sizes = map(sub, islice(cuts, 1, None), cuts)
    out = []
    for i, j in compress(pairwise(cuts), map(gt, sizes, repeat(1))):
        group = order[i:j]
        if len({(starts[k], ends[k], source(k)) for k in group}) > 1:
            out.append(sorted(group))
    return out
