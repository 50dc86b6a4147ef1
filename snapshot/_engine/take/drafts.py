"""What planning a take makes of the leaves: byte payloads that need a place in a blob, and the
drafts of the entries that record them, completed once placement has given each payload its
location and the writes (or staging) their CRC-32s.

Plain records: nothing here places, stages or writes (``placement``, ``stage`` and ``take``
do), and nothing here looks at a value's kind (``handlers``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from manifest import (
    Entry,
    EntryFormatter,
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


def type_name(value: object) -> str:
    """A value's type as error messages and object entries name it (``dict``,
    ``collections.OrderedDict``)."""
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


@dataclass(frozen=True)
class Layout:
    """Where payloads go: tensors above ``chunk_bytes`` are split into chunks of about that
    size, each a blob; payloads up to ``slab_threshold_bytes`` are packed into slabs of about
    ``slab_bytes``; the rest get a blob each. With ``checksums``, every location's CRC-32 is
    computed as it is written."""

    chunk_bytes: int
    slab_threshold_bytes: int
    slab_bytes: int
    checksums: bool = True
    # Names this take's blobs apart from any other take's at the same path (rank 0's, for
    # every rank: ``take._agree_layout``), so that two takes racing at one path never write
    # into each other's blobs; the one whose manifest lands first wins (``commit.commit``).
    # Not compared across ranks: each rank makes its own before the first agreement.
    take_id: str = field(default="", compare=False)


class Payload:
    """Bytes that need a place in a blob: a tensor chunk, or an object's serialized bytes.

    ``logical`` and ``index`` (the chunk's position in its tensor) identify a replicated payload
    across ranks. The bytes come from one of: ``tensor``, a contiguous CPU tensor whose memory
    is viewed at ``address`` (the common case, no copy; the address is read while planning:
    staging follows within the same call, with none of the application's code running in
    between, so the memory cannot have moved); ``data``, a bytes object; ``source``, a tensor
    that must be resolved or gathered first (elements ``start:stop``), which allocates
    ``staging_bytes`` when staged. Placement sets ``blob`` and ``pos`` (the
    offset in that blob). ``crc32`` is the bytes' CRC-32 when staging computed it (a slab's
    members); else the write's checksum of the range, if any, is the pipeline's.

    Staging (``stage``) gives, on the caller's thread, buffers to write from and what must stay
    alive while they are written (``stage.stage_payload``), or copies the bytes into a pooled
    staging buffer, for async take (``stage.copy_payload``).

    A plain class with slots rather than a dataclass: a take of many small tensors makes one
    per tensor, and a dataclass's keyword-argument constructor costs more per call.
    """

    __slots__ = (
        "address",
        "blob",
        "crc32",
        "data",
        "index",
        "label",
        "logical",
        "nbytes",
        "pos",
        "replicated",
        "source",
        "staging_bytes",
        "start",
        "stop",
        "tensor",
    )

    def __init__(
        self,
        logical: str,
        index: int,
        nbytes: int,
        label: str,
        replicated: bool,
        tensor: torch.Tensor | None = None,
        address: int = 0,
        data: bytes | None = None,
        source: TensorSource | None = None,
        start: int = 0,
        stop: int = 0,
    ) -> None:
        self.logical = logical
        self.index = index
        self.nbytes = nbytes
        self.label = label
        self.replicated = replicated
        self.tensor = tensor
        self.address = address
        self.data = data
        self.source = source
        self.start = start
        self.stop = stop
        self.staging_bytes = nbytes if source is not None else 0
        self.blob: str | None = None
        self.pos = 0
        self.crc32: int | None = None

    def location(self, crc32: int | None = None) -> Location:
        """Where placement put the bytes, as the manifest records it."""
        assert self.blob is not None
        return new_location(self.blob, self.pos, self.nbytes, crc32)


class TensorSource:
    """The bytes of one tensor that cannot simply be viewed (those are viewed by their
    ``Payload``): prepared, conjugate or negated views, non-contiguous, on a device. Its payloads
    hand its bytes out piece by piece (element ranges) at staging time (``stage``), which does
    what needs the whole tensor first (the prepare function, resolving a lazy conjugate or
    negation) once, at the first piece, and keeps the result in ``base`` until the last piece
    this rank stages (``remaining``, counted as its payloads are placed).
    """

    __slots__ = ("base", "dtype", "logical", "path", "prepare", "remaining", "shape", "tensor")

    def __init__(
        self,
        path: str,
        logical: str,
        tensor: torch.Tensor,
        prepare: PrepareFunc | None,
        dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> None:
        self.path = path
        self.logical = logical
        self.tensor = tensor
        self.prepare = prepare
        self.dtype = dtype
        self.shape = shape
        self.remaining = 0  # pieces this rank will stage; counted as they are placed
        self.base: torch.Tensor | None = None


@dataclass(slots=True)
class TensorDraft:
    dtype: str
    shape: tuple[int, ...]
    payloads: list[Payload]
    replicated: bool

    def build(self, checksums: Mapping[tuple[str, int], int] | None) -> TensorEntry:
        payloads = self.payloads
        if len(payloads) == 1:
            chunks: tuple[Location, ...] = (final(payloads[0], checksums),)
        else:
            chunks = tuple(final(p, checksums) for p in payloads)
        return new_tensor_entry(self.dtype, self.shape, chunks, self.replicated)

    def line(
        self, path: str, checksums: Mapping[tuple[str, int], int] | None, fmt: EntryFormatter
    ) -> str:
        """The entry's manifest line; a tensor in one range is formatted from its fields."""
        payloads = self.payloads
        if len(payloads) != 1:
            return fmt.entry(path, self.build(checksums))
        p = payloads[0]
        assert p.blob is not None
        return fmt.tensor(
            path, self.dtype, self.shape, p.blob, p.pos, p.nbytes, crc(p, checksums),
            self.replicated,
        )  # fmt: skip


