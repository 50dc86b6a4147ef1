"""The geometry of sharded tensors, pure arithmetic over boxes (``Region``: offsets and sizes
per axis): whether boxes cover a tensor exactly once (``cover_problem``, ``find_overlap``), the
runs of consecutive elements two boxes share (``runs``), and how to read a wanted region from the
stored shards (``plan_region``)."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from manifest import Location, Shard, ShardedTensorEntry

Region = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) per global axis


# ---------------------------------------------------------------------------------------------
# Covering a tensor exactly once.


# ``cover_problem`` counts a box's 2**k corners along the k split axes: shardings split one
# axis or two, a DTensor one per mesh dimension. Past this many, a tensor of at most
# ``_MAX_PAIRWISE`` boxes is checked pair by pair; more boxes are refused.
_MAX_SPLIT_AXES = 6
_MAX_PAIRWISE = 1 << _MAX_SPLIT_AXES


def cover_problem(shape: Sequence[int], boxes: Sequence[Region]) -> str | None:
    """None when ``boxes`` (offsets, sizes) cover the box ``[0, shape)`` exactly once; else
    what is wrong, in words. In time linear in the number of boxes: each box is a sum of
    signed points at its corners (+1 at its low corner, the sign flipping with each axis on
    which a corner takes the high end), and the boxes hold every element exactly once if and
    only if their signed corners add up to the tensor's own. Empty boxes, and the axes every
    box spans whole, are left out.
    """
    ndim = len(shape)
    total = math.prod(shape)
    solid: list[Region] = []
    volume = 0
    for offsets, sizes in boxes:
        if (
            len(offsets) != ndim
            or len(sizes) != ndim
            or any(
                o < 0 or n < 0 or o + n > g for o, n, g in zip(offsets, sizes, shape, strict=True)
            )
        ):
            return f"a box at {list(offsets)} of size {list(sizes)} is not within {list(shape)}"
        count = math.prod(sizes)
        if count:
            solid.append((offsets, sizes))
            volume += count
    if volume != total:
        return f"the boxes hold {volume} elements, and it has {total}"
    if not total:
        return None  # a tensor without elements: any boxes within it hold each of them once
    axes = [d for d in range(ndim) if any(o[d] != 0 or n[d] != shape[d] for o, n in solid)]
    if len(axes) <= _MAX_SPLIT_AXES:  # by their signed corners along ``axes``
        weights: dict[tuple[int, ...], int] = {}
        signed = [(1, [(o[d], o[d] + n[d]) for d in axes]) for o, n in solid]
        for sign, bounds in [*signed, (-1, [(0, shape[d]) for d in axes])]:
            for picks in itertools.product((0, 1), repeat=len(axes)):  # 0: low end, 1: high
                corner = tuple(b[i] for b, i in zip(bounds, picks, strict=True))
                weights[corner] = weights.get(corner, 0) + (-sign if sum(picks) % 2 else sign)
        return (
            "some elements are in two boxes, and as many in none" if any(weights.values()) else None
        )
    if len(solid) <= _MAX_PAIRWISE:  # within find_overlap's budget: it never gives up
        return None if find_overlap(solid) is None else "two of the boxes overlap"
    return (
        f"it is split along {len(axes)} axes into {len(solid)} boxes; this library checks "
        f"tensors split along at most {_MAX_SPLIT_AXES} axes, or into at most "
        f"{_MAX_PAIRWISE} boxes"
    )


def find_overlap(boxes: Sequence[Region]) -> tuple[int, int] | None:
    """The indices of two boxes that share an element, or None: a sweep along the first axis,
    comparing each box with those still open where it starts; it gives up (None) after
    ``_MAX_PAIRWISE`` comparisons per box."""
    if len(boxes) < 2:
        return None
    if not boxes[0][0]:  # 0-d: every box is the one element
        return (0, 1)
    budget = _MAX_PAIRWISE * len(boxes)
    ends: list[tuple[int, int]] = []  # (where a box ends on the first axis, its index)
    active: dict[int, None] = {}  # the boxes open at the sweep's position, in order
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i][0][0]):
        (offsets, sizes) = boxes[i]
        while ends and ends[0][0] <= offsets[0]:
            del active[heapq.heappop(ends)[1]]
        for j in active:
            budget -= 1
            if budget < 0:
                return None
            if _overlap(boxes[i], boxes[j]) is not None:
                return (min(i, j), max(i, j))
        if math.prod(sizes):
            active[i] = None
            heapq.heappush(ends, (offsets[0] + sizes[0], i))
    return None


def _overlap(a: Region, b: Region) -> Region | None:
    """The box two boxes share, or None."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


# ---------------------------------------------------------------------------------------------
# Reading a region.


def _strides(sizes: Sequence[int]) -> tuple[int, ...]:
    out = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        out[d] = out[d + 1] * sizes[d + 1]
    return tuple(out)


def _run(stored: Region, wanted: Region, n: Sequence[int]) -> tuple[int, int]:
    """``(d, count)`` for an overlap of sizes ``n`` (at least one axis): its runs are of
    ``count`` elements, one per index of the axes before ``d``. A run is the innermost axis,
    and the ones outside it while the overlap spans them whole in both boxes."""
    d = len(n) - 1
    count = n[d]
    while d > 0 and n[d] == stored[1][d] == wanted[1][d]:
        d -= 1
        count *= n[d]
    return d, count


