"""The records a take plans with: byte payloads (``Payload``, ``WholeTensor``, ``TensorSource``)
and the drafts of manifest entries they complete (``TensorDraft``, ``ObjectDraft``, ``ShardDraft``,
``ShardedObjectDraft``), shared by the planner and the kinds of values."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from manifest import (
    Entry,
    Location,
    ObjectEntry,
    Shard,
    ShardedObjectEntry,
    ShardedTensorEntry,
    TensorEntry,
    new_location,
    new_tensor_entry,
)
from snapshot._engine.format.serialization import dtype_name
from snapshot._engine.handlers import sharded
from storage_plugins import Buffer

# (logical_path, tensor, tracing) -> tensor to write; see Snapshot.take.
PrepareFunc = Callable[[str, torch.Tensor, bool], torch.Tensor]

# What a write request's ``stage`` returns: the buffers to write, and what keeps them valid.
Staged = tuple[Sequence[Buffer], object]

# Slab members start at multiples of this, so a staging buffer's slice for any member can be
# viewed as the member's dtype (complex128, the widest, is 16 bytes).
ALIGN = 16


# ---------------------------------------------------------------------------------------------
# Payloads and drafts.


def type_name(value: object) -> str:
    """A value's type as messages and object entries name it (``collections.OrderedDict``)."""
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


@dataclass(frozen=True)
class Layout:
    """Where payloads go: tensors above ``chunk_bytes`` are split into chunks; payloads up to
    ``slab_threshold_bytes`` are packed into slabs of about ``slab_bytes``; the rest get a blob
    each. ``take_id`` (rank 0's) names the take's blobs apart from any other take's at the path."""

    chunk_bytes: int
    slab_threshold_bytes: int
    slab_bytes: int
    checksums: bool = True
    take_id: str = field(default="", compare=False)


@dataclass(slots=True, eq=False)
class Payload:
    """Bytes that need a place in a blob: a tensor chunk, or an object's serialized bytes.

    ``logical`` and ``index`` (the chunk's position in its tensor) identify a replicated payload
    across ranks. The bytes are one of: ``tensor``, a contiguous CPU tensor viewed at
    ``address`` (staged within the same call: its memory cannot have moved); ``data``; elements
    ``start:stop`` of ``source``. Placement sets ``blob`` and ``pos``; staging sets ``crc32`` of
    a slab's members (the others' are their write's checksums).
    """

    logical: str
    index: int
    nbytes: int
    label: str
    replicated: bool
    tensor: torch.Tensor | None = None
    address: int = 0
    data: bytes | None = None
    source: TensorSource | None = None
    start: int = 0
    stop: int = 0
    blob: str | None = field(default=None, init=False)
    pos: int = field(default=0, init=False)
    crc32: int | None = field(default=None, init=False)

    @property
    def staging_bytes(self) -> int:  # the memory staging allocates for it
        return self.nbytes if self.source is not None else 0

    def location(self, checksums: Mapping[tuple[str, int], int] | None) -> Location:
        """Where placement put the bytes, with their CRC-32 (``crc``)."""
        assert self.blob is not None
        return new_location(self.blob, self.pos, self.nbytes, crc(self, checksums))


def crc(p: Payload, checksums: Mapping[tuple[str, int], int] | None) -> int | None:
    """A placed payload's CRC-32: from staging, else from its write's ``checksums`` (None when
    the take records none)."""
    if p.crc32 is not None or checksums is None:
        return p.crc32
    assert p.blob is not None
    return checksums[(p.blob, p.pos)]


@dataclass(slots=True, eq=False)
class TensorSource:
    """A tensor whose bytes cannot simply be viewed (prepared, conjugate or negated, not
    contiguous, on a device): staging resolves it at its first piece, into ``base``, and drops
    that after the last piece this rank stages (``remaining``, counted as placed)."""

    path: str
    logical: str
    tensor: torch.Tensor
    prepare: PrepareFunc | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    remaining: int = 0
    base: torch.Tensor | None = None


