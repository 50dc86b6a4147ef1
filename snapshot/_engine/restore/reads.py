"""The read planning that every kind of entry shares: byte-range needs, and their merging into
scatter reads.

Each entry to load becomes needs: byte ranges of blobs that land in the target tensor's memory
when dtype and layout agree (``direct_need``), or in budget-sized scratch tiles otherwise,
copied into the target by the read's ``Landing`` (``tile_need``); needs in the same blob that
lie close together are merged into one scatter read (``coalesce``). The checks a tensor entry
and a restore target must pass before any byte is read are here too: the kinds that read
tensors (``handlers/dense.py``, ``handlers/sharded_tensor.py``, ``handlers/objects.py``) share
them, as the CLI's checks do (``resolve_view``).
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress, count, pairwise
from operator import add, attrgetter, ne, sub
from typing import TypeVar

import torch

from manifest import Entry, Location, TensorEntry
from snapshot._engine.format.serialization import (
    LocationCheck,
    WholeCheck,
    dtype_from_name,
    dtype_name,
    raw_memoryview,
    shares_memory,
    storage_shortfall,
    tensor_memoryview,
)
from snapshot._engine.io.pipeline import ReadRequest, Segment, segment_bytes
from snapshot._engine.restore.landing import Landing, Tile
from snapshot.errors import (
    CorruptSnapshotError,
    ShapeMismatchError,
    StateMismatchError,
    UnsupportedValueError,
)

_T = TypeVar("_T")


@dataclass(slots=True, kw_only=True)
class Need(Segment):
    """``nbytes`` bytes at ``offset`` of ``blob``, to land in ``dest()``; ``done`` then consumes
    them. ``scratch_bytes`` is the memory ``dest`` allocates and ``done`` frees. A need is the
    segment of the read that serves it. ``owner`` is the app_state key whose live state the
    bytes land in (a restore target given by its ``state_dict()``), None when they reach no
    live state (an object, a new tensor)."""

    blob: str
    offset: int
    done: Callable[[], None] | None
    scratch_bytes: int
    label: str


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
    chunks = entry.chunks
    stored = chunks[0].nbytes if len(chunks) == 1 else sum(c.nbytes for c in chunks)
    if stored != expected:
        raise CorruptSnapshotError(
            f"{path}: manifest records {stored} bytes for a {entry.dtype}{list(entry.shape)} "
            f"tensor, which needs {expected}"
        )
    if len(chunks) > 1 and any(c.nbytes % dtype.itemsize for c in chunks):
        raise CorruptSnapshotError(f"{path}: a chunk does not hold whole {entry.dtype} elements")
    return dtype


def resolve_view(
    entries: Mapping[str, Entry], path: str, entry: TensorEntry
) -> tuple[str, TensorEntry]:
    """The path and entry of the base of ``entry``, a view (``TensorEntry.view``), once the view
    is checked to be one a take makes: its base is a tensor entry of the same rank (the view's
    base path under the rank prefix of ``path``) and dtype, not itself a view (so no chain of
    views, and no cycle, is ever followed), and holds every element the view reaches. Both
    entries' bytes add up to their shapes. Constant work per view, whatever the manifest holds.

    Raises:
        CorruptSnapshotError: any of these does not hold.
    """
    view = entry.view
    assert view is not None
    base_path = path[: path.find("/") + 1] + view.base
    base = entries.get(base_path)
    what = f"{path}: a view of {base_path!r}"
    if type(base) is not TensorEntry:
        found = "missing from the manifest" if base is None else f"a {base.type} entry"
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
    or a dtype that the stored one does not cast to (a target of another dtype is filled by
    ``copy_``, which casts as ``load_state_dict`` does; some pairs it refuses)."""
    if target.shape != entry.shape:
        raise ShapeMismatchError(
            f"{path}: the snapshot holds shape {list(entry.shape)} ({entry.dtype}), "
            f"the object being restored has shape {list(target.shape)} ({dtype_name(target.dtype)})"
        )
    if target.is_meta:
        raise UnsupportedValueError(f"{path}: cannot restore into a tensor on the meta device")
    check_receivable(path, target)
    if target.dtype != dtype and not casts(dtype, target.dtype):
        raise StateMismatchError(
            f"{path}: the snapshot holds {entry.dtype}, the object being restored is "
            f"{dtype_name(target.dtype)}, and torch cannot copy the one into the other"
        )