def runs(stored: Region, wanted: Region) -> Iterator[tuple[int, int, int]]:
    """``(source, dest, count)`` in elements, for each run of consecutive elements the overlap
    of the ``stored`` box and the ``wanted`` box makes: ``source`` counts from the start of the
    stored box, ``dest`` from the start of the wanted box, both in row-major order. Trailing
    axes that the overlap spans whole in both boxes merge into longer runs."""
    box = _overlap(stored, wanted)
    if box is None:
        return
    (so, ss), (wo, ws) = stored, wanted
    lo, n = box
    ndim = len(n)
    if ndim == 0:
        yield 0, 0, 1
        return
    s_str, w_str = _strides(ss), _strides(ws)
    d, count = _run(stored, wanted, n)
    base_s = sum((lo[k] - so[k]) * s_str[k] for k in range(ndim))
    base_w = sum((lo[k] - wo[k]) * w_str[k] for k in range(ndim))
    for index in itertools.product(*(range(n[k]) for k in range(d))):
        s = base_s + sum(i * s_str[k] for k, i in enumerate(index))
        w = base_w + sum(i * w_str[k] for k, i in enumerate(index))
        yield s, w, count


@dataclass
class Piece:
    """``nbytes`` bytes at ``offset`` of ``chunk``'s blob, landing at byte ``dest`` of the
    destination; ``lo`` is the offset within the chunk."""

    chunk: Location
    lo: int
    nbytes: int
    dest: int


def _cut(
    shard: Shard, first: int, count: int, dest: int, itemsize: int, piece_bytes: int
) -> Iterator[Piece]:
    """Elements ``first`` to ``first + count`` of a stored shard as pieces: cut where its
    chunks end, and into at most ``piece_bytes``; the first lands at element ``dest``."""
    start, stop, dest = first * itemsize, (first + count) * itemsize, dest * itemsize
    step = max(itemsize, piece_bytes - piece_bytes % itemsize)
    end = 0
    for chunk in shard.chunks:
        begin, end = end, end + chunk.nbytes
        if end <= start or begin >= stop:
            continue
        a, b = max(start, begin), min(stop, end)
        for cut in range(a, b, step):
            m = min(step, b - cut)
            yield Piece(chunk, cut - begin, m, dest + (cut - start))


@dataclass
class Box:
    """An overlap made of many short runs with short gaps between them, read whole (gaps
    included) into a scratch buffer: ``pieces`` land there (``Piece.dest`` counts from its
    start), then one strided copy moves the box into the region's tensor at ``at`` (offsets
    within the region), reading the scratch with the stored shard's ``strides``."""

    sizes: tuple[int, ...]
    at: tuple[int, ...]
    strides: tuple[int, ...]
    span: int  # elements in the scratch buffer
    pieces: list[Piece]


def plan_region(
    entry: ShardedTensorEntry,
    region: Region,
    itemsize: int,
    piece_bytes: int,
    gap_bytes: int,
    box_bytes: int,
) -> tuple[list[Piece], list[Box]]:
    """How to read ``region``: pieces that land straight in the region's tensor, and boxes.
    An overlap whose runs are separated by gaps of at most ``gap_bytes`` on average (a column
    block of a row-sharded tensor) is read as boxes of about ``box_bytes`` through a scratch
    buffer; others run by run, only the bytes wanted."""
    direct: list[Piece] = []
    boxes: list[Box] = []
    for shard in entry.shards:
        stored = (shard.offsets, shard.sizes)
        box = _overlap(stored, region)
        if box is None:
            continue
        gap = _gap(stored, region, box[1])
        if gap is not None and gap * itemsize <= gap_bytes:
            boxes.extend(_boxes(shard, box, region, itemsize, piece_bytes, box_bytes))
        else:
            for src, dst, count in runs(stored, region):
                direct.extend(_cut(shard, src, count, dst, itemsize, piece_bytes))
    return direct, boxes


def _gap(stored: Region, wanted: Region, n: Sequence[int]) -> float | None:
    """The average gap between the runs of an overlap of sizes ``n`` in the stored bytes, in
    elements, as ``runs`` cuts it; None when it is one run."""
    if len(n) < 2:
        return None
    d, count = _run(stored, wanted, n)
    nruns = math.prod(n[:d])
    if nruns <= 1:
        return None
    return (_span(n, _strides(stored[1])) - nruns * count) / (nruns - 1)


def _span(sizes: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from a box's first to its last, stored row-major with ``strides``."""
    return sum((m - 1) * st for m, st in zip(sizes, strides, strict=True)) + 1


def _boxes(
    shard: Shard, box: Region, region: Region, itemsize: int, piece_bytes: int, box_bytes: int
) -> Iterator[Box]:
    """The overlap ``box`` of ``shard``, cut along its first axis into boxes whose span (in the
    stored bytes) is at most about ``box_bytes``."""
    (lo, n), ro = box, region[0]
    strides = _strides(shard.sizes)
    origin = sum((a - b) * st for a, b, st in zip(lo, shard.offsets, strides, strict=True))
    rows = max(1, box_bytes // (strides[0] * itemsize))
    for r0 in range(0, n[0], rows):
        sizes = (min(rows, n[0] - r0), *n[1:])
        first = origin + r0 * strides[0]  # in the stored shard
        span = _span(sizes, strides)
        yield Box(
            sizes=sizes,
            at=(lo[0] + r0 - ro[0], *(a - b for a, b in zip(lo[1:], ro[1:], strict=True))),
            strides=strides,
            span=span,
            pieces=list(_cut(shard, first, span, 0, itemsize, piece_bytes)),
        )
