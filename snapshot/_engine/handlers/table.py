"""The contract between the engine and the kinds of values: the records a kind gives the take
(byte payloads, drafts of entries), the ``Kind`` ABC, what a kind may use of the take planner
(``TakeSink``) and the restore's loader (``ReadPlanner``), and the table of kinds."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

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
from snapshot._engine.format.serialization import WholeCheck, dtype_name
from snapshot._engine.restore.reads import Need, allocate
from storage_plugins import Buffer

if TYPE_CHECKING:
    from manifest.frames import Frame
    from snapshot._engine.handlers import sharded
    from snapshot._engine.restore.reads import Landing, ScratchPool
    from snapshot._engine.take.incremental import Reuse
    from snapshot._engine.take.plan import Collected


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
    each. ``take_id`` (rank 0's) names the take's blobs apart from any other take's at the path.
    ``zstd_level``: each payload is written compressed at that level (0: as it is)."""

    chunk_bytes: int
    slab_threshold_bytes: int
    slab_bytes: int
    checksums: bool = True
    zstd_level: int = 0
    take_id: str = field(default="", compare=False)


@dataclass(slots=True, eq=False)
class Payload:
    """Bytes that need a place in a blob: a tensor chunk, or an object's serialized bytes.

    ``logical`` and ``index`` (the chunk's position in its tensor) identify a replicated payload
    across ranks. The bytes are one of: ``tensor``, a contiguous CPU tensor viewed at
    ``address`` (staged within the same call: its memory cannot have moved); ``data``; elements
    ``start:stop`` of ``source``. Placement sets ``blob`` and ``pos``; staging sets ``crc32`` of
    a slab's members (the others' are their write's checksums); a compressed write sets both
    ``crc32`` and ``stored``, where its compressed bytes lie (``manifest.frames``).
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
    stored: Frame | None = field(default=None, init=False)

    @property
    def staging_bytes(self) -> int:  # the memory staging allocates for it
        return self.nbytes if self.source is not None else 0

    def location(self, checksums: Mapping[tuple[str, int], int] | None) -> Location:
        """Where placement put the bytes, with their CRC-32 (``crc``)."""
        assert self.blob is not None
        return new_location(self.blob, self.pos, self.nbytes, crc(self, checksums), self.stored)


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
    contiguous, on a device): staging resolves it into ``base`` at its first piece, and drops
    that after the last (``remaining``)."""

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


@dataclass(frozen=True)
class ObjectReplica:
    """In a rank's entries, a sharded object whose main replica another rank wrote: the
    commit replaces it with that rank's entry for ``key`` (its unique key)."""

    key: str
    replicated: bool = True


# The draft of a tensor leaf's entry that has bytes.
Draft = TensorDraft | WholeTensor
# What planning records at a path: an entry made at once (a container, a primitive, an empty
# tensor; a sharded object's replica, which the commit fills in), or a draft completed once its
# payloads are written.
Planned = (
    Entry | TensorDraft | WholeTensor | ObjectDraft | ShardDraft | ShardedObjectDraft
    | ObjectReplica
)  # fmt: skip

# What a rank's part of the manifest holds at a path: an entry, a tensor's manifest line, or a
# sharded object's replica (the commit replaces it with the writer's entry).
Made = Entry | str | ObjectReplica


class TakeSink(Protocol):
    """What the take planner (``take.plan.Collector``) offers a kind's ``take``: its settings,
    the tensors written so far by memory (``written``), what it collects (``out``), and
    where payloads go."""

    prepare: PrepareFunc | None
    chunk_bytes: int
    inline_max: int
    reuse: Reuse | None
    written: dict[int | tuple[Any, ...], Draft]
    views_possible: bool
    out: Collected

    def emit(self, payloads: list[Payload]) -> None:
        """Hands one value's payloads over, to be placed in blobs and written."""

    def leaf(self, path: str, logical: str, value: Any, replicated: bool) -> Planned:
        """The entry (or draft) of ``value`` by its own kind."""


class ReadPlanner(Protocol):
    """What the restore's loader (``restore.loader.Loader``) offers a kind's ``restore``: where
    values land (``tensors``; ``objects`` for anything else), the caller's CPU tensors filled
    by needs (``indirect``), a kind's own state (``kind_state``, by its name), and the calls
    that add reads."""

    entries: Mapping[str, Entry]
    verify: bool
    piece_bytes: int
    tile_bytes: int
    gap_bytes: int
    scratch: ScratchPool
    landing: Landing
    tensors: dict[str, Any]
    objects: dict[str, Any]
    indirect: list[tuple[str, torch.Tensor]]
    kind_state: dict[str, Any]

    def add_needs(self, needs: list[Need], *, into_target: bool) -> None:
        """Adds reads; ``into_target``: they write the caller's live state."""

    def add_direct(self, reads: list[tuple[str, Location, int]]) -> None:
        """Adds reads of whole chunks into the caller's CPU tensors: ``(path, chunk, address
        of the tensor's memory)`` each."""

    def claim(self) -> None:
        """Called before planning a read that allocates memory of a size the manifest claims."""

    def later(self, step: Callable[[], None]) -> None:
        """Runs ``step`` once every other read is planned."""


