"""Planning a restore's reads: byte-range needs, the checks before any byte is read, their
merging into scatter reads, and the landing of scratch tiles in targets.

A need lands in the target tensor's memory when dtype and layout agree (``direct_need``), else
in a scratch tile that a ``Landing`` copies into the target (``tile_need``); close needs of
one blob merge into one scatter read (``coalesce``).
"""

from __future__ import annotations

import functools
import logging
import math
import operator
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any, TypeVar

import torch

from manifest import Entry, Location, TensorEntry
from snapshot._engine.format.serialization import (
    LocationCheck,
    WholeCheck,
    as_copyable,
    copy_elements,
    dtype_from_name,
    dtype_name,
    range_views,
    raw_memoryview,
    shares_memory,
    storage_shortfall,
    tensor_memoryview,
)
from snapshot._engine.io import device
from snapshot._engine.io.pipeline import ReadRequest, Segment
from snapshot.errors import (
    CorruptSnapshotError,
    ShapeMismatchError,
    StateMismatchError,
    UnsupportedValueError,
    a_or_an,
)

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(slots=True)
class Need(Segment):
    """``nbytes`` bytes at ``offset`` of ``blob``, to land in ``dest()``; ``done`` then consumes
    them. ``scratch_bytes``: the memory ``dest`` allocates and ``done`` frees. ``owner``: the
    app_state key whose live state the bytes land in (None: a new value). Given by keyword
    but where a restore makes one per tensor (``Loader.add_direct``): after Segment's
    ``nbytes, dest, verify, owner``, its own fields in order (their defaults only because
    Segment's last fields have them)."""

    blob: str = ""
    offset: int = 0
    done: Callable[[], None] | None = None
    scratch_bytes: int = 0
    label: str = ""


@dataclass
class TensorRead:
    """The needs that fill one tensor, and that tensor (the target, or a new one)."""

    needs: list[Need]
    result: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Checks before any byte is read.


def check_tensor_entry(path: str, entry: TensorEntry) -> torch.dtype:
    """The entry's dtype, after checking its bytes add up to its dtype and shape."""
    dtype = dtype_from_name(entry.dtype, path)
    expected = math.prod(entry.shape) * dtype.itemsize
    stored = sum(c.nbytes for c in entry.chunks)
    if stored != expected:
        raise CorruptSnapshotError(
            f"{path}: manifest records {stored} bytes for a {entry.dtype}{list(entry.shape)} "
            f"tensor, which needs {expected}"
        )
    if len(entry.chunks) > 1 and any(c.nbytes % dtype.itemsize for c in entry.chunks):
        raise CorruptSnapshotError(f"{path}: a chunk does not hold whole {entry.dtype} elements")
    return dtype


def resolve_view(
    entries: Mapping[str, Entry], path: str, entry: TensorEntry
) -> tuple[str, TensorEntry]:
    """The path and entry of the base of ``entry``, a view, once checked to be a view a take
    makes (else ``CorruptSnapshotError``): its base is a tensor entry of the same dtype under
    the rank prefix of ``path``, not itself a view (no chain or cycle is followed), holding
    every element the view reaches; both entries' bytes add up to their shapes."""
    view = entry.view
    assert view is not None
    base_path = path[: path.find("/") + 1] + view.base
    base = entries.get(base_path)
    what = f"{path}: a view of {base_path!r}"
    if type(base) is not TensorEntry:
        found = "missing from the manifest" if base is None else f"{a_or_an(base.tag)} entry"
        raise CorruptSnapshotError(f"{what}, which is {found}, not a tensor")
    if base.view is not None:
        raise CorruptSnapshotError(
            f"{what}, which is itself a view (of {base.view.base!r}); a view's base is never one"
        )
    if base.dtype != entry.dtype:
        raise CorruptSnapshotError(f"{what}, which holds {base.dtype}, not {entry.dtype}")
    check_tensor_entry(path, entry)
    check_tensor_entry(base_path, base)
    numel = math.prod(base.shape)
    # The last element the view reaches (an empty view reaches none: its offset may be the end).
    if 0 in entry.shape:
        last = view.offset - 1
    else:
        last = view.offset + sum((n - 1) * s for n, s in zip(entry.shape, view.stride, strict=True))
    if last >= numel:
        raise CorruptSnapshotError(
            f"{what}, reaching its element {last:,}, beyond its {numel:,} elements"
        )
    return base_path, base


