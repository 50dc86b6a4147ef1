"""Pieces of a global tensor (DTensor, torch's ShardedTensor, snapshot.sharding.ShardedTensor):
each rank writes the pieces whose main replica it holds; a restore reads the boxes of the stored
pieces that the target's regions cover."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch

from manifest import Shard, ShardedTensorEntry, new_tensor_entry
from snapshot._engine.format.serialization import dtype_from_name, dtype_name, raw_memoryview
from snapshot._engine.handlers import geometry, sharded
from snapshot._engine.handlers.dense import check_tensor_target, is_dense_tensor, take_tensor
from snapshot._engine.handlers.table import Kind, ReadPlanner, ShardDraft, TakeSink, TensorLayout
from snapshot._engine.restore.reads import (
    Landing,
    Need,
    ScratchPool,
    TensorRead,
    allocate,
    check_target,
    direct_need,
    lands_directly,
    tile_limit,
    tile_need,
)

# Scratch of one box of a sharded read through its gaps: small enough to be in the CPU's cache
# when it is copied into place.
BOX_BYTES = 4 << 20


def plan_sharded_read(
    reader: ReadPlanner, path: str, entry: ShardedTensorEntry, target: Any
) -> TensorRead:
    """Needs for a target's regions of a sharded tensor: the target's own piece(s) when it is a
    sharded value (resharded from whatever shards were stored), else the whole tensor into a
    plain tensor target (cast like ``copy_``) or a new one.

    Only the stored bytes overlapping a region are read, run by run: into the destination's
    memory when it is a contiguous CPU tensor of the stored dtype, else through scratch tiles
    copied in by the reader's ``landing`` (``tile_need``). An overlap of many runs with gaps of
    at most ``gap_bytes`` (a column block of a row-sharded tensor) is read through its gaps in
    boxes of scratch from the reader's pool, each moved into place by one strided copy. Chunks
    read whole are checked against their CRC-32s; a chunk read in part cannot be.
    """
    piece_bytes, landing = reader.piece_bytes, reader.landing
    box_bytes = min(reader.tile_bytes, BOX_BYTES)
    dtype = dtype_from_name(entry.dtype, path)
    sharded.check_entry(path, entry, dtype)
    whole = ((0,) * len(entry.shape), tuple(entry.shape))
    if sharded.is_sharded(target):
        regions, result = sharded.target_regions(path, entry, target)
    elif isinstance(target, torch.Tensor) and is_dense_tensor(target):
        regions, result = [(whole, target)], target
    else:
        result = allocate(path, entry.nbytes, lambda: torch.empty(entry.shape, dtype=dtype))
        regions = [(whole, result)]
    planned: list[tuple[torch.Tensor, list[geometry.Piece], list[geometry.Box]]] = []
    pieces: list[geometry.Piece] = []  # every region's
    for region, dest in regions:
        # The region's tensor: the shape of the region, and its memory able to take the values.
        check_target(path, new_tensor_entry(entry.dtype, region[1], ()), dest, dtype)
        # Into the region's memory the pieces may be as long as a read request; through
        # scratch, as long as a tile.
        step = piece_bytes
        if not lands_directly(dest, dtype):
            step = tile_limit(dest, min(piece_bytes, reader.tile_bytes))
            landing.prepare(dest)
        direct, boxes = geometry.plan_region(
            entry, region, dtype.itemsize, step, reader.gap_bytes, box_bytes
        )
        planned.append((dest, direct, boxes))
        pieces.extend([*direct, *(p for box in boxes for p in box.pieces)])
    # One check per stored chunk over every region's pieces: a chunk that two local shards of
    # a torch ShardedTensor target read in parts is still read whole, and checked.
    checks = sharded.checks_for(path, pieces, reader.verify)
    needs: list[Need] = []
    for dest, direct, boxes in planned:
        # A piece lands straight in the region's memory when it can take raw bytes; else
        # through a scratch tile of its own, taken when its read is about to run (charged to
        # the read budget) and copied in once landed.
        for p in direct:
            if lands_directly(dest, dtype):
                need = direct_need(path, p.chunk, p.lo, p.nbytes, dest.data_ptr() + p.dest)
            else:
                first = p.dest // dtype.itemsize
                need = tile_need(path, p.chunk, p.lo, p.nbytes, first, dtype, dest, landing)
            need.verify = sharded.verifier(checks, p)
            needs.append(need)
        for box in boxes:
            needs.extend(_box_needs(path, dtype, dest, box, checks, reader.scratch, landing))
    return TensorRead(needs=needs, result=result)


def _box_needs(
    path: str,
    dtype: torch.dtype,
    dest: torch.Tensor,
    box: geometry.Box,
    checks: Mapping[tuple[str, int], Any],
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

    def into(p: geometry.Piece) -> memoryview:
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
            verify=sharded.verifier(checks, p),
        )
        for p in box.pieces
    ]


class ShardedTensorKind(Kind):
    """Each piece of the global tensor that this rank holds as its main replica is written as a
    tensor of its own (``dense.take_tensor``; never deduplicated against other ranks), and every
    piece, written or not, is listed for the check that the ranks' pieces cover the tensor
    (``sharded.check_coverage``). A restore fills the target's regions (its own piece of a
    ShardedTensor or DTensor, each local shard of torch's ShardedTensor; a whole plain tensor, or
    a new one) from whatever shards were stored (``plan_sharded_read``). No type of its own to be
    found by: asked by ``accepts``, after the dense kind."""

    name = "sharded_tensor"
    entry_types = (ShardedTensorEntry,)
    merged_types = (ShardedTensorEntry,)

    def accepts(self, value: Any) -> bool:
        return sharded.is_sharded(value)

    def take(
        self, sink: TakeSink, path: str, logical: str, value: Any, replicated: bool
    ) -> ShardDraft:
        held = sharded.held(path, logical, value)
        written: list[tuple[sharded.LocalPiece, Any]] = []
        dtype = dtype_name(held.dtype)
        for piece in held.pieces:
            sink.out.pieces.append(
                (held.key, dtype, held.shape, piece.offsets, piece.sizes, piece.main, path)
            )
            if piece.main:
                written.append((piece, take_tensor(sink, path, logical, piece.data, False)))
        return ShardDraft(held=held, written=written)

    def restore(
        self, reader: ReadPlanner, path: str, entry: ShardedTensorEntry, target: Any
    ) -> None:
        """Its needs write the live state when the target is a tensor or a piece of one."""
        reader.claim()
        read = plan_sharded_read(reader, path, entry, target)
        reader.add_needs(read.needs, into_target=not self.allocates(entry, target))
        reader.tensors[path] = read.result

    def merge(self, entries: dict[str, Any]) -> None:
        """Replaces each rank's entry (the shards that rank wrote) by one listing every rank's
        shards of that tensor (each rank keeps its own entry, under the path it holds its
        piece at, so any rank reads any region)."""
        shards: dict[str, list[Shard]] = {}
        for entry in entries.values():
            if isinstance(entry, ShardedTensorEntry):
                shards.setdefault(entry.key, []).extend(entry.shards)
        full = {key: tuple(sorted(found, key=lambda s: s.offsets)) for key, found in shards.items()}
        for path, entry in entries.items():
            if isinstance(entry, ShardedTensorEntry):
                entries[path] = dataclasses.replace(entry, shards=full[entry.key])

    def check_target(self, label: str, entry: ShardedTensorEntry, target: Any) -> None:
        check_tensor_target(label, entry, target)

    def allocates(self, entry: Any, target: Any) -> bool:
        return not (is_dense_tensor(target) or sharded.is_sharded(target))

    def tensor_layout(self, path: str, entry: ShardedTensorEntry) -> TensorLayout:
        dtype = dtype_from_name(entry.dtype, path)
        sharded.check_entry(path, entry, dtype)
        return TensorLayout(
            dtype, entry.shape, [(s.offsets, s.sizes, s.chunks) for s in entry.shards]
        )


SHARDED_TENSOR = ShardedTensorKind()