class WholeTensor(Payload):
    """A tensor written whole in one range from its own memory (a contiguous CPU tensor of at
    most a chunk: nearly every tensor): its payload and its entry's draft in one record."""

    __slots__ = ("dtype", "shape")

    def __init__(
        self,
        logical: str,
        path: str,
        tensor: torch.Tensor,
        address: int,
        nbytes: int,
        dtype: str,
        shape: tuple[int, ...],
        replicated: bool,
    ) -> None:
        super().__init__(logical, 0, nbytes, path, replicated, tensor=tensor, address=address)
        self.dtype = dtype
        self.shape = shape

    @property
    def payloads(self) -> list[Payload]:
        return [self]

    def build(self, checksums: Mapping[tuple[str, int], int] | None) -> TensorEntry:
        return new_tensor_entry(
            self.dtype, self.shape, (self.location(checksums),), self.replicated
        )


@dataclass(slots=True, eq=False)
class TensorDraft:
    """A tensor's entry whose bytes are in several payloads, or shared with another leaf."""

    dtype: str
    shape: tuple[int, ...]
    payloads: list[Payload]
    replicated: bool

    def build(self, checksums: Mapping[tuple[str, int], int] | None) -> TensorEntry:
        chunks = tuple(p.location(checksums) for p in self.payloads)
        return new_tensor_entry(self.dtype, self.shape, chunks, self.replicated)


@dataclass(slots=True, eq=False)
class ObjectDraft:
    serializer: str
    obj_type: str
    payload: Payload
    replicated: bool

    def build(self, checksums: Mapping[tuple[str, int], int] | None) -> ObjectEntry:
        return ObjectEntry(
            serializer=self.serializer,
            obj_type=self.obj_type,
            location=self.payload.location(checksums),
            replicated=self.replicated,
        )


@dataclass(slots=True, eq=False)
class ShardDraft:
    """A rank's pieces of a global tensor: its entry lists the shards this rank wrote (none
    for a replica that is not the main one); the commit merges every rank's shards."""

    held: sharded.Held
    written: list[tuple[sharded.LocalPiece, TensorEntry | TensorDraft | WholeTensor]]

    def build(self, checksums: Mapping[tuple[str, int], int] | None) -> ShardedTensorEntry:
        shards = []
        for p, t in self.written:
            if not isinstance(t, TensorEntry):
                t = t.build(checksums)
            shards.append(Shard(offsets=p.offsets, sizes=p.sizes, chunks=t.chunks))
        h = self.held
        return ShardedTensorEntry(
            key=h.key, dtype=dtype_name(h.dtype), shape=h.shape, shards=tuple(shards)
        )


@dataclass(slots=True, eq=False)
class ShardedObjectDraft:
    """A sharded object this rank writes (its main replica)."""

    key: str
    draft: ObjectDraft

    def build(self, checksums: Mapping[tuple[str, int], int] | None) -> ShardedObjectEntry:
        obj = self.draft.build(checksums)
        return ShardedObjectEntry(
            key=self.key, serializer=obj.serializer, obj_type=obj.obj_type, location=obj.location
        )


# The draft of a tensor leaf's entry that has bytes.
Draft = TensorDraft | WholeTensor
# What planning records at a path: an entry made at once (a container, a primitive, an empty
# tensor; a sharded object's replica, which the commit fills in), or a draft completed once its
# payloads are written.
Planned = (
    Entry | TensorDraft | WholeTensor | ObjectDraft | ShardDraft | ShardedObjectDraft
    | sharded.ObjectReplica
)  # fmt: skip

# What a rank's part of the manifest holds at a path: an entry, a tensor's manifest line, or a
# sharded object's replica (the commit replaces it with the writer's entry).
Made = Entry | str | sharded.ObjectReplica


def payloads_of(draft: Draft) -> list[Payload]:  # the payloads of a tensor's draft
    return draft.payloads