class WholeTensor(Payload):
    """A tensor written whole in one range from its own memory (a contiguous CPU tensor of at
    most a chunk: nearly every tensor): its payload and its entry's draft in one record. A take
    of 20,000 small tensors makes 20,000 of them; a payload and a draft apart cost twice the
    objects and calls."""

    __slots__ = ("dtype", "shape")

    # Fields that are the same for every whole tensor, as class attributes (read-only on
    # instances): four stores less per tensor. (``start`` and ``stop`` belong to a source's
    # payloads only, and are never read for a whole tensor.)
    index = 0  # type: ignore[assignment]
    data = None  # type: ignore[assignment]
    source = None  # type: ignore[assignment]
    staging_bytes = 0  # type: ignore[assignment]

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
        # Each slot set here rather than through Payload.__init__: one call less per tensor.
        self.logical = logical
        self.nbytes = nbytes
        self.label = path
        self.replicated = replicated
        self.tensor = tensor
        self.address = address
        self.blob = None
        self.pos = 0
        self.crc32 = None
        self.dtype = dtype
        self.shape = shape

    def build(self, checksums: Mapping[tuple[str, int], int] | None) -> TensorEntry:
        return new_tensor_entry(self.dtype, self.shape, (final(self, checksums),), self.replicated)

    def line(
        self, path: str, checksums: Mapping[tuple[str, int], int] | None, fmt: EntryFormatter
    ) -> str:
        """Its manifest line (``TakePlan.early_entries`` formats most of them inline)."""
        assert self.blob is not None
        return fmt.tensor(
            path, self.dtype, self.shape, self.blob, self.pos, self.nbytes,
            crc(self, checksums), self.replicated,
        )  # fmt: skip


@dataclass(slots=True)
class ObjectDraft:
    serializer: str
    obj_type: str
    payload: Payload
    replicated: bool

    def build(self, checksums: Mapping[tuple[str, int], int] | None) -> ObjectEntry:
        return ObjectEntry(
            serializer=self.serializer,
            obj_type=self.obj_type,
            location=final(self.payload, checksums),
            replicated=self.replicated,
        )


def payloads_of(draft: TensorDraft | WholeTensor) -> list[Payload]:
    """The payloads of a tensor's draft."""
    return [draft] if type(draft) is WholeTensor else draft.payloads  # type: ignore[union-attr]


def crc(p: Payload, checksums: Mapping[tuple[str, int], int] | None) -> int | None:
    """A placed payload's CRC-32: from staging, or else from its write's ``checksums`` (None
    when the take records none; a write that never reported one is a bug: KeyError)."""
    if p.crc32 is not None or checksums is None:
        return p.crc32
    assert p.blob is not None
    return checksums[(p.blob, p.pos)]


def final(p: Payload, checksums: Mapping[tuple[str, int], int] | None) -> Location:
    """A placed payload's location as the manifest records it, with its CRC-32 (``crc``)."""
    return p.location(crc(p, checksums))


@dataclass(slots=True)
class ShardDraft:
    """A rank's pieces of a global tensor: its entry lists the shards this rank wrote (none
    for a replica that is not the main one, or on a rank holding no shard of a torch
    ShardedTensor; several for one holding several); the commit merges every rank's shards."""

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


@dataclass(slots=True)
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
    Entry
    | TensorDraft
    | WholeTensor
    | ObjectDraft
    | ShardDraft
    | ShardedObjectDraft
    | sharded.ObjectReplica
)
