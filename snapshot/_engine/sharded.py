"""Sharded tensors: pieces of one global tensor held by several ranks (our ``ShardedTensor``, a
``DTensor`` with Shard / Replicate placements, or torch's own ``ShardedTensor`` from
``torch.distributed._shard``, as FSDP1's sharded state dicts and torchrec hold), stored once, and
read back into any sharding.

Take: each rank holding the main replica of a piece writes it like a tensor of its own (its
bytes in row-major order, chunked like any tensor); the ranks check together, before anything is
written, that the main replicas cover every global tensor exactly once; at the commit, the
pieces of each global tensor are gathered into one ``ShardedTensorEntry`` that every rank's
entry for it becomes.

Restore and ``read_object``: the region a target needs (its piece of the global tensor, or all
of it) is intersected with every stored shard; each overlap is read as the runs of consecutive
bytes it makes in the stored shard, straight into the target's memory when the target is a
contiguous CPU tensor of the stored dtype. Only overlapping bytes are asked for (the read
planner may still read through small gaps between runs, up to ``STATESNAP_READ_GAP_BYTES``).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from manifest import Entry, Location, Shard, ShardedObjectEntry, ShardedTensorEntry
from snapshot._engine.checksum import LocationCheck
from snapshot.errors import (
    CorruptSnapshotError,
    ShapeMismatchError,
    SnapshotError,
    StateMismatchError,
    UnsupportedValueError,
)
from snapshot.sharding.mapping import ShardedTensor, is_main_replica

Region = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) per global axis


@dataclass(frozen=True)
class LocalPiece:
    """What a rank holds of a global tensor: the box ``offsets`` .. ``offsets + sizes``, its
    values ``data`` (shaped ``sizes``), and whether this rank's copy is the one written."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: torch.Tensor
    main: bool