def check_target(path: str, entry: TensorEntry, target: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuses a restore target that cannot receive this entry: another shape, the meta device,
    elements that share memory, a storage that ends before them, or a dtype that ``copy_``
    does not cast the stored one to."""
    if target.shape != entry.shape:
        raise ShapeMismatchError(
            f"{path}: the snapshot holds shape {list(entry.shape)} ({entry.dtype}), "
            f"the object being restored has shape {list(target.shape)} ({dtype_name(target.dtype)})"
        )
    if target.is_meta:
        raise UnsupportedValueError(f"{path}: cannot restore into a tensor on the meta device")
    if shares_memory(target):
        raise StateMismatchError(
            f"{path}: the object being restored has elements that share memory (shape "
            f"{list(target.shape)}, strides {list(target.stride())}: an expanded or overlapping "
            "view), so it cannot hold the snapshot's values; restore into a tensor of its own "
            "(.clone())"
        )
    short = storage_shortfall(target)
    if short is not None:
        raise StateMismatchError(
            f"{path}: the object being restored views {short[0]} bytes of a storage that holds "
            f"{short[1]} (its memory was freed or shrunk); restore into a tensor with memory"
        )
    if target.dtype != dtype and not casts(dtype, target.dtype):
        raise StateMismatchError(
            f"{path}: the snapshot holds {entry.dtype}, the object being restored is "
            f"{dtype_name(target.dtype)}, and torch cannot copy the one into the other"
        )


@functools.cache
def casts(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ``copy_`` fills a ``dst`` tensor from a ``src`` one (tried on one element)."""
    try:
        torch.zeros(1, dtype=dst).copy_(torch.zeros(1, dtype=src))
    except (RuntimeError, TypeError):
        return False
    return True


def lands_directly(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether bytes of ``dtype`` land straight in ``target`` (contiguous, CPU, not lazy)."""
    return (
        target.is_cpu
        and target.dtype == dtype
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


def allocate(path: str, nbytes: int, make: Callable[[], _T]) -> _T:
    """``make()``, the memory a manifest entry asks for; a failure is reported as damage."""
    try:
        return make()
    except (MemoryError, RuntimeError) as e:
        raise CorruptSnapshotError(
            f"{path}: cannot allocate the {nbytes:,} bytes the manifest says it holds "
            f"({type(e).__name__}); the manifest is damaged, or this machine lacks the memory"
        ) from e


# ---------------------------------------------------------------------------------------------
# Needs.


def pieces(
    path: str, loc: Location, step: int, verify: bool
) -> Iterator[tuple[int, int, Callable[[int], None] | None]]:
    """The pieces of at most ``step`` bytes that ``loc`` is read in: (offset within it, length,
    the check of its CRC-32 as it lands; None without ``verify`` or a recorded CRC-32)."""
    checked = verify and loc.crc32 is not None
    if loc.nbytes <= step:
        if loc.nbytes:
            yield 0, loc.nbytes, WholeCheck(path, loc) if checked else None
        return
    check = LocationCheck(path, loc, -(-loc.nbytes // step)) if checked else None
    for lo in range(0, loc.nbytes, step):
        n = min(step, loc.nbytes - lo)
        yield lo, n, None if check is None else functools.partial(check.add, lo, n)


def direct_need(path: str, chunk: Location, lo: int, nbytes: int, address: int) -> Need:
    """The need of ``nbytes`` at ``lo`` in ``chunk``, landing at ``address`` (in the target)."""
    return Need(
        blob=chunk.blob,
        offset=chunk.offset + lo,
        nbytes=nbytes,
        dest=functools.partial(raw_memoryview, address, nbytes),
        done=None,
        scratch_bytes=0,
        label=path,
    )


class _TileCopy:
    """A tile need's steps: a tile taken as its read starts, copied into ``count`` elements of
    ``target`` from ``first`` on once landed (slotted: a restore may plan tens of thousands)."""

    __slots__ = ("count", "dtype", "first", "landing", "target", "tile")

    def __init__(
        self, target: torch.Tensor, first: int, count: int, dtype: torch.dtype, landing: Landing
    ) -> None:
        self.target, self.first, self.count, self.dtype = target, first, count, dtype
        self.landing = landing
        self.tile: Tile | None = None

    def dest(self) -> memoryview:
        tile = self.tile = self.landing.tile(self.count, self.dtype, self.target)
        return tensor_memoryview(tile.data)

    def done(self) -> None:
        tile, self.tile = self.tile, None
        assert tile is not None
        self.landing.land(self.target, self.first, self.first + self.count, tile)


def tile_need(
    path: str,
    chunk: Location,
    lo: int,
    nbytes: int,
    first: int,
    dtype: torch.dtype,
    target: torch.Tensor,
    landing: Landing,
) -> Need:
    """The need of ``nbytes`` at ``lo`` in ``chunk``: elements ``first`` on of ``target``
    (row-major), through a tile of ``landing``, charged to the budget until its ``done``."""
    count = nbytes // dtype.itemsize
    copy = _TileCopy(target, first, count, dtype, landing)
    return Need(
        blob=chunk.blob,
        offset=chunk.offset + lo,
        nbytes=nbytes,
        dest=copy.dest,
        done=copy.done,
        scratch_bytes=nbytes + landing.cast_bytes(count, dtype, target),
        label=path,
    )


class ScratchPool:
    """Scratch buffers handed from one read to the next; used on the I/O loop only."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        for i, t in enumerate(self._free):
            if t.numel() >= nbytes:
                return self._free.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, t: torch.Tensor) -> None:
        self._free.append(t)


# ---------------------------------------------------------------------------------------------
# Scatter reads.

_offset = operator.attrgetter("offset")
_blob = operator.attrgetter("blob")
_label = operator.attrgetter("label")
_done = operator.attrgetter("done")


def coalesce(
    needs: Sequence[Need], *, max_gap_bytes: int, max_request_bytes: int, max_scratch_bytes: int
) -> list[ReadRequest]:
    """Merges needs of the same blob into few scatter reads.

    In offset order, a need joins the read before it when it starts at most ``max_gap_bytes``
    after it (the gap is read into shared scratch and dropped) and the read stays within
    ``max_request_bytes`` and ``max_scratch_bytes``. An overlapping need starts a new read:
    each read is one sequential pass.
    """
    by_blob: dict[str, list[Need]] = {}
    for blob, run in groupby(needs, _blob):  # (most needs come in runs of one blob)
        by_blob.setdefault(blob, []).extend(run)
    requests: list[ReadRequest] = []
    gaps: dict[int, Segment] = {}
    for blob, group in by_blob.items():
        group.sort(key=_offset)
        segments: list[Segment] = []
        members: list[Need] = []  # the segments but gaps
        first = group[0]
        end = start = first.offset
        scratch = 0
        for need in group:
            gap = need.offset - end
            if (
                not (
                    0 <= gap <= max_gap_bytes
                    and end + gap + need.nbytes - start <= max_request_bytes
                    and scratch + need.scratch_bytes <= max_scratch_bytes
                )
                and segments
            ):
                requests.append(_request(blob, start, segments, members, scratch))
                segments, members, start, scratch, gap = [], [], need.offset, 0, 0
            if gap:
                segments.append(gaps.setdefault(gap, Segment(nbytes=gap, dest=None)))
            segments.append(need)
            members.append(need)
            scratch += need.scratch_bytes
            end = need.offset + need.nbytes
        requests.append(_request(blob, start, segments, members, scratch))
    if gaps:
        junk = memoryview(bytearray(max(gaps)))
        for seg in gaps.values():
            seg.dest = functools.partial(_head, junk, seg.nbytes)
    return requests


def _head(buf: memoryview, nbytes: int) -> memoryview:
    return buf[:nbytes]


def _request(
    blob: str, offset: int, segments: list[Segment], needs: list[Need], scratch: int
) -> ReadRequest:
    dones = list(filter(None, map(_done, needs)))

    def done() -> None:
        for d in dones:
            d()

    return ReadRequest(
        blob=blob,
        offset=offset,
        segments=segments,
        scratch_bytes=scratch,
        done=done if dones else None,
        label=label_of(map(_label, needs)),
    )


def label_of(paths: Iterable[str]) -> str:
    """Names the entries at ``paths`` for messages: ``"a"``, ``"a and 3 more"``."""
    labels = set(paths)
    first = min(labels)
    return first if len(labels) == 1 else f"{first} and {len(labels) - 1} more"


# ---------------------------------------------------------------------------------------------
# Landing. Host targets get a ``copy_`` at once. CUDA targets get page-locked tiles copied
# non-blocking on a copy stream per device, made to wait for the caller's current stream; a
# tile stays referenced until the event after its copies has passed or the streams are
# synchronized. CUDA calls go through ``io.device`` (``tests/cuda_double.py`` replaces it).

_pin_warned = False

# The longest tile into a device target: short tiles, reused, keep pinned memory small.
DEVICE_TILE_BYTES = 8 << 20


def tile_limit(target: torch.Tensor, tile_bytes: int) -> int:
    """The longest tile into ``target``: ``tile_bytes``, at most a device tile on a GPU."""
    if device.cuda_index(target) is None:
        return tile_bytes
    return min(tile_bytes, DEVICE_TILE_BYTES)


class Tile:
    """A scratch tile: ``data`` (stored dtype) viewing ``block`` (pooled bytes), maybe pinned."""

    def __init__(self, block: torch.Tensor, dtype: torch.dtype, pinned: bool) -> None:
        self.block = block
        self.data = block.view(dtype)
        self.pinned = pinned


class Landing:
    """The copies of one restore's scratch tiles into targets, and the pool of those tiles.
    ``spare_bytes``: what may be held beyond the reads' charges (free tiles, pinned tiles in
    flight); past it free tiles are dropped, then the streams waited for."""

    def __init__(self) -> None:
        self.spare_bytes = 0  # set by the loader before the reads
        self._streams: dict[int, device.Stream] = {}  # device index -> copy stream
        self._pinning = True  # until pinning fails once
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}  # by (bytes, pinned)
        self._free_total = 0
        # Pinned tiles whose copies may still read them, oldest first, with the event after.
        self._in_flight: deque[tuple[torch.Tensor, Any]] = deque()
        self._in_flight_total = 0

    def prepare(self, target: torch.Tensor) -> None:
        """Before any read, per target: a device's copy stream waits for the caller's stream."""
        index = device.cuda_index(target)
        if index is None or index in self._streams:
            return
        stream = device.new_stream(index)
        device.wait_stream(stream, device.current_stream(index))
        self._streams[index] = stream

    def scratch_limit(self, tile_bytes: int) -> int:
        """The most scratch one read may hold: one device tile once a device target is planned."""
        return min(tile_bytes, DEVICE_TILE_BYTES) if self._streams else tile_bytes

    def cast_bytes(self, count: int, dtype: torch.dtype, target: torch.Tensor) -> int:
        """Host memory beside the tile for a device target of another dtype: the cast tile."""
        if target.dtype is dtype or device.cuda_index(target) is None:
            return 0
        return count * target.element_size()

    def tile(self, count: int, dtype: torch.dtype, target: torch.Tensor) -> Tile:
        """A tile for ``target``: pinned when a device copy reads it, else pageable."""
        pin = target.dtype is dtype and device.cuda_index(target) is not None
        return self._take(count, dtype, pin)

    def _take(self, count: int, dtype: torch.dtype, pin: bool) -> Tile:
        global _pin_warned
        nbytes = count * dtype.itemsize
        pin = pin and self._pinning
        free = self._free.get((nbytes, pin))
        if pin and not free and self._in_flight:
            self._reap()  # tiles whose copies are done are free again
            free = self._free.get((nbytes, pin))
            if not free and self._free_total + self._in_flight_total + nbytes > self.spare_bytes:
                # Wait for the copies and reuse a tile rather than lock more memory.
                self._drain()
                free = self._free.get((nbytes, pin))
        if free:
            self._free_total -= nbytes
            return Tile(free.pop(), dtype, pin)
        if pin:
            try:
                return Tile(device.pinned_empty((nbytes,), torch.uint8), dtype, True)
            except RuntimeError as e:
                self._pinning = False
                if not _pin_warned:
                    _pin_warned = True
                    logger.warning(
                        "restore: cannot pin host memory (%s); copying to the device from "
                        "pageable memory, synchronously",
                        e,
                    )
        return Tile(torch.empty(nbytes, dtype=torch.uint8), dtype, False)

    def _give(self, tile: Tile) -> None:
        """Keeps a tile no copy reads any more for reuse, while the spare bytes allow."""
        nbytes = tile.block.numel()
        if self._free_total + self._in_flight_total + nbytes <= self.spare_bytes:
            self._free.setdefault((nbytes, tile.pinned), []).append(tile.block)
            self._free_total += nbytes

    def land(self, target: torch.Tensor, start: int, stop: int, tile: Tile) -> None:
        """Copies ``tile`` into elements ``[start, stop)`` of ``target``, casting like
        ``copy_``: done on the host, queued on the copy stream for a device."""
        index = device.cuda_index(target)
        if index is None:
            with torch.no_grad():
                copy_elements(target, start, stop, tile.data)
            self._give(tile)
            return
        src = tile
        if target.dtype is not tile.data.dtype:
            # Cast on the host into a pinned tile of the target's dtype: torch's cast from a
            # pinned tile to a device would go through pageable memory, synchronously.
            src = self._take(stop - start, target.dtype, True)
            src.data.copy_(tile.data)
            self._give(tile)
        flat, target = as_copyable(src.data), as_copyable(target)
        stream = self._streams[index]
        with torch.no_grad(), device.use_stream(stream):
            pos = 0
            for view in range_views(target, start, stop):
                n = view.numel()
                device.copy(view, flat[pos : pos + n].view(view.shape), src.pinned)
                pos += n
        if not src.pinned:  # a synchronous copy: done
            self._give(src)
            return
        self._in_flight.append((src.block, device.record_event(stream)))
        self._in_flight_total += src.block.numel()
        self._settle()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` from scratch reused on return (synchronously, on a device too)."""
        index = device.cuda_index(dst)
        with torch.no_grad():
            if index is None:
                dst.copy_(src)
                return
            if dst.dtype is src.dtype:  # as bytes where torch has no copy kernel
                dst, src = as_copyable(dst), as_copyable(src)
            with device.use_stream(self._streams[index]):
                device.copy(dst, src, False)

    def _settle(self) -> None:
        """Keeps free and in-flight tiles within the spare bytes."""
        if self._free_total + self._in_flight_total <= self.spare_bytes:
            return
        self._free, self._free_total = {}, 0
        if self._in_flight_total > self.spare_bytes:
            self._reap()
        if self._in_flight_total > self.spare_bytes:
            self._drain()

    def _reap(self) -> None:
        """Frees the tiles whose copies are done, oldest first, without waiting."""
        while self._in_flight and device.event_done(self._in_flight[0][1]):
            block, _ = self._in_flight.popleft()
            self._in_flight_total -= block.numel()
            self._give(Tile(block, torch.uint8, True))

    def _drain(self) -> None:
        for stream in self._streams.values():
            device.synchronize(stream)
        landed, self._in_flight = self._in_flight, deque()
        self._in_flight_total = 0
        for block, _ in landed:
            self._give(Tile(block, torch.uint8, True))

    def finish(self) -> None:
        """After the reads (a failure too): waits for every device copy, drops the pool."""
        if self._streams:
            self._drain()
        self._free, self._free_total = {}, 0