def check_receivable(path: str, target: torch.Tensor) -> None:
    """Refuses a restore target whose memory cannot take distinct values: elements that share
    memory (an expanded view: copying into it is torch's error, writing its bytes would keep
    the last), or a storage that ends before its last element (freed: the bytes would land out
    of bounds). Asked before any byte is read."""
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


@functools.cache
def casts(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ``copy_`` fills a ``dst`` tensor from a ``src`` one (tried on one element)."""
    try:
        torch.zeros(1, dtype=dst).copy_(torch.zeros(1, dtype=src))
    except (RuntimeError, TypeError):
        return False
    return True


def lands_directly(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether stored bytes of ``dtype`` can land straight in ``target``'s memory: a
    contiguous CPU tensor of that dtype, not a conjugate or negative view."""
    return (
        target.is_cpu
        and target.dtype == dtype
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


def allocate(path: str, nbytes: int, make: Callable[[], _T]) -> _T:
    """``make()``, the memory a manifest entry asks for; an allocation that fails (a damaged
    manifest can claim any size) is reported as what it most likely is."""
    try:
        return make()
    except (MemoryError, RuntimeError) as e:
        raise CorruptSnapshotError(
            f"{path}: cannot allocate the {nbytes:,} bytes the manifest says it holds "
            f"({type(e).__name__}); the manifest is damaged, or this machine lacks the memory"
        ) from e


# ---------------------------------------------------------------------------------------------
# Needs.


def location_check(
    path: str, loc: Location, pieces: int, verify: bool
) -> LocationCheck | WholeCheck | None:
    """The check of ``loc``'s bytes read in ``pieces`` needs, with ``verify`` and a recorded
    checksum only: for one piece a ``WholeCheck``, that need's ``verify`` (most tensors and
    every object: no bookkeeping of pieces); else a ``LocationCheck``, whose ``add`` each need
    gets for its offset and length (``piece_verify``)."""
    if not verify or loc.crc32 is None:
        return None
    return WholeCheck(path, loc) if pieces == 1 else LocationCheck(path, loc, pieces)


def piece_verify(
    check: LocationCheck | WholeCheck, offset: int, nbytes: int
) -> Callable[[int], None]:
    """The ``verify`` of the need of ``nbytes`` at ``offset`` in a location checked by
    ``check``."""
    if type(check) is WholeCheck:
        return check
    return functools.partial(check.add, offset, nbytes)


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
    """What a tile need does: takes its tile when its read is about to run (``dest``) and
    copies it into ``count`` elements of ``target`` from ``first`` on once the bytes have
    landed (``done``). A record with two bound methods, not two closures: a column-wise
    restore makes one per run, tens of thousands, and two closures with their cells hold
    much more memory than this slotted record, which keeps a tile need close to the size of a
    need read straight into its target."""

    __slots__ = ("count", "dtype", "first", "landing", "target", "tile")

    def __init__(
        self, target: torch.Tensor, first: int, count: int, dtype: torch.dtype, landing: Landing
    ) -> None:
        self.target = target
        self.first = first
        self.count = count
        self.dtype = dtype
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
    """The need of ``nbytes`` at ``lo`` in ``chunk``: elements ``first`` on of ``target`` in
    row-major order, read into a scratch tile that ``landing`` gives when the read is about to
    run (pinned for a device target) and copies into the target once the bytes have landed.
    The tile, and the cast tile a device target of another dtype needs, are charged to the
    read budget from the read's start to its ``done``; a device copy still in flight then is
    bounded and waited for by ``landing``."""
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
    """Scratch buffers handed from one box to the next: new memory costs page faults (a copy
    into fresh memory faults in every page it writes, a copy into reused memory none), and a
    box's buffer is free again as soon as its copy is done. Used on the I/O loop only."""

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
# Reads.


def coalesce(
    needs: Sequence[Need], *, max_gap_bytes: int, max_request_bytes: int, max_scratch_bytes: int
) -> list[ReadRequest]:
    """Merges needs of the same blob into few scatter reads.

    Needs are sorted by position; a need joins the read before it when it starts at most
    ``max_gap_bytes`` after that read ends (the gap is read and dropped), the read stays within
    ``max_request_bytes`` and its scratch memory within ``max_scratch_bytes``. Overlapping needs
    (one blob range restored into two targets) start a new read, so every read is one
    sequential pass.

    A blob's needs that read into their targets (no scratch), neither overlap nor leave a gap
    over ``max_gap_bytes``, each within ``max_request_bytes`` (a slab's thousands of small
    tensors) are cut into reads in C-level passes, a bisection per read; other blobs' needs go
    one by one. The gaps of every read land in one scratch buffer, as large as the largest.
    """
    requests: list[ReadRequest] = []
    gaps = _GapSegments()
    for blob, group in _by_blob(needs).items():
        group.sort(key=_offset)
        offsets = list(map(_offset, group))
        ends = list(map(add, offsets, map(segment_bytes, group)))
        between = list(map(sub, offsets[1:], ends))  # ``ends`` is one longer: zip stops first
        if (
            not any(map(_scratch, group))
            and (not between or (min(between) >= 0 and max(between) <= max_gap_bytes))
            and max(map(segment_bytes, group)) <= max_request_bytes
        ):
            first = 0
            while first < len(group):
                # The needs that end within one request's reach of the first: ``ends`` ascends.
                last = bisect_right(ends, offsets[first] + max_request_bytes, first + 1)
                requests.append(_request(blob, group[first:last], between[first : last - 1], gaps))
                first = last
            continue
        current: list[Need] = []
        spaces: list[int] = []
        end = size = scratch = 0
        for need in group:
            gap = need.offset - end
            if (
                current
                and 0 <= gap <= max_gap_bytes
                and size + gap + need.nbytes <= max_request_bytes
                and scratch + need.scratch_bytes <= max_scratch_bytes
            ):
                current.append(need)
                spaces.append(gap)
                size += gap + need.nbytes
                scratch += need.scratch_bytes
            else:
                if current:
                    requests.append(_request(blob, current, spaces, gaps))
                current, spaces = [need], []
                size, scratch = need.nbytes, need.scratch_bytes
            end = need.offset + need.nbytes
        if current:
            requests.append(_request(blob, current, spaces, gaps))
    gaps.land()
    return requests


_offset = attrgetter("offset")
_scratch = attrgetter("scratch_bytes")
_label = attrgetter("label")
_done = attrgetter("done")
_blob = attrgetter("blob")


def _by_blob(needs: Sequence[Need]) -> dict[str, list[Need]]:
    """The needs of each blob, in their order; the runs of consecutive needs of one blob (a
    blob's needs are mostly planned together) are found in C-level passes."""
    groups: dict[str, list[Need]] = {}
    if not needs:
        return groups
    blobs = list(map(_blob, needs))
    cuts = [0, *compress(count(1), map(ne, blobs[1:], blobs)), len(needs)]
    for lo, hi in pairwise(cuts):
        groups.setdefault(blobs[lo], []).extend(needs[lo:hi])
    return groups


class _GapSegments(dict[int, "Segment | None"]):
    """The segment of each gap length that coalesced reads skip (one object per length, shared
    by every read; None for no gap). Each lands in one scratch buffer (``land``: once every
    read is planned, the buffer as large as the largest gap)."""

    def __missing__(self, nbytes: int) -> Segment | None:
        seg = self[nbytes] = Segment(nbytes=nbytes, dest=None) if nbytes else None
        return seg

    def land(self) -> None:
        segments = [seg for seg in self.values() if seg is not None]
        if segments:
            junk = memoryview(bytearray(max(seg.nbytes for seg in segments)))
            for seg in segments:
                seg.dest = functools.partial(junk.__getitem__, slice(0, seg.nbytes))


def needs_label(needs: Iterable[Need]) -> str:
    """Names the entries some needs serve, for messages: ``"a"``, ``"a and 3 more"``."""
    return label_of(map(_label, needs))


def label_of(paths: Iterable[str]) -> str:
    """Names the entries at ``paths`` (some repeated), for messages: the first in order and
    how many more."""
    labels = set(paths)
    first = min(labels)
    return first if len(labels) == 1 else f"{first} and {len(labels) - 1} more"


def _request(blob: str, needs: list[Need], spaces: list[int], gaps: _GapSegments) -> ReadRequest:
    """The read of ``needs`` (ascending, not overlapping), ``spaces[i]`` bytes apart from
    ``needs[i]`` to the next."""
    if any(spaces):
        # Each need, then the gap after it (None, filtered out, where there is none).
        after = list(map(gaps.__getitem__, spaces))
        after.append(None)
        pairs = chain.from_iterable(zip(needs, after, strict=True))
        segments: list[Segment] = list(filter(None, pairs))
    else:
        segments = list(needs)
    dones = list(filter(None, map(_done, needs)))

    def done() -> None:
        for d in dones:
            d()

    return ReadRequest(
        blob=blob,
        offset=needs[0].offset,
        segments=segments,
        scratch_bytes=sum(map(_scratch, needs)),
        done=done if dones else None,
        label=needs_label(needs),
    )