@dataclass(frozen=True)
class Held:
    """What a rank holds of one global tensor: its name, dtype and shape, and its pieces (one
    for our ``ShardedTensor`` and a ``DTensor``; any number, none included, for torch's
    ``ShardedTensor``, whose ranks may hold several shards or none)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[LocalPiece, ...]


# Where torch's own ShardedTensor lives (FSDP1's SHARDED_STATE_DICT, torchrec). Its base class
# holds the shards and their metadata; ``ShardedTensor`` adds the process group.
_TORCH_SHARDED_MODULE = "torch.distributed._shard.sharded_tensor.api"


def _dtensor_type() -> type | None:
    # A DTensor exists only once its module was imported: looking it up costs nothing, where
    # importing it would cost the first take about half a second.
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _torch_sharded_type() -> type | None:
    # The same for torch's ShardedTensor: no instance exists before its module is imported.
    module = sys.modules.get(_TORCH_SHARDED_MODULE)
    return getattr(module, "ShardedTensorBase", None)


def is_sharded(value: object) -> bool:
    """Whether ``value`` is stored as pieces of a global tensor."""
    if isinstance(value, ShardedTensor):
        return True
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(value, dtensor):
        return True
    torch_sharded = _torch_sharded_type()
    return torch_sharded is not None and isinstance(value, torch_sharded)


def held(path: str, logical: str, value: Any) -> Held:
    """The pieces a ``ShardedTensor`` (ours or torch's) or ``DTensor`` holds. A DTensor's and a
    torch ShardedTensor's global tensor is named by its logical path (without the rank), our
    ShardedTensor's by its key."""
    if isinstance(value, ShardedTensor):
        if value.data is None:
            raise UnsupportedValueError(f"{path}: the ShardedTensor {value.key!r} holds no data")
        offsets, sizes = value.global_region()
        piece = LocalPiece(
            key=value.key,
            dtype=value.dtype,
            shape=tuple(value.global_shape),
            offsets=tuple(offsets),
            sizes=tuple(sizes),
            data=value.data.reshape(sizes) if value.prepend_axis_num else value.data,
            main=is_main_replica(value.replica_id),
        )
    else:
        dtensor = _dtensor_type()
        if dtensor is None or not isinstance(value, dtensor):
            return _torch_sharded(path, logical, value)
        piece = _dtensor_piece(path, logical, value)
    return Held(piece.key, piece.dtype, piece.shape, (piece,))


def _torch_sharded(path: str, logical: str, value: Any) -> Held:
    """The local shards of torch's ``ShardedTensor``, each a piece of its own. Torch's
    ShardedTensor has no replicas: each shard in its metadata is placed on one rank, which
    holds it as a local shard, so every local shard is a main replica (two ranks holding the
    same box, as two replica groups of HSDP would, fail the coverage check)."""
    metadata = value.metadata()
    dtype = metadata.tensor_properties.dtype
    shape = tuple(metadata.size)
    pieces = []
    for shard in value.local_shards():
        box = shard.metadata
        if len(box.shard_offsets) != len(shape) or len(box.shard_sizes) != len(shape):
            raise UnsupportedValueError(
                f"{path}: a local shard of this torch ShardedTensor of shape {list(shape)} is "
                f"placed at {list(box.shard_offsets)} with size {list(box.shard_sizes)}"
            )
        pieces.append(
            LocalPiece(
                key=logical,
                dtype=dtype,
                shape=shape,
                offsets=tuple(box.shard_offsets),
                sizes=tuple(box.shard_sizes),
                data=shard.tensor,
                main=True,
            )
        )
    return Held(logical, dtype, shape, tuple(pieces))


def _dtensor_piece(path: str, logical: str, value: Any) -> LocalPiece:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = value.device_mesh, value.placements
    for p in placements:
        if not isinstance(p, (Shard, Replicate)):
            raise UnsupportedValueError(
                f"{path}: a DTensor with placement {p} cannot be stored as it is; only Shard and "
                "Replicate placements are (reduce a Partial one first, e.g. with redistribute)"
            )
    shape = tuple(value.shape)
    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    coords = mesh.get_coordinate()
    main = coords is not None and all(
        coords[dim] == 0 for dim, p in enumerate(placements) if isinstance(p, Replicate)
    )
    return LocalPiece(
        key=logical,
        dtype=value.dtype,
        shape=shape,
        offsets=tuple(offsets),
        sizes=tuple(sizes),
        data=value.to_local(),
        main=main,
    )


def target_regions(
    path: str, entry: ShardedTensorEntry, target: Any
) -> tuple[list[tuple[Region, torch.Tensor]], Any]:
    """Where a restore target's bytes belong: each of its regions of the global tensor with
    the tensor to fill (shaped like the region; one for our ShardedTensor and a DTensor, one
    per local shard of torch's ShardedTensor, none on a rank holding no shard), and the value
    the restored state gets back.

    Raises:
        ShapeMismatchError: the target is a piece of a global tensor of another shape.
    """
    mine = held(path, path.partition("/")[2], target)
    if mine.key != entry.key:
        raise StateMismatchError(
            f"{path}: the snapshot holds sharded tensor {entry.key!r} here; the object being "
            f"restored is a piece of {mine.key!r} (pieces are matched by logical path, and "
            "the keys must agree)"
        )
    if mine.shape != tuple(entry.shape):
        raise ShapeMismatchError(
            f"{path}: the snapshot holds {entry.key!r} of global shape {list(entry.shape)} "
            f"({entry.dtype}); the object being restored is a piece of a global tensor of shape "
            f"{list(mine.shape)}"
        )
    regions = [((p.offsets, p.sizes), p.data) for p in mine.pieces]
    return regions, _restored_value(target)


def _restored_value(target: Any) -> Any:
    # Our ShardedTensor gives back its (filled) data; a DTensor and torch's ShardedTensor
    # themselves, their local tensors filled in place.
    return target.data if isinstance(target, ShardedTensor) else target


# ---------------------------------------------------------------------------------------------
# Take: who covers what.


def check_coverage(pieces: Sequence[Sequence[tuple[Any, ...]]]) -> None:
    """``pieces[rank]`` lists ``(key, dtype, shape, offsets, sizes, main, path)`` for each
    piece that rank holds. Every rank computes the same verdict: each global tensor has the
    same dtype and shape everywhere, and its main replicas cover it exactly once.

    Raises:
        SnapshotError: naming the tensor and the ranks at fault.
    """
    by_key: dict[str, list[tuple[int, tuple[Any, ...]]]] = {}
    for rank, held in enumerate(pieces):
        for piece in held:
            by_key.setdefault(piece[0], []).append((rank, piece))
    for key, found in by_key.items():
        _, first = found[0]
        for rank, piece in found:
            if piece[1] != first[1] or piece[2] != first[2]:
                raise SnapshotError(
                    f"sharded tensor {key!r}: rank {found[0][0]} holds a piece of a "
                    f"{first[1]}{list(first[2])} tensor, rank {rank} of a "
                    f"{piece[1]}{list(piece[2])} one"
                )
        shape = first[2]
        mains = [(rank, piece[3], piece[4]) for rank, piece in found if piece[5]]
        boxes = [(offsets, sizes) for _, offsets, sizes in mains]
        problem = cover_problem(shape, boxes)
        if problem is None:
            continue
        pair = find_overlap(boxes)
        if pair is not None:
            (ra, oa, sa), (rb, ob, sb) = mains[pair[0]], mains[pair[1]]
            raise SnapshotError(
                f"sharded tensor {key!r}: the main replicas of ranks {ra} and {rb} overlap "
                f"(at {list(oa)} size {list(sa)}, and at {list(ob)} size {list(sb)}); give "
                "all but one of the copies of a piece a nonzero replica_id (torch's "
                "ShardedTensor has no replicas: each of its shards must be held by one rank "
                "only; state copied across replica groups, as HSDP's, needs DTensors, whose "
                "Replicate placements mark the copies)"
            )
        covered = sum(math.prod(s) for _, _, s in mains)
        holders = sorted({rank for rank, _ in found})
        if covered == math.prod(shape):  # not a count: the check itself refused the layout
            raise SnapshotError(
                f"sharded tensor {key!r} of shape {list(shape)}, held by ranks {holders}: {problem}"
            )
        raise SnapshotError(
            f"sharded tensor {key!r} of shape {list(shape)}: the main replicas held by "
            f"ranks {holders} cover {covered} of its {math.prod(shape)} elements; every "
            "element must be in exactly one main replica (replica_id 0)"
        )


# Whether boxes cover a tensor exactly once is decided from their corners (``cover_problem``):
# a box split along k axes has 2**k of them. Shardings split one axis or two (rows; rows and
# columns), a DTensor at most one per dimension of its mesh; past this many split axes the
# corners would cost many times the boxes' own description in the manifest.
_MAX_SPLIT_AXES = 6
# Up to this many boxes, a tensor split along more axes is checked pair by pair instead: fewer
# comparisons than this many per box. More boxes along more axes are refused.
_MAX_PAIRWISE = 1 << _MAX_SPLIT_AXES


def cover_problem(shape: Sequence[int], boxes: Sequence[Region]) -> str | None:
    """None when ``boxes`` (offsets, sizes) cover the box ``[0, shape)`` exactly once; else
    what is wrong, in words. In time linear in the number of boxes.

    Each box is the sum of signed points at its corners: +1 at its low corner, and the sign
    flipping with each axis on which a corner takes the box's high end; the count of boxes
    holding an element is the sum of the signed points below it on every axis (the inverse of
    that difference, a prefix sum). So the boxes hold every element of the tensor exactly once
    if and only if their signed corners add up to the tensor's own: a dictionary of corners,
    2**k entries per box along the k axes some box does not span whole. Empty boxes hold
    nothing and are left out (a rank may hold an empty piece), and so are the axes every box
    spans whole, which change nothing.
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
    if len(axes) <= _MAX_SPLIT_AXES:
        return _corner_problem(shape, solid, axes)
    if len(solid) <= _MAX_PAIRWISE:  # within find_overlap's budget: it never gives up
        return None if find_overlap(solid) is None else "two of the boxes overlap"
    return (
        f"it is split along {len(axes)} axes into {len(solid)} boxes; this library checks "
        f"tensors split along at most {_MAX_SPLIT_AXES} axes, or into at most "
        f"{_MAX_PAIRWISE} boxes"
    )


def _corner_problem(shape: Sequence[int], solid: Sequence[Region], axes: list[int]) -> str | None:
    """``cover_problem`` for boxes of the right total volume, by their signed corners along
    ``axes``."""
    weights: dict[tuple[int, ...], int] = {}
    for offsets, sizes in solid:
        _add_corners(weights, [(offsets[d], offsets[d] + sizes[d]) for d in axes], 1)
    _add_corners(weights, [(0, shape[d]) for d in axes], -1)
    if any(weights.values()):
        return "some elements are in two boxes, and as many in none"
    return None


def _add_corners(
    weights: dict[tuple[int, ...], int], bounds: list[tuple[int, int]], sign: int
) -> None:
    """Adds the signed corners of the box with ``(low, high)`` bounds on each axis, times
    ``sign``, to ``weights``."""
    for picks in itertools.product((0, 1), repeat=len(bounds)):
        corner = tuple(b[i] for b, i in zip(bounds, picks, strict=True))
        weights[corner] = weights.get(corner, 0) + (-sign if sum(picks) % 2 else sign)


def find_overlap(boxes: Sequence[Region]) -> tuple[int, int] | None:
    """The indices of two boxes that share an element, or None: a sweep along the first axis,
    comparing each box with the boxes still open where it starts. It gives up (None) after
    ``_MAX_PAIRWISE`` comparisons per box, which only many boxes spanning one stretch of the
    first axis together can need."""
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


@dataclass(frozen=True)
class ObjectReplica:
    """In a rank's entries, a sharded object whose main replica another rank wrote: the
    commit replaces it with that rank's entry for ``key`` (its unique key)."""

    key: str
    replicated: bool = True


def check_objects(objects: Sequence[Sequence[tuple[str, bool, str]]]) -> None:
    """``objects[rank]`` lists ``(unique key, main, path)`` for each sharded object that rank
    holds: each unique key must have exactly one main replica."""
    mains: dict[str, list[int]] = {}
    for rank, held in enumerate(objects):
        for key, main, _ in held:
            mains.setdefault(key, [])
            if main:
                mains[key].append(rank)
    for key, ranks in mains.items():
        if len(ranks) != 1:
            raise SnapshotError(
                f"sharded object {key!r} has {len(ranks)} main replicas (on ranks {ranks}); "
                "exactly one rank must hold it with replica_id 0"
            )


_MERGED = (ShardedTensorEntry, ShardedObjectEntry, ObjectReplica)


def merge_entries(parts: Iterable[Mapping[str, Any]]) -> dict[str, Entry | str]:
    """Every rank's entries in one mapping, each rank's ``ShardedTensorEntry`` (the shards that
    rank wrote) replaced by one listing every rank's shards of that tensor, and each
    ``ObjectReplica`` by the entry of the rank that wrote the object. A tensor's entry given as
    its manifest line (``str``) is kept as it is."""
    merged: dict[str, Any] = {}
    shards: dict[str, list[Shard]] = {}
    objects: dict[str, ShardedObjectEntry] = {}
    replicas = False
    for part in parts:
        merged.update(part)
        # Most parts hold none of the kinds merged here (a part of 20,000 lines, say): found
        # out by one pass in C over the kinds of its entries.
        if not any(issubclass(k, _MERGED) for k in set(map(type, part.values()))):
            continue
        for entry in part.values():
            if isinstance(entry, ShardedTensorEntry):
                shards.setdefault(entry.key, []).extend(entry.shards)
            elif isinstance(entry, ShardedObjectEntry):
                objects[entry.key] = entry
            elif isinstance(entry, ObjectReplica):
                replicas = True
    if replicas:
        for path, entry in merged.items():
            if isinstance(entry, ObjectReplica):
                merged[path] = objects[entry.key]
    if not shards:
        return merged
    full = {key: tuple(sorted(found, key=lambda s: s.offsets)) for key, found in shards.items()}
    for path, entry in merged.items():
        if isinstance(entry, ShardedTensorEntry):
            merged[path] = ShardedTensorEntry(
                key=entry.key,
                dtype=entry.dtype,
                shape=entry.shape,
                shards=full[entry.key],
                # Not "replicated": each rank keeps its own entry, under the path it holds
                # its piece at (one listing every shard, so any rank reads any region).
            )
    return merged


# ---------------------------------------------------------------------------------------------
# Reading a region.


def _strides(sizes: Sequence[int]) -> tuple[int, ...]:
    out = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        out[d] = out[d + 1] * sizes[d + 1]
    return tuple(out)


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
    # The run: the innermost axis, and the ones outside it while the overlap spans them whole.
    d = ndim - 1
    count = n[d]
    while d > 0 and n[d] == ss[d] == ws[d]:
        d -= 1
        count *= n[d]
    base_s = sum((lo[k] - so[k]) * s_str[k] for k in range(ndim))
    base_w = sum((lo[k] - wo[k]) * w_str[k] for k in range(ndim))
    for index in itertools.product(*(range(n[k]) for k in range(d))):
        s = base_s + sum(i * s_str[k] for k, i in enumerate(index))
        w = base_w + sum(i * w_str[k] for k, i in enumerate(index))
        yield s, w, count


def check_entry(path: str, entry: ShardedTensorEntry, dtype: torch.dtype) -> None:
    """The shards cover the global shape exactly once, and each shard's chunks hold its
    bytes."""
    for shard in entry.shards:
        expected = math.prod(shard.sizes) * dtype.itemsize
        stored = sum(c.nbytes for c in shard.chunks)
        if stored != expected or any(c.nbytes % dtype.itemsize for c in shard.chunks):
            raise CorruptSnapshotError(
                f"{path}: the shard at {list(shard.offsets)} of {entry.key!r} records {stored} "
                f"bytes in chunks of whole elements, which must be {expected}"
            )
    problem = cover_problem(entry.shape, [(s.offsets, s.sizes) for s in entry.shards])
    if problem is not None:
        raise CorruptSnapshotError(
            f"{path}: the shards of {entry.key!r} do not cover its shape {list(entry.shape)} "
            f"exactly once: {problem}"
        )


def check_region(path: str, entry: ShardedTensorEntry, region: Region, dest: torch.Tensor) -> None:
    """Refuses a region outside the stored tensor, or a destination of another shape."""
    offsets, sizes = region
    if len(offsets) != len(entry.shape) or any(
        o + n > g for o, n, g in zip(offsets, sizes, entry.shape, strict=True)
    ):
        raise ShapeMismatchError(
            f"{path}: the snapshot holds {entry.key!r} of global shape {list(entry.shape)} "
            f"({entry.dtype}); the object being restored wants its region at {list(offsets)} "
            f"of size {list(sizes)}"
        )
    if tuple(dest.shape) != tuple(sizes):
        raise ShapeMismatchError(
            f"{path}: a region of size {list(sizes)} cannot fill a tensor of shape "
            f"{list(dest.shape)}"
        )
    if dest.is_meta:
        raise UnsupportedValueError(f"{path}: cannot restore into a tensor on the meta device")


@dataclass
class Piece:
    """``nbytes`` bytes at ``offset`` of ``chunk``'s blob, landing at byte ``dest`` of the
    destination; ``lo`` is the offset within the chunk."""

    chunk: Location
    lo: int
    nbytes: int
    dest: int


def _cut(
    shard: Shard, start: int, stop: int, dest: int, itemsize: int, piece_bytes: int
) -> Iterator[Piece]:
    """Bytes ``[start, stop)`` of a stored shard as pieces: cut where its chunks end, and into
    at most ``piece_bytes``; ``dest`` is where the first byte lands."""
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

    An overlap whose runs are separated by gaps of at most ``gap_bytes`` on average (the
    ``STATESNAP_READ_GAP_BYTES`` rule of every other read) is read as boxes of at most about
    ``box_bytes`` through a scratch buffer: a column block of a row-sharded tensor is
    thousands of runs of a few KiB, each a read request of its own otherwise. Others are read
    run by run, only the bytes wanted.
    """
    direct: list[Piece] = []
    boxes: list[Box] = []
    for shard in entry.shards:
        stored = (shard.offsets, shard.sizes)
        box = _overlap(stored, region)
        if box is None:
            continue
        layout = _box_layout(stored, region, box)
        if layout is None or layout[1] * itemsize > gap_bytes:
            for src, dst, count in runs(stored, region):
                direct.extend(
                    _cut(
                        shard,
                        src * itemsize,
                        (src + count) * itemsize,
                        dst * itemsize,
                        itemsize,
                        piece_bytes,
                    )
                )
            continue
        boxes.extend(_boxes(shard, box, region, itemsize, piece_bytes, box_bytes))
    return direct, boxes


def _box_layout(stored: Region, wanted: Region, box: Region) -> tuple[int, float] | None:
    """(runs, average gap between them in the stored bytes, in elements) of an overlap, as
    ``runs`` cuts it; None when it is one run."""
    ss, ws, n = stored[1], wanted[1], box[1]
    ndim = len(n)
    if ndim < 2:
        return None
    d = ndim - 1
    count = n[d]
    while d > 0 and n[d] == ss[d] == ws[d]:
        d -= 1
        count *= n[d]
    nruns = math.prod(n[:d])
    if nruns <= 1:
        return None
    span = _span(n, _strides(ss))
    return nruns, (span - nruns * count) / (nruns - 1)


def _span(sizes: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from a box's first to its last, stored row-major with ``strides``."""
    return sum((m - 1) * st for m, st in zip(sizes, strides, strict=True)) + 1


def _boxes(
    shard: Shard, box: Region, region: Region, itemsize: int, piece_bytes: int, box_bytes: int
) -> Iterator[Box]:
    """The overlap ``box`` of ``shard``, cut along its first axis into boxes whose span (in the
    stored bytes) is at most about ``box_bytes``."""
    (so, ss), (lo, n), (ro, _) = (shard.offsets, shard.sizes), box, region
    strides = _strides(ss)
    rows = max(1, box_bytes // (strides[0] * itemsize))
    for r0 in range(0, n[0], rows):
        sizes = (min(rows, n[0] - r0), *n[1:])
        first = (lo[0] + r0 - so[0]) * strides[0] + sum(
            (lo[k] - so[k]) * strides[k] for k in range(1, len(n))
        )
        span = _span(sizes, strides)
        at = (lo[0] + r0 - ro[0], *(lo[k] - ro[k] for k in range(1, len(n))))
        yield Box(
            sizes=sizes,
            at=at,
            strides=strides,
            span=span,
            pieces=list(
                _cut(shard, first * itemsize, (first + span) * itemsize, 0, itemsize, piece_bytes)
            ),
        )


def checks_for(
    path: str, planned: Sequence[Piece], verify: bool
) -> dict[tuple[str, int], LocationCheck]:
    """One check per chunk that ``planned`` reads whole (in however many pieces): a chunk
    read in part cannot be checked against its recorded CRC-32. The pieces must tile the
    chunk, each starting where the one before ends: regions of several local shards of one
    target, read through their gaps, may read some stored bytes twice."""
    if not verify:
        return {}
    covered: dict[tuple[str, int], list[Piece]] = {}
    for p in planned:
        covered.setdefault((p.chunk.blob, p.chunk.offset), []).append(p)
    checks = {}
    for key, found in covered.items():
        chunk = found[0].chunk
        if chunk.crc32 is None or sum(p.nbytes for p in found) != chunk.nbytes:
            continue
        end = 0
        for p in sorted(found, key=lambda p: p.lo):
            if p.lo != end:
                break
            end += p.nbytes
        else:
            checks[key] = LocationCheck(path, chunk, len(found))
    return checks


def verifier(checks: Mapping[tuple[str, int], LocationCheck], p: Piece) -> Any:
    check = checks.get((p.chunk.blob, p.chunk.offset))
    return functools.partial(check.add, p.lo, p.nbytes) if check is not None else None