@dataclass(frozen=True)
class TensorLayout:
    """How an entry's values lie as one tensor (for export): its dtype and shape, and its
    boxes: ``(offsets, sizes, chunks)``, each box's bytes row-major in its chunks."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], tuple[Location, ...]]]


class Kind(ABC):
    """One kind of value: what a take makes of a value, and what a restore makes of its entry.

    A value is found by its exact type among ``value_types`` (confirmed by ``accepts``), else
    by ``accepts``; an entry by its type among ``entry_types``, confirmed by ``owns``. Either
    way the kind registered last is asked first.
    """

    name: ClassVar[str]
    value_types: tuple[type, ...] = ()
    entry_types: tuple[type[Entry], ...] = ()

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is of this kind (by default: an instance of ``value_types``)."""
        return isinstance(value, self.value_types)

    def owns(self, entry: Entry) -> bool:
        """Whether this kind restores ``entry`` (of one of ``entry_types``)."""
        return True

    @abstractmethod
    def take(
        self, sink: TakeSink, path: str, logical: str, value: Any, replicated: bool
    ) -> Planned:
        """The entry (or draft) recorded for ``value``; its payloads go to ``sink.emit``.

        Args:
            sink: the take being planned: ``emit`` takes payloads, ``prepare`` is the
                ``_custom_tensor_prepare_func``, ``chunk_bytes`` the chunk size.
            path: the manifest path (``"0/model/fc.weight"``), for error messages.
            logical: the path without the rank (what a prepare function is given).
            value: the value found at ``path``, one this kind ``accepts``.
            replicated: whether the value is the same on every rank (written once).

        Raises:
            UnsupportedValueError: the value cannot be stored, saying why.
        """

    @abstractmethod
    def restore(self, reader: ReadPlanner, path: str, entry: Any, target: Any) -> None:
        """Plans the reads that rebuild ``entry`` (into ``target`` where it can); the value is
        then ``reader.tensors[path]`` or ``reader.objects[path]``, or set by a read's
        ``done``."""

    def restore_all(self, reader: ReadPlanner, leaves: list[tuple[str, Any, Any]]) -> None:
        """``restore`` of each ``(path, entry, target)`` of ``leaves``, in order: the loader
        hands a kind the consecutive leaves it restores at once (a kind may plan them as one
        batch on ``reader``)."""
        for path, entry, target in leaves:
            self.restore(reader, path, entry, target)

    def check_target(self, label: str, entry: Any, target: Any) -> None:  # noqa: B027
        """Refuses (``StateMismatchError``, naming ``label``), before any read, a ``read_object``
        target this kind cannot fill in place with ``entry``; by default none is ever filled
        (it is ignored)."""

    def allocates(self, entry: Any, target: Any) -> bool:
        """Whether restoring ``entry`` into ``target`` (None: no target) takes memory of the size
        the manifest claims (its claims are then checked against the store first)."""
        return True

    def tensor_layout(self, path: str, entry: Any) -> TensorLayout | None:
        """The entry at ``path`` as one tensor, for export (None: not a tensor)."""
        return None

    def archived(self, entry: Any) -> bool:
        """Whether the entry's ranges hold ``torch.save`` archives (verify checks them): by
        default, an entry recording the ``torch_save`` serializer."""
        return getattr(entry, "serializer", None) == "torch_save"

    # The types of entries (or drafts) this kind rewrites once every rank's are together.
    merged_types: tuple[type, ...] = ()

    def merge(self, entries: dict[str, Any]) -> None:  # noqa: B027 (most kinds merge nothing)
        """Rewrites, in every rank's ``entries``, those of ``merged_types`` (the commit)."""

    # Helpers for kinds that store their value as bytes of their own.

    def write_bytes(
        self,
        sink: TakeSink,
        path: str,
        logical: str,
        data: bytes,
        replicated: bool,
        *,
        serializer: str = "bytes",
        obj_type: str = "bytes",
    ) -> ObjectDraft:
        """An object entry at ``path`` (``logical`` without the rank) whose bytes are ``data``
        (recorded with ``serializer``, ``obj_type``; ``replicated`` when every rank holds the
        same), its payload handed to ``sink``."""
        payload = Payload(logical, 0, len(data), path, replicated, data=data)
        sink.emit([payload])
        return ObjectDraft(serializer, obj_type, payload, replicated)

    def read_bytes(
        self, reader: ReadPlanner, path: str, location: Location, done: Callable[[bytes], Any]
    ) -> None:
        """Plans on ``reader`` the read of ``location`` (checked against its CRC-32 when reads
        verify); the value at ``path`` is then what ``done`` makes of its bytes."""
        reader.claim()
        reader.add_needs(
            [bytes_need(path, location, reader.objects, done, reader.verify)], into_target=False
        )


