"""Sharded tensors and objects, as the ranks hold them and as the manifest records them: the
pieces a rank holds of a global tensor (our ``ShardedTensor``, a ``DTensor`` with Shard /
Replicate placements, torch's own ``ShardedTensor``), the take's checks that the ranks' main
replicas cover each tensor once, the commit's merge of every rank's entries, and the checks
around reading a region (whose geometry is :mod:`snapshot._engine.handlers.geometry`'s).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from manifest import ShardedTensorEntry
from snapshot._engine.format.serialization import LocationCheck, WholeCheck
from snapshot._engine.handlers.geometry import Piece, Region, cover_problem, find_overlap
from snapshot.errors import (
    CorruptSnapshotError,
    ShapeMismatchError,
    SnapshotError,
    StateMismatchError,
    UnsupportedValueError,
)
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
    """What a rank holds of one global tensor: its name, dtype and shape, and its pieces (one
    for our ``ShardedTensor`` and a ``DTensor``; any number, none included, for torch's
    ``ShardedTensor``, whose ranks may hold several shards or none)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[LocalPiece, ...]


# A DTensor, and torch's own ShardedTensor (FSDP1's SHARDED_STATE_DICT, torchrec; its base class
# holds the shards and their metadata): (module, type).
_DTENSOR = ("torch.distributed.tensor", "DTensor")
_TORCH_SHARDED = ("torch.distributed._shard.sharded_tensor.api", "ShardedTensorBase")


def _loaded(module: str, name: str) -> type:
    """The type ``name`` of ``module``, or our ShardedTensor while the module is not imported (no
    instance exists before: looking it up costs nothing, where importing it would make the
    first take pay for importing torch.distributed.tensor)."""
    return getattr(sys.modules.get(module), name, ShardedTensor)


def is_sharded(value: object) -> bool:
    """Whether ``value`` is stored as pieces of a global tensor."""
    return isinstance(value, (ShardedTensor, _loaded(*_DTENSOR), _loaded(*_TORCH_SHARDED)))


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
    if isinstance(value, _loaded(*_DTENSOR)):
        return _dtensor_held(path, logical, value)
    # Torch's ShardedTensor: each local shard a piece (torch checks that they lie within its
    # shape and agree with their tensors). It has no replicas: each shard in its metadata is
    # placed on one rank, which holds it as a local shard, so every local shard is a main
    # replica (two ranks holding the same box, as two replica groups of HSDP would, fail the
    # coverage check).
    metadata = value.metadata()
    pieces = tuple(
        LocalPiece(
            tuple(shard.metadata.shard_offsets),
            tuple(shard.metadata.shard_sizes),
            shard.tensor,
            True,
        )
        for shard in value.local_shards()
    )
    return Held(logical, metadata.tensor_properties.dtype, tuple(metadata.size), pieces)


def _dtensor_held(path: str, logical: str, value: Any) -> Held:
    """A DTensor's one piece; the copy at coordinate 0 of each Replicate axis is the main one."""
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
    piece = LocalPiece(tuple(offsets), tuple(sizes), value.to_local(), main)
    return Held(logical, value.dtype, shape, (piece,))


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
    # Our ShardedTensor gives back its (filled) data; a DTensor and torch's ShardedTensor
    # themselves, their local tensors filled in place.
    return regions, target.data if isinstance(target, ShardedTensor) else target


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


def checks_for(path: str, planned: Sequence[Piece], verify: bool) -> dict[tuple[str, int], Any]:
    """One check per chunk that ``planned`` reads whole (in however many pieces): a chunk
    read in part cannot be checked against its recorded CRC-32. The pieces must tile the
    chunk, each starting where the one before ends: regions of several local shards of one
    target, read through their gaps, may read some stored bytes twice."""
    covered: dict[tuple[str, int], list[Piece]] = {}
    for p in planned:
        covered.setdefault((p.chunk.blob, p.chunk.offset), []).append(p)
    checks = {}
    for key, found in covered.items():
        end = 0  # where the pieces so far end, while they tile the chunk from its start; else -1
        for p in sorted(found, key=lambda p: p.lo):
            end = end + p.nbytes if p.lo == end else -1
        chunk = found[0].chunk
        if verify and chunk.crc32 is not None and end == chunk.nbytes:
            checks[key] = (
                WholeCheck(path, chunk)
                if len(found) == 1
                else LocationCheck(path, chunk, len(found))
            )
    return checks


def verifier(checks: Mapping[tuple[str, int], Any], p: Piece) -> Any:
    """The ``verify`` of a piece's need: its part of its chunk's check, if the chunk has one."""
    check = checks.get((p.chunk.blob, p.chunk.offset))
    if check is None or isinstance(check, WholeCheck):
        return check
    return functools.partial(check.add, p.lo, p.nbytes)
