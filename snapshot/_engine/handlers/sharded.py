"""Sharded tensors (our ``ShardedTensor``, a ``DTensor`` with Shard / Replicate placements,
torch's ``ShardedTensor``) and sharded objects: the take's checks that the ranks' main replicas
cover each tensor once and each object once, the commit's merge of every rank's entries, and
the reads of a target's regions (their geometry is :mod:`snapshot._engine.handlers.geometry`'s).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from manifest import Shard, ShardedObjectEntry, ShardedTensorEntry, new_tensor_entry
from snapshot._engine.format.serialization import (
    LocationCheck,
    dtype_from_name,
    dtype_name,
    raw_memoryview,
)
from snapshot._engine.handlers import objects
from snapshot._engine.handlers.dense import (
    DTENSOR,
    TensorKind,
    is_dense_tensor,
    is_sharded,
    loaded,
    take_tensor,
)
from snapshot._engine.handlers.geometry import (
    Box,
    Piece,
    cover_problem,
    find_overlap,
    plan_region,
)
from snapshot._engine.handlers.table import (
    Kind,
    ObjectReplica,
    Planned,
    ReadPlanner,
    ShardDraft,
    ShardedObjectDraft,
    TakeSink,
    TensorLayout,
)
from snapshot._engine.restore.reads import (
    Landing,
    Need,
    ScratchPool,
    allocate,
    check_target,
    direct_need,
    lands_directly,
    tile_limit,
    tile_need,
)
from snapshot.errors import (
    CorruptSnapshotError,
    ShapeMismatchError,
    SnapshotError,
    StateMismatchError,
    UnsupportedValueError,
)
from snapshot.sharding import mapping
from snapshot.sharding.mapping import ShardedTensor, is_main_replica


@dataclass(frozen=True)
class LocalPiece:
    """What a rank holds of a global tensor: the box ``offsets`` .. ``offsets + sizes``, its
    values ``data`` (shaped ``sizes``), and whether this rank's copy is the one written."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: torch.Tensor
    main: bool


@dataclass(frozen=True)
class Held:
    """What a rank holds of one global tensor: its name, dtype and shape, and its pieces (any
    number, none included, for torch's ``ShardedTensor``; else one), and whether ranks outside
    its mesh may hold copies of them (a DTensor on a submesh; ``copies`` picks the one
    written)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[LocalPiece, ...]
    copied: bool = False  # ranks outside its mesh may hold copies of its main pieces


def held(path: str, logical: str, value: Any) -> Held:
    """The pieces a ``ShardedTensor`` (ours or torch's) or ``DTensor`` holds. A DTensor's and a
    torch ShardedTensor's global tensor is named by its logical path (without the rank), our
    ShardedTensor's by its key."""
    if isinstance(value, ShardedTensor):
        if value.data is None:
            raise UnsupportedValueError(f"{path}: the ShardedTensor {value.key!r} holds no data")
        try:  # its data may have been replaced since it was built
            value.validate_metadata_integrity()
        except ValueError as e:
            raise UnsupportedValueError(f"{path}: {e}") from e
        offsets, sizes = value.global_region()
        data = value.data.reshape(sizes) if value.prepend_axis_num else value.data
        piece = LocalPiece(tuple(offsets), tuple(sizes), data, is_main_replica(value.replica_id))
        return Held(value.key, value.dtype, tuple(value.global_shape), (piece,))
    if isinstance(value, loaded(*DTENSOR)):
        return _dtensor_held(path, logical, value)
    # Torch's ShardedTensor has no replicas: every local shard is a main one (two ranks holding
    # the same box, as two replica groups of HSDP would, fail the coverage check).
    metadata = value.metadata()
    pieces = tuple(
        LocalPiece(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes), s.tensor, True)
        for s in value.local_shards()
    )
    return Held(logical, metadata.tensor_properties.dtype, tuple(metadata.size), pieces)