def bytes_need(
    path: str,
    location: Location,
    results: dict[str, Any],
    decode: Callable[[bytes], Any],
    verify: bool = True,
) -> Need:
    """The need of the bytes at ``location``; once they have landed (and, with ``verify``,
    passed their CRC-32), ``results[path]`` is what ``decode`` makes of them."""
    nbytes = location.nbytes
    buf: list[bytearray] = []

    def dest() -> memoryview:
        buf.append(allocate(path, nbytes, lambda: bytearray(nbytes)))
        return memoryview(buf[0])

    def done() -> None:
        results[path] = decode(bytes(buf.pop()))

    return Need(
        blob=location.blob,
        offset=location.offset,
        nbytes=nbytes,
        dest=dest,
        done=done,
        scratch_bytes=nbytes,
        label=path,
        verify=WholeCheck(path, location) if verify and location.crc32 is not None else None,
    )


class _Shared(Kind):
    """The kinds restoring one entry type, asked by ``owns`` (the one registered last first);
    the loader restores through it, ``for_entry`` answers with the owner itself."""

    name = "shared"

    def __init__(self, kinds: list[Kind]) -> None:
        self.kinds = kinds

    def owner(self, entry: Entry) -> Kind:
        for kind in self.kinds:
            if kind.owns(entry):
                return kind
        return self.kinds[-1]

    def take(
        self, sink: TakeSink, path: str, logical: str, value: Any, replicated: bool
    ) -> Planned:
        raise NotImplementedError("a shared entry type takes nothing")

    def restore(self, reader: ReadPlanner, path: str, entry: Any, target: Any) -> None:
        self.owner(entry).restore(reader, path, entry, target)


_kinds: list[Kind] = []  # in the order of registration; ``accepts`` is asked the other way
by_value_type: dict[type, Kind] = {}
# The kind restoring each entry type (a ``_Shared`` one where several kinds register it): a
# dict lookup, no call, on the restore's path.
by_entry_type: dict[type, Kind] = {}


def _index() -> None:
    """Both lookups from the kinds registered, a later kind taking a type over."""
    by_value_type.clear()
    entry_kinds: dict[type, list[Kind]] = {}
    for kind in _kinds:
        by_value_type.update(dict.fromkeys(kind.value_types, kind))
        for t in kind.entry_types:
            entry_kinds.setdefault(t, []).insert(0, kind)
    by_entry_type.clear()
    for t, kinds in entry_kinds.items():
        by_entry_type[t] = kinds[0] if len(kinds) == 1 else _Shared(kinds)


def register(kind: Kind) -> Callable[[], None]:
    """Adds ``kind`` to the table: its ``value_types`` take over those types from kinds
    registered earlier, and entries of its ``entry_types`` are offered to it (``owns``) first.
    Returns a function that undoes the registration."""
    _kinds.append(kind)
    _index()

    def undo() -> None:
        _kinds.remove(kind)
        _index()

    return undo


def for_value(value: Any) -> Kind:
    """The kind of a leaf value: by its exact type, else the kind registered last whose
    ``accepts`` does."""
    kind = by_value_type.get(type(value))
    if kind is not None and kind.accepts(value):
        return kind
    for kind in reversed(_kinds):
        if kind.accepts(value):
            return kind
    raise LookupError(f"no kind for a {type(value).__name__}")  # the object kind takes all


def merge_entries(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's entries in one mapping, rewritten by each kind (``Kind.merge``) one of
    whose ``merged_types`` is there."""
    merged: dict[str, Any] = {}
    found: set[type] = set()
    for part in parts:
        merged.update(part)
        found.update(map(type, part.values()))
    for kind in _kinds:
        if not found.isdisjoint(kind.merged_types):
            kind.merge(merged)
    return merged


def for_entry(entry: Entry) -> Kind | None:
    """The kind that restores ``entry`` (None for a container: ``flatten`` rebuilds those)."""
    kind = by_entry_type.get(type(entry))
    return kind.owner(entry) if isinstance(kind, _Shared) else kind