def _dtensor_held(path: str, logical: str, value: Any) -> Held:
    """A DTensor's one piece. Shard, ``_StridedShard`` (FSDP2 over TP: sharded on the TP mesh
    dimension first) and Replicate placements are stored as they are, when each rank's piece is
    one box (``_layout_problem``). A Partial one (each rank holds a term of a sum, not a piece)
    is refused, not reduced: reducing it is a collective the caller's ranks must all enter, and
    it changes the value the caller holds; the message says how to reduce it first.

    Its copies are held by the ranks at the other coordinates of its Replicate axes (HSDP's
    replica groups) and, for a DTensor on a submesh (``mesh["dp"]`` of a ``("dp", "tp")``
    mesh), by the ranks outside it: every copy is a main piece, ``copied``, and ``copies``
    picks the one written once every rank's pieces are known, spreading the bytes over the
    holders."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    # torch has no public name for the placement FSDP2 makes over TP.
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh, placements = value.device_mesh, tuple(value.placements)
    shape = tuple(value.shape)
    for p in placements:
        if isinstance(p, Partial):
            raise UnsupportedValueError(
                f"{path}: a DTensor with placement {p} (Partial: each rank holds a term of a "
                "sum, not a piece of the tensor) cannot be stored; reduce it first, e.g. "
                "value.redistribute(placements=[Replicate()] * mesh.ndim) or to Shard "
                "placements, on every rank, and take that"
            )
        if not isinstance(p, (Shard, Replicate, _StridedShard)):
            raise UnsupportedValueError(
                f"{path}: a DTensor with placement {p} cannot be stored; only Shard, "
                "_StridedShard and Replicate placements are (redistribute it to those first)"
            )
    strided = any(isinstance(p, _StridedShard) for p in placements)
    problem = strided and _layout_problem(shape, tuple(mesh.shape), placements)
    if problem:
        raise UnsupportedValueError(
            f"{path}: a DTensor of shape {list(shape)} with placements "
            f"({', '.join(map(str, placements))}) on a "
            f"mesh of shape {list(mesh.shape)} cannot be stored or restored in place: {problem}; "
            "redistribute it to Shard / Replicate placements first"
        )
    coord = mesh.get_coordinate()
    if coord is None:  # a rank outside the DTensor's mesh: no piece
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = map(tuple, compute_local_shape_and_global_offset(shape, mesh, placements))
    else:
        sizes, offsets = _box(shape, tuple(mesh.shape), tuple(coord), placements)
    piece = LocalPiece(offsets, sizes, value.to_local(), coord is not None)
    dist = torch.distributed
    copied = any(isinstance(p, Replicate) for p in placements) or (
        dist.is_initialized() and mesh.size() < dist.get_world_size()
    )
    return Held(logical, value.dtype, shape, (piece,), copied)


@functools.lru_cache(maxsize=1024)
def _box(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...], placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The sizes and offsets of the piece at ``coord`` of a DTensor of this layout, remembered:
    torch works them out on each call, each take and restore asks for every DTensor again."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    sizes, offsets = _compute_local_shape_and_global_offset(
        shape, mesh_shape, list(coord), placements
    )
    return tuple(sizes), tuple(offsets)


@functools.lru_cache(maxsize=256)
def _layout_problem(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Any, ...]
) -> str | None:
    """None when every rank's piece of a DTensor of this layout (one with a ``_StridedShard``:
    elements taken with a stride) is one box, as torch's offset of its first element and its
    local shape say; else why not. The boxes of every mesh coordinate along the sharding
    dimensions must cover the tensor exactly once: each tensor dimension's index sets partition
    it, so a piece that is not its box makes two boxes overlap."""
    # The public ``compute_local_shape_and_global_offset`` answers for this rank only; its
    # private worker takes any coordinate.
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    axes = [
        range(1) if isinstance(p, Replicate) else range(n)
        for p, n in zip(placements, mesh_shape, strict=True)
    ]
    boxes = set()
    for coord in itertools.product(*axes):
        sizes, offsets = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), placements
        )
        boxes.add((tuple(offsets), tuple(sizes)))
    problem = cover_problem(shape, sorted(boxes))
    if problem is None:
        return None
    return f"a rank's local piece is not one box of the tensor ({problem})"


# ---------------------------------------------------------------------------------------------
# Take: who covers what.


def copies(
    pieces: Sequence[Sequence[tuple[Any, ...]]],
) -> dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[tuple[int, str]]]:
    """Each set of main pieces of one tensor at one box held by several ranks, each ``copied``
    (a DTensor on a submesh, copied on the ranks outside it, as a head left out of the TP plan
    is on each tp rank, or HSDP's shards on each replica): ``(key, offsets, sizes)`` -> the
    ``(rank, path)`` (rank prefix included) of each copy, the one written first; the others
    are dropped, once the copies are confirmed equal (``replication``). The writer of each box
    is the holder with the fewest bytes to write so far, largest boxes first (ties to the
    lower rank), so that the copies' bytes spread over their holders as a take's other
    replicated bytes do. Found here, from every rank's pieces, not from the mesh: the same
    submesh on other ranks may hold other tensors (a pipeline stage's). ``pieces`` as for
    ``check_coverage``; every rank computes the same answer."""
    found: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[tuple[int, str]]] = {}
    nbytes: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}
    load = [0] * len(pieces)
    for rank, held in enumerate(pieces):
        for key, dtype, _, offsets, sizes, main, path, copied in held:
            if not (main and math.prod(sizes)):
                continue
            size = math.prod(sizes) * dtype_from_name(dtype, key).itemsize
            if copied:
                box = (key, tuple(offsets), tuple(sizes))
                found.setdefault(box, []).append((rank, path))
                nbytes[box] = size
            else:
                load[rank] += size
    shared = {box: holders for box, holders in found.items() if len(holders) > 1}
    for box, holders in found.items():
        if len(holders) == 1:
            load[holders[0][0]] += nbytes[box]
    for box in sorted(shared, key=lambda b: (-nbytes[b], b)):
        holders = shared[box]
        writer = min(holders, key=lambda h: (load[h[0]], h[0]))
        load[writer[0]] += nbytes[box]
        holders.remove(writer)
        holders.insert(0, writer)
    return shared


def check_coverage(pieces: Sequence[Sequence[tuple[Any, ...]]]) -> None:
    """``pieces[rank]`` lists ``(key, dtype, shape, offsets, sizes, main, path, copied)`` for
    each piece that rank holds. Every rank computes the same verdict: each global tensor has
    the same dtype and shape everywhere, and its main replicas, less the ``copies``, cover it
    exactly once.

    Raises:
        SnapshotError: naming the tensor and the ranks at fault.
    """
    dropped = {path for holders in copies(pieces).values() for _, path in holders[1:]}
    by_key: dict[str, list[tuple[int, tuple[Any, ...]]]] = {}
    for rank, held in enumerate(pieces):
        for piece in held:
            if piece[6] not in dropped:
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


# ---------------------------------------------------------------------------------------------
# Reading a region: the checks around ``geometry.plan_region``.


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


def checks_for(path: str, planned: Sequence[Piece], verify: bool) -> dict[int, Any]:
    """The ``verify`` of each piece's need (by ``id``): its part of the check of a chunk that
    ``planned`` reads whole, in pieces that tile it (a chunk read in part cannot be checked
    against its CRC-32; regions of several local shards of one target, read through their
    gaps, may read some stored bytes twice)."""
    covered: dict[tuple[str, int], list[Piece]] = {}
    for p in planned:
        covered.setdefault((p.chunk.blob, p.chunk.offset), []).append(p)
    verifiers: dict[int, Any] = {}
    for found in covered.values():
        end = 0  # where the pieces so far end, while they tile the chunk from its start; else -1
        for p in sorted(found, key=lambda p: p.lo):
            end = end + p.nbytes if p.lo == end else -1
        chunk = found[0].chunk
        if verify and chunk.crc32 is not None and end == chunk.nbytes:
            check = LocationCheck(path, chunk, len(found))
            verifiers.update((id(p), functools.partial(check.add, p.lo, p.nbytes)) for p in found)
    return verifiers


# ---------------------------------------------------------------------------------------------
# The kinds.


# Scratch of one box of a sharded read through its gaps: small enough to be in the CPU's cache
# when it is copied into place.
BOX_BYTES = 4 << 20


def _box_needs(
    path: str,
    dtype: torch.dtype,
    dest: torch.Tensor,
    box: Box,
    checks: Mapping[int, Any],
    pool: ScratchPool,
    landing: Landing,
) -> list[Need]:
    """A box's pieces, into a scratch buffer taken when the first of them is about to be read;
    once all have landed, one strided copy moves the box into ``dest`` (on a device, a
    synchronous one on the read's copy stream: ``Landing.copy``), and the buffer goes back to
    the pool."""
    scratch: list[torch.Tensor] = []
    remaining = [len(box.pieces)]
    nbytes = box.span * dtype.itemsize

    def into(p: Piece) -> memoryview:
        if not scratch:
            scratch.append(pool.take(nbytes))
        return raw_memoryview(scratch[0].data_ptr() + p.dest, p.nbytes)

    def done() -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            buffer = scratch.pop()
            source = torch.as_strided(buffer[:nbytes].view(dtype), box.sizes, box.strides)
            window = dest[tuple(slice(a, a + n) for a, n in zip(box.at, box.sizes, strict=True))]
            landing.copy(window, source)
            pool.give(buffer)

    return [
        Need(
            blob=p.chunk.blob,
            offset=p.chunk.offset + p.lo,
            nbytes=p.nbytes,
            dest=functools.partial(into, p),
            done=done,
            scratch_bytes=p.nbytes,
            label=path,
            verify=checks.get(id(p)),
        )
        for p in box.pieces
    ]


class ShardedTensorKind(TensorKind):
    """Each piece this rank holds as its main replica is written as a tensor of its own
    (``dense.take_tensor``), and every piece is listed for ``check_coverage``; a restore fills
    the target's regions from whatever shards were stored (``restore``). Found by
    ``accepts`` (no type of its own)."""

    name = "sharded_tensor"
    entry_types = (ShardedTensorEntry,)
    merged_types = (ShardedTensorEntry,)

    def accepts(self, value: Any) -> bool:
        return is_sharded(value)

    def take(
        self, sink: TakeSink, path: str, logical: str, value: Any, replicated: bool
    ) -> ShardDraft:
        mine = held(path, logical, value)
        written: list[tuple[LocalPiece, Any]] = []
        dtype = dtype_name(mine.dtype)
        for piece in mine.pieces:
            sink.out.pieces.append(
                (
                    mine.key, dtype, mine.shape, piece.offsets, piece.sizes, piece.main, path,
                    mine.copied,
                )
            )  # fmt: skip
            if piece.main:
                written.append((piece, take_tensor(sink, path, logical, piece.data, False)))
        return ShardDraft(held=mine, written=written)

    def restore(
        self, reader: ReadPlanner, path: str, entry: ShardedTensorEntry, target: Any
    ) -> None:
        """Reads the target's regions of a sharded tensor: the target's own piece(s) when it
        is a sharded value (resharded from whatever shards were stored), else the whole tensor
        into a plain tensor target (cast like ``copy_``) or a new one. Only the stored bytes
        overlapping a region are read (``geometry.plan_region``): straight into the
        destination when it takes raw bytes, else through scratch tiles (``tile_need``) or
        boxes (``_box_needs``)."""
        reader.claim()
        piece_bytes, landing = reader.piece_bytes, reader.landing
        box_bytes = min(reader.tile_bytes, BOX_BYTES)
        dtype = dtype_from_name(entry.dtype, path)
        check_entry(path, entry, dtype)
        whole = ((0,) * len(entry.shape), tuple(entry.shape))
        if is_sharded(target):
            mine = held(path, path.partition("/")[2], target)
            if mine.key != entry.key:
                raise StateMismatchError(
                    f"{path}: the snapshot holds sharded tensor {entry.key!r} here; the object "
                    f"being restored is a piece of {mine.key!r} (pieces are matched by logical "
                    "path, and the keys must agree)"
                )
            if mine.shape != tuple(entry.shape):
                raise ShapeMismatchError(
                    f"{path}: the snapshot holds {entry.key!r} of global shape {list(entry.shape)} "
                    f"({entry.dtype}); the object being restored is a piece of a global tensor "
                    f"of shape {list(mine.shape)}"
                )
            regions = [((p.offsets, p.sizes), p.data) for p in mine.pieces]
            # Our ShardedTensor gives back its (filled) data; a DTensor and torch's ShardedTensor
            # themselves, their local tensors filled in place.
            result: Any = target.data if isinstance(target, ShardedTensor) else target
        elif isinstance(target, torch.Tensor) and is_dense_tensor(target):
            regions, result = [(whole, target)], target
        else:
            result = allocate(path, entry.nbytes, lambda: torch.empty(entry.shape, dtype=dtype))
            regions = [(whole, result)]
        planned: list[tuple[torch.Tensor, list[Piece], list[Box]]] = []
        pieces: list[Piece] = []  # every region's
        for region, dest in regions:
            check_target(path, new_tensor_entry(entry.dtype, region[1], ()), dest, dtype)
            # As long as a read request into the region's memory; through scratch, as a tile.
            step = piece_bytes
            if not lands_directly(dest, dtype):
                step = tile_limit(dest, min(piece_bytes, reader.tile_bytes))
                landing.prepare(dest)
            direct, boxes = plan_region(
                entry, region, dtype.itemsize, step, reader.gap_bytes, box_bytes
            )
            planned.append((dest, direct, boxes))
            pieces.extend([*direct, *(p for box in boxes for p in box.pieces)])
        # Over every region's pieces: a chunk two local shards read in parts is still checked.
        checks = checks_for(path, pieces, reader.verify)
        needs: list[Need] = []
        for dest, direct, boxes in planned:
            for p in direct:
                if lands_directly(dest, dtype):
                    need = direct_need(path, p.chunk, p.lo, p.nbytes, dest.data_ptr() + p.dest)
                else:
                    first = p.dest // dtype.itemsize
                    need = tile_need(path, p.chunk, p.lo, p.nbytes, first, dtype, dest, landing)
                need.verify = checks.get(id(p))
                needs.append(need)
            for box in boxes:
                needs.extend(_box_needs(path, dtype, dest, box, checks, reader.scratch, landing))
        reader.add_needs(needs, into_target=not self.allocates(entry, target))
        reader.tensors[path] = result

    def merge(self, entries: dict[str, Any]) -> None:
        """Makes each rank's entry (the shards it wrote) list every rank's shards of that
        tensor, so any rank reads any region."""
        shards: dict[str, list[Shard]] = {}
        for entry in entries.values():
            if isinstance(entry, ShardedTensorEntry):
                shards.setdefault(entry.key, []).extend(entry.shards)
        full = {key: tuple(sorted(found, key=lambda s: s.offsets)) for key, found in shards.items()}
        for path, entry in entries.items():
            if isinstance(entry, ShardedTensorEntry):
                entries[path] = dataclasses.replace(entry, shards=full[entry.key])

    def tensor_layout(self, path: str, entry: ShardedTensorEntry) -> TensorLayout:
        dtype = dtype_from_name(entry.dtype, path)
        check_entry(path, entry, dtype)
        return TensorLayout(
            dtype, entry.shape, [(s.offsets, s.sizes, s.chunks) for s in entry.shards]
        )


SHARDED_TENSOR = ShardedTensorKind()


class ShardedObjectKind(Kind):
    """Written as an object by the rank holding its main replica; the other ranks' entries are
    filled in from that rank's at the commit (``merge``)."""

    name = "sharded_object"
    value_types = (mapping.ShardedObject,)
    entry_types = (ShardedObjectEntry,)
    merged_types = (ObjectReplica,)

    def take(
        self,
        sink: TakeSink,
        path: str,
        logical: str,
        value: mapping.ShardedObject,
        replicated: bool,
    ) -> Planned:
        key = value.unique_key
        main = mapping.is_main_replica(value.replica_id)
        sink.out.objects.append((key, main, path))
        if not main:
            return ObjectReplica(key)
        draft = objects.OBJECTS.take(sink, path, logical, value.data, False)
        return ShardedObjectDraft(key=key, draft=draft)

    def restore(
        self, reader: ReadPlanner, path: str, entry: ShardedObjectEntry, target: Any
    ) -> None:
        decode = functools.partial(objects.decode_value, path, entry)
        self.read_bytes(reader, path, entry.location, decode)

    def merge(self, entries: dict[str, Any]) -> None:
        """Replaces each ``ObjectReplica`` by the entry of the rank that wrote the object."""
        objects = {e.key: e for e in entries.values() if isinstance(e, ShardedObjectEntry)}
        for path, entry in entries.items():
            if isinstance(entry, ObjectReplica):
                entries[path] = objects[entry.key]


SHARDED_OBJECT = ShardedObjectKind()
