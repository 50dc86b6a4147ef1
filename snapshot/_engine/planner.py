"""From flattened state to manifest entries and I/O requests (and back), without doing any I/O.

Take: each leaf of each ``state_dict()`` becomes an entry. Tensors and long values become byte
payloads placed in blobs: a large tensor is split into chunks of its own; small payloads are packed
into slabs, so thousands of biases make a few files. Each blob is one write request whose
``stage`` step runs later, on the caller's thread, under the scheduler's budget.

Restore and ``read_object``: each entry to load becomes byte-range needs that land in the target
tensor's memory when dtype and layout agree, or in budget-sized scratch tiles otherwise; needs
in the same blob that lie close together are merged into one scatter read.
"""

from __future__ import annotations

import ctypes
import fnmatch
import functools
import logging
import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import compress, repeat
from operator import attrgetter, is_
from typing import Any, TypeVar

import torch

from manifest import (
    Entry,
    EntryFormatter,
    Location,
    ObjectEntry,
    PickledTensorEntry,
    PrimitiveEntry,
    Shard,
    ShardedObjectEntry,
    ShardedTensorEntry,
    TensorEntry,
    TensorView,
    new_location,
    new_tensor_entry,
)
from snapshot._engine import device, sharded
from snapshot._engine.checksum import LocationCheck, WholeCheck, crc32
from snapshot._engine.flatten import flatten
from snapshot._engine.handlers.dense import is_dense_tensor
from snapshot._engine.landing import Landing, Tile
from snapshot._engine.requests import ReadRequest, Segment, WriteRequest
from snapshot._engine.restorable import check_object
from snapshot._engine.serialization import (
    ADDRESS_SPACE,
    DTYPES,
    as_copyable,
    decode_object,
    dtype_from_name,
    dtype_name,
    encode_object,
    gather_elements,
    range_views,
    raw_memoryview,
    scatter_into_flat,
    tensor_memoryview,
)
from snapshot._engine.staging import Lease, StagingPool
from snapshot._engine.tensor_memory import shares_memory, storage_shortfall
from snapshot.errors import (
    CorruptSnapshotError,
    ShapeMismatchError,
    SnapshotError,
    StateMismatchError,
    UnsupportedValueError,
)
from snapshot.sharding.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensorFactory,
    is_main_replica,
)
from storage_plugins import Buffer

logger = logging.getLogger(__name__)

# (logical_path, tensor, tracing) -> tensor to write; see Snapshot.take.
PrepareFunc = Callable[[str, torch.Tensor, bool], torch.Tensor]

_T = TypeVar("_T")

_INLINE_TYPES = (bool, int, float, type(None))


_DENSE_TYPES = (torch.Tensor, torch.nn.Parameter)
_TENSOR = torch.Tensor
_STRIDED = torch.strided


def _type_name(value: object) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# ---------------------------------------------------------------------------------------------
# Take.

# What a write request's ``stage`` returns: the buffers to write, and what keeps them valid.
Staged = tuple[Sequence[Buffer], object]


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

    Two ways to stage it, on the caller's thread: ``stage()`` gives buffers to write from, and
    what must stay alive while they are written; ``copy_into(buf, pos)`` copies the bytes into
    ``buf[pos : pos + nbytes]`` of a staging buffer ``buf`` (a 1-d uint8 CPU tensor), for
    async take.

    A plain class with slots rather than a dataclass: a take of many small tensors makes one
    per tensor, and the keyword-argument constructor of a dataclass costs twice as much.
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
        source: _TensorSource | None = None,
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

    def stage(self) -> Staged:
        t = self.tensor
        if t is not None:
            return [raw_memoryview(self.address, self.nbytes)], t
        if self.data is not None:
            return [self.data], None
        assert self.source is not None
        return self.source.piece(self.start, self.stop)

    def copy_into(self, buf: torch.Tensor, pos: int) -> None:
        t = self.tensor
        nbytes = self.nbytes
        if t is not None:
            if nbytes <= _MEMMOVE_MAX:
                # One memmove: slabs hold thousands, and a torch copy costs several
                # microseconds each.
                ctypes.memmove(buf.data_ptr() + pos, self.address, nbytes)
            else:  # torch's copy spreads the bytes over its threads
                src = raw_memoryview(self.address, nbytes)
                buf[pos : pos + nbytes].copy_(torch.frombuffer(src, dtype=torch.uint8))
        elif self.data is not None:
            ctypes.memmove(buf.data_ptr() + pos, self.data, nbytes)
        else:
            assert self.source is not None
            self.source.copy_into(self.start, self.stop, buf, pos)

    def location(self, crc32: int | None = None) -> Location:
        """Where placement put the bytes, as the manifest records it."""
        assert self.blob is not None
        return new_location(self.blob, self.pos, self.nbytes, crc32)


# Below this size a payload of a tensor is copied by one memmove call (about a microsecond of
# overhead); above it, torch's copy spreads the bytes over its threads.
_MEMMOVE_MAX = 1 << 20


@dataclass(slots=True)
class _TensorDraft:
    dtype: str
    shape: tuple[int, ...]
    payloads: list[Payload]
    replicated: bool

    def build(self, checksums: Mapping[tuple[str, int], int] | None) -> TensorEntry:
        payloads = self.payloads
        if len(payloads) == 1:
            chunks: tuple[Location, ...] = (_final(payloads[0], checksums),)
        else:
            chunks = tuple(_final(p, checksums) for p in payloads)
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
            path, self.dtype, self.shape, p.blob, p.pos, p.nbytes, _crc(p, checksums),
            self.replicated,
        )  # fmt: skip


class _WholeTensor(Payload):
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
        return new_tensor_entry(self.dtype, self.shape, (_final(self, checksums),), self.replicated)

    def line(
        self, path: str, checksums: Mapping[tuple[str, int], int] | None, fmt: EntryFormatter
    ) -> str:
        """Its manifest line (``TakePlan.early_entries`` formats most of them inline)."""
        assert self.blob is not None
        return fmt.tensor(
            path, self.dtype, self.shape, self.blob, self.pos, self.nbytes,
            _crc(self, checksums), self.replicated,
        )  # fmt: skip


@dataclass(slots=True)
class _ObjectDraft:
    serializer: str
    obj_type: str
    payload: Payload
    replicated: bool

    def build(self, checksums: Mapping[tuple[str, int], int] | None) -> ObjectEntry:
        return ObjectEntry(
            serializer=self.serializer,
            obj_type=self.obj_type,
            location=_final(self.payload, checksums),
            replicated=self.replicated,
        )


def _payloads(draft: _TensorDraft | _WholeTensor) -> list[Payload]:
    """The payloads of a tensor's draft."""
    return [draft] if type(draft) is _WholeTensor else draft.payloads  # type: ignore[union-attr]


def _crc(p: Payload, checksums: Mapping[tuple[str, int], int] | None) -> int | None:
    """A placed payload's CRC-32: from staging, or else from its write's ``checksums`` (None
    when the take records none; a write that never reported one is a bug: KeyError)."""
    if p.crc32 is not None or checksums is None:
        return p.crc32
    assert p.blob is not None
    return checksums[(p.blob, p.pos)]


def _final(p: Payload, checksums: Mapping[tuple[str, int], int] | None) -> Location:
    """A placed payload's location as the manifest records it, with its CRC-32 (``_crc``)."""
    return p.location(_crc(p, checksums))


@dataclass(slots=True)
class _ShardDraft:
    """A rank's pieces of a global tensor: its entry lists the shards this rank wrote (none
    for a replica that is not the main one, or on a rank holding no shard of a torch
    ShardedTensor; several for one holding several); the commit merges every rank's shards."""

    held: sharded.Held
    written: list[tuple[sharded.LocalPiece, TensorEntry | _TensorDraft | _WholeTensor]]

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
class _ShardedObjectDraft:
    """A sharded object this rank writes (its main replica)."""

    key: str
    draft: _ObjectDraft

    def build(self, checksums: Mapping[tuple[str, int], int] | None) -> ShardedObjectEntry:
        obj = self.draft.build(checksums)
        return ShardedObjectEntry(
            key=self.key, serializer=obj.serializer, obj_type=obj.obj_type, location=obj.location
        )


# The draft of a tensor leaf's entry that has bytes.
_Draft = _TensorDraft | _WholeTensor


@dataclass
class Collected:
    """A rank's state, flattened: entries (or drafts awaiting their payloads' locations) in
    flatten order; the replicated payloads, in the same order (placed once their writers are
    agreed on); the bytes of this rank's own payloads (placed as they were met; in a take
    across ranks, recorded, and placed once the first agreement has said which leaves are
    replicated: ``replication.settle``)."""

    entries: dict[str, Entry | _TensorDraft | _WholeTensor | _ObjectDraft | _ShardDraft] = field(
        default_factory=dict
    )
    replicated: list[Payload] = field(default_factory=list)
    own_bytes: int = 0
    # (key, dtype, global shape, offsets, sizes, main, path) of each piece of a global tensor
    pieces: list[tuple[Any, ...]] = field(default_factory=list)
    # (unique key, main, path) of each sharded object
    objects: list[tuple[str, bool, str]] = field(default_factory=list)
    # How many of this rank's own writes (``Placer.writes``) were handed to ``submit``.
    submitted: int = 0
    # What a tensor leaf's entry records beyond its bytes (``TensorEntry``), by path: whether
    # it was an ``nn.Parameter`` and required grad (only leaves with either set), and, for a
    # leaf whose elements lie in another leaf's memory, its view and that leaf's draft.
    grads: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    views: dict[str, tuple[TensorView, _Draft]] = field(default_factory=dict)


@dataclass
class TakePlan:
    """The writes this rank performs, and the entries for the manifest (in flatten order), to be
    built once the writes have reported their checksums (``entries``).

    ``shared`` are the replicated payloads this rank writes: the other ranks' entries point at
    them too, so their checksums are shared with every rank (``shared_checksums``).
    """

    drafts: dict[str, Entry | _TensorDraft | _WholeTensor | _ObjectDraft | _ShardDraft]
    writes: list[WriteRequest]
    shared: list[Payload]
    checksums: bool
    grads: dict[str, tuple[bool, bool]] = field(default_factory=dict)  # ``Collected``'s
    views: dict[str, tuple[TensorView, _Draft]] = field(default_factory=dict)  # ``Collected``'s

    def shared_checksums(
        self, checksums: Mapping[tuple[str, int], int]
    ) -> dict[tuple[str, int], int]:
        """The CRC-32 of each of ``shared``, by ``(blob, offset)``: from staging, or else from
        the writes' ``checksums``. Empty when the take records none."""
        if not self.checksums:
            return {}
        return {(p.blob, p.pos): _crc(p, checksums) for p in self.shared}  # type: ignore[misc]

    def early_entries(self) -> dict[str, Entry | str | None]:
        """The entries that need no CRC from a write (None in place of the others), made
        while the last writes finish: every whole tensor staged in a slab (checksummed then) or
        recorded without a CRC, and every entry already built. For ``entries``."""
        tensor = EntryFormatter(self.drafts.keys()).tensor
        sums = self.checksums
        out: dict[str, Entry | str | None] = {}
        for path, e in self.drafts.items():
            kind = type(e)
            if kind is _WholeTensor:  # most entries
                crc = e.crc32
                if crc is None and sums:  # written on its own, or by another rank
                    out[path] = None
                    continue
                out[path] = tensor(
                    path, e.dtype, e.shape, e.blob, e.pos, e.nbytes, crc, e.replicated
                )
            elif isinstance(e, (Entry, sharded.ObjectReplica)):
                out[path] = e
            else:
                out[path] = None
        if self.grads or self.views:
            self._attribute(out, None)
        return out

    def entries(
        self,
        checksums: Mapping[tuple[str, int], int],
        early: Mapping[str, Entry | str | None] | None = None,
    ) -> dict[str, Entry | str]:
        """The manifest's entries; ``checksums`` maps each written range ``(blob, offset)`` to
        its CRC-32 (ignored when the take records none); what ``early_entries`` made is
        taken from ``early`` (made here when not given), the rest is made now.

        A dense tensor's entry is given as its manifest line (``str``, see
        ``manifest.dumps_entries``): a take of many small tensors would otherwise build two
        records per tensor only to format them. The other entries are objects (rank 0 merges
        sharded ones across ranks).
        """
        sums = checksums if self.checksums else None
        made = early if early is not None else self.early_entries()
        # What is left to make, found by C-level passes (in a process alone, often nothing).
        todo = dict.fromkeys(compress(made, map(is_, made.values(), repeat(None))))
        out = dict(made)  # in flatten order
        fmt = EntryFormatter(todo.keys())
        drafts = self.drafts
        for path in todo:
            e = drafts[path]
            if type(e) in (_WholeTensor, _TensorDraft):
                out[path] = e.line(path, sums, fmt)  # type: ignore[union-attr]
            else:
                out[path] = e.build(sums)  # type: ignore[union-attr]
        if self.grads or self.views:
            self._attribute(out, sums)
        return out  # type: ignore[return-value]

    def _attribute(
        self,
        out: dict[str, Entry | str | None],
        checksums: Mapping[tuple[str, int], int] | None,
    ) -> None:
        """Makes the entry in ``out`` of each leaf with ``grads`` or ``views`` a ``TensorEntry``
        that records them (the line formatter writes plain tensors only). A path whose entry is
        not made yet (None), or that this rank does not list, is left as it is."""
        grads, views, drafts = self.grads, self.views, self.drafts
        for path in dict.fromkeys([*grads, *views]):
            if out.get(path) is None:
                continue
            draft = drafts[path]
            entry = draft if isinstance(draft, TensorEntry) else draft.build(checksums)  # type: ignore[union-attr]
            parameter, requires_grad = grads.get(path, (False, False))
            view = None
            if path in views:
                view, base = views[path]
                # A leaf listed once for every rank is read under each rank's prefix, where
                # its base is that rank's own leaf unless the base is listed once too.
                if entry.replicated and not base.replicated:
                    view = None
            out[path] = replace(entry, parameter=parameter, requires_grad=requires_grad, view=view)


class _Collector:
    """Flattens state dicts into entries and payloads (no placement yet)."""

    def __init__(
        self,
        rank: int,
        prepare: PrepareFunc | None,
        replicated: Sequence[str],
        inline_max_bytes: int,
        own: Placer | Recorder,
        submit: Callable[[WriteRequest], None] | None,
    ) -> None:
        self.rank = rank
        self.prepare = prepare
        self.replicated = tuple(replicated)
        self.inline_max = inline_max_bytes
        self.chunk_bytes = own.layout.chunk_bytes
        self.own = own
        self.submit = submit
        self.out = Collected()
        # Tensors already planned, by memory (see ``_tensor``): a contiguous CPU tensor by its
        # address, another by its address, device, dtype, shape, strides and flags.
        self._written: dict[int | tuple[Any, ...], _TensorDraft | _WholeTensor] = {}
        # Whether a leaf may be a view of another leaf's memory, other than the same view
        # (``relate`` looks only then): set by a CPU leaf that is a part of its storage, or is
        # not contiguous, or starts where another leaf of another dtype or shape does.
        self._views_possible = False

    def _is_replicated(self, logical: str) -> bool:
        return any(fnmatch.fnmatchcase(logical, g) for g in self.replicated)

    def _emit(self, payloads: list[Payload]) -> None:
        """Records one value's payloads. Those of this rank's own (not replicated: their
        writers are agreed on later) are placed at once, and with ``submit`` each write whose
        blob is complete is handed over at once, so writing goes on while the rest of the
        state is planned. A value's payloads are all placed before any of their writes is
        handed over: staging one releases a resolved tensor once all its placed pieces are
        staged."""
        out = self.out
        if payloads[0].replicated:
            out.replicated.extend(payloads)
            return
        own = self.own
        for p in payloads:
            out.own_bytes += p.nbytes
            own.place(p)
        if self.submit is not None and len(own.writes) > out.submitted:
            self._submit()

    def _submit(self) -> None:
        assert self.submit is not None
        writes, out = self.own.writes, self.out
        while out.submitted < len(writes):
            out.submitted += 1
            self.submit(writes[out.submitted - 1])

    def add(self, key_path: str, state: Any) -> None:
        rank_prefix = f"{self.rank}/"
        entries = self.out.entries
        cut = len(rank_prefix)
        check = bool(self.replicated)
        for path, node, value in flatten(state, rank_prefix + key_path):
            if node is None:
                replicated = check and self._is_replicated(path[cut:])
                # Most leaves: straight to the tensor path (``is_dense_tensor``, inline).
                if (
                    (kind := type(value)) in _DENSE_TYPES
                    and value.layout is _STRIDED
                    and not value.is_quantized
                    and not value.is_nested
                ):
                    entries[path] = self._tensor(path, path[cut:], value, replicated)
                    if kind is not _TENSOR or value.requires_grad:
                        self._grads(path, value)
                else:
                    entries[path] = self._leaf(path, path[cut:], value, replicated)
            else:
                # A container is never marked replicated, even where a glob matches it: each
                # rank's entries keep their own (they list other keys only where the states
                # differ), and only leaves are stored once for every rank.
                entries[path] = node

    def _leaf(
        self, path: str, logical: str, value: Any, replicated: bool
    ) -> Entry | _TensorDraft | _ObjectDraft | _ShardDraft:
        if isinstance(value, torch.Tensor) and is_dense_tensor(value):
            draft = self._tensor(path, logical, value, replicated)
            if type(value) is not _TENSOR or value.requires_grad:
                self._grads(path, value)
            return draft
        kind = type(value)
        if kind in _INLINE_TYPES:
            return PrimitiveEntry(value=value, replicated=replicated)
        if kind is str:
            try:
                data = value.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates: only pickle keeps them
                return self._object(path, logical, value, replicated)
            if len(data) <= self.inline_max:
                return PrimitiveEntry(value=value, replicated=replicated)
            return self._bytes_draft(path, logical, "utf8", "str", data, replicated)
        if kind is bytes:
            if len(value) <= self.inline_max:
                return PrimitiveEntry(value=value, replicated=replicated)
            return self._bytes_draft(path, logical, "bytes", "bytes", value, replicated)
        # The sharded kinds after the common ones: primitives pay none of these checks.
        if sharded.is_sharded(value):
            return self._sharded(path, logical, value)
        if isinstance(value, ShardedObject):
            return self._sharded_object(path, logical, value)
        if isinstance(value, ShardedTensorFactory):
            return self._expand(path, logical, value.build())
        if isinstance(value, LocalNonpersistentObject):
            # Kept on its rank, never saved: its place in the state is recorded as None, and a
            # restore puts the restoring rank's own object back there.
            return PrimitiveEntry(value=None)
        return self._object(path, logical, value, replicated)

    def _grads(self, path: str, tensor: torch.Tensor) -> None:
        """Records that a tensor leaf is an ``nn.Parameter`` or requires grad
        (``Collected.grads``). Not for a tensor given to a prepare function: what is written is
        the function's tensor, of its own dtype."""
        if self.prepare is None:
            self.out.grads[path] = (type(tensor) is not _TENSOR, tensor.requires_grad)

    def relate(self) -> None:
        """Records each tensor leaf on the CPU whose elements lie within the memory of another
        leaf of its storage and dtype that is written from its memory as it lies (a contiguous
        one), as a view of it (``Collected.views``): a read that builds new tensors then makes
        one storage of them, as ``torch.load`` does. Leaves holding the same view of one memory
        whose entries share their bytes (tied weights, on any device) need no record: a reader
        finds them by their equal locations. Negated or conjugate views hold other values than
        their memory, and are left alone; so is everything when a prepare function writes the
        tensors.

        Looked for only when planning met a leaf that may be such a view (``_views_possible``),
        from the drafts: the spans of memory the leaves read are sorted in C, and only leaves
        whose spans overlap are looked at further."""
        if self.prepare is not None or not self._views_possible:
            return
        entries = self.out.entries
        drafts = list(entries.values())
        whole = list(map(is_, map(type, drafts), repeat(_WholeTensor)))
        paths = list(compress(entries, whole))
        found = list(compress(drafts, whole))
        # (Arrays made from lists: made from iterators, they were filled item by item.)
        starts = array("q", list(map(_ADDRESS, found)))
        sizes = array("q", list(map(_NBYTES, found)))
        # The other tensor drafts with bytes: tied leaves, large or gathered tensors (few).
        others = map(is_, map(type, drafts), repeat(_TensorDraft))
        for path, draft in compress(entries.items(), others):
            span = _span(draft)
            if span is not None:
                paths.append(path)
                found.append(draft)
                starts.append(span[0])
                sizes.append(span[1] - span[0])
        for group in _overlapping(starts, sizes):
            storages: dict[tuple[Any, ...], list[tuple[str, torch.Tensor, _Draft]]] = {}
            for i in group:
                t = _tensor_of(found[i])
                key = (t.untyped_storage().data_ptr(), t.device, t.dtype)
                storages.setdefault(key, []).append((paths[i], t, found[i]))
            for members in storages.values():
                if len(members) > 1:
                    self._relate(members)

    def _relate(self, members: list[tuple[str, torch.Tensor, _Draft]]) -> None:
        """``relate`` for the leaves of one storage, device and dtype: each leaf is taken in
        order of where its elements start (the widest first), and one lying within the span of
        the contiguous leaf reaching furthest so far is a view of that leaf. That leaf is not
        itself within another's: no view is of a view."""
        cut = len(f"{self.rank}/")
        spans = []
        for order, (path, t, draft) in enumerate(members):
            start = t.storage_offset()
            end = start + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
            spans.append((start, -end, order, path, t, draft))
        spans.sort(key=lambda s: s[:3])
        base: tuple[int, int, str, torch.Tensor, _Draft] | None = None
        views = self.out.views
        for start, neg_end, _, path, t, draft in spans:
            end = -neg_end
            if base is not None and end <= base[1]:
                b_start, _, b_path, b_tensor, b_draft = base
                same = (
                    start == b_start
                    and t.shape == b_tensor.shape
                    and t.stride() == b_tensor.stride()
                    and _payloads(draft)[0] is _payloads(b_draft)[0]
                )
                if not same:
                    view = TensorView(
                        base=b_path[cut:], offset=start - b_start, stride=tuple(t.stride())
                    )
                    views[path] = (view, b_draft)
            elif t.is_contiguous():
                base = (start, end, path, t, draft)

    def _sharded(self, path: str, logical: str, value: Any) -> _ShardDraft:
        """Pieces of a global tensor: each written by this rank when it holds its main
        replica, as a tensor of its own (never deduplicated against other ranks: each writes
        its pieces)."""
        held = sharded.held(path, logical, value)
        written: list[tuple[sharded.LocalPiece, Any]] = []
        for piece in held.pieces:
            if piece.data.dtype != piece.dtype or tuple(piece.data.shape) != piece.sizes:
                raise UnsupportedValueError(
                    f"{path}: the piece of {piece.key!r} holds a {dtype_name(piece.data.dtype)}"
                    f"{list(piece.data.shape)} tensor where {dtype_name(piece.dtype)}"
                    f"{list(piece.sizes)} was declared"
                )
            self.out.pieces.append(
                (
                    piece.key,
                    dtype_name(piece.dtype),
                    piece.shape,
                    piece.offsets,
                    piece.sizes,
                    piece.main,
                    path,
                )
            )
            if piece.main:
                written.append((piece, self._tensor(path, logical, piece.data, False)))
        return _ShardDraft(held=held, written=written)

    def _sharded_object(self, path: str, logical: str, value: ShardedObject) -> Any:
        """Written by the rank holding its main replica; the others' entries are filled in
        from that rank's at the commit."""
        key = value.unique_key
        main = is_main_replica(value.replica_id)
        self.out.objects.append((key, main, path))
        if not main:
            return sharded.ObjectReplica(key)
        return _ShardedObjectDraft(key=key, draft=self._object(path, logical, value.data, False))

    def _expand(self, path: str, logical: str, built: Any) -> Any:
        """What a factory built, in place of the factory: its leaves and containers under
        ``path``; returns the entry at ``path`` itself."""
        entries = self.out.entries
        cut = len(path) - len(logical)
        root = None
        for p, node, value in flatten(built, path):
            entry = node if node is not None else self._leaf(p, p[cut:], value, False)
            if p == path:
                root = entry
            entries[p] = entry
        return root

    def _object(self, path: str, logical: str, value: Any, replicated: bool) -> _ObjectDraft:
        try:
            data = encode_object(value)
        except Exception as e:
            raise UnsupportedValueError(
                f"{path}: cannot serialize a {_type_name(value)}: {type(e).__name__}: {e}"
            ) from e
        # A value a restore would refuse is refused now, not found out at restore time,
        # perhaps months later: the take fails rather than commit it.
        check_object(path, _type_name(value), data, tensor_subclass=isinstance(value, torch.Tensor))
        return self._bytes_draft(path, logical, "torch_save", _type_name(value), data, replicated)

    def _bytes_draft(
        self, path: str, logical: str, serializer: str, obj_type: str, data: bytes, replicated: bool
    ) -> _ObjectDraft:
        payload = Payload(logical, 0, len(data), path, replicated, data=data)
        self._emit([payload])
        return _ObjectDraft(
            serializer=serializer, obj_type=obj_type, payload=payload, replicated=replicated
        )

    def _tensor(
        self, path: str, logical: str, tensor: torch.Tensor, replicated: bool
    ) -> Entry | _TensorDraft | _WholeTensor:
        if (
            self.prepare is None
            and tensor.is_cpu
            and tensor.is_contiguous()
            and not tensor.is_neg()
            # Only a complex tensor can carry the conjugate bit.
            and not ((dtype := tensor.dtype).is_complex and tensor.is_conj())
        ):
            # The common case, kept lean (a take of 20,000 small tensors runs this 20,000
            # times): the tensor's own memory is written, through views.
            shape = tuple(tensor.shape)
            nbytes = tensor.nbytes
            name = dtype_name(dtype)
            if nbytes == 0:
                return TensorEntry(dtype=name, shape=shape, chunks=(), replicated=replicated)
            # Its bytes are read through its address: a storage that ends before them (freed,
            # as FSDP frees unsharded parameters) would be read out of bounds.
            # (``tensor_memory.storage_shortfall`` for a contiguous tensor, inline.)
            held = tensor.untyped_storage().nbytes()
            if held < tensor.storage_offset() * dtype.itemsize + nbytes:
                raise _without_memory(path, tensor)
            if held != nbytes:  # a part of its storage, which another leaf may hold too
                self._views_possible = True
            # The same memory under two paths (tied weights) is written once. It is found by
            # its address (a tuple key cost more to make and hash than checking a hit), and
            # another dtype or shape at an address known already by those too.
            address = tensor.data_ptr()
            key: int | tuple[Any, ...] = address
            earlier = self._written.get(address)
            if earlier is not None and (earlier.dtype != name or earlier.shape != shape):
                self._views_possible = True  # another view of the same memory (``relate``)
                key = (address, name, shape)
                earlier = self._written.get(key)
            if earlier is not None and earlier.replicated == replicated:
                return _TensorDraft(name, shape, _payloads(earlier), replicated)
            if nbytes <= self.chunk_bytes:
                whole = _WholeTensor(
                    logical, path, tensor, address, nbytes, name, shape, replicated
                )
                self._written[key] = whole
                # ``_emit`` of this one payload, inline (most payloads).
                out = self.out
                if replicated:
                    out.replicated.append(whole)
                    return whole
                out.own_bytes += nbytes
                own = self.own
                own.place(whole)
                if self.submit is not None and len(own.writes) > out.submitted:
                    self._submit()
                return whole
            itemsize = dtype.itemsize
            payloads = [
                Payload(
                    logical,
                    i,
                    (stop - start) * itemsize,
                    path,
                    replicated,
                    tensor=tensor,
                    address=address + start * itemsize,
                )
                for i, (start, stop) in enumerate(self._bounds(nbytes // itemsize, itemsize))
            ]
            self._emit(payloads)
            draft = _TensorDraft(name, shape, payloads, replicated)
            self._written[key] = draft
            return draft
        return self._tensor_source(path, logical, tensor, replicated)

    def _bounds(self, numel: int, itemsize: int) -> Sequence[tuple[int, int]]:
        """The element ranges of a tensor's chunks."""
        per_chunk = max(1, self.chunk_bytes // itemsize)
        if numel <= per_chunk:
            return ((0, numel),)
        return [(e, min(numel, e + per_chunk)) for e in range(0, numel, per_chunk)]

    def _tensor_source(
        self, path: str, logical: str, tensor: torch.Tensor, replicated: bool
    ) -> Entry | _TensorDraft:
        """A tensor whose bytes are not simply its memory: prepared, conjugate or negated
        views, non-contiguous, on a device (or on the meta device: refused)."""
        if tensor.is_meta:
            raise UnsupportedValueError(
                f"{path}: tensor is on the meta device and holds no data to snapshot"
            )
        if storage_shortfall(tensor) is not None:
            raise _without_memory(path, tensor)
        prepare = self.prepare
        if prepare is not None:
            traced = _call_prepare(prepare, path, logical, tensor, tracing=True)
            dtype, shape = traced.dtype, tuple(traced.shape)
            del traced
        else:
            dtype, shape = tensor.dtype, tuple(tensor.shape)
        name = dtype_name(dtype)
        itemsize = dtype.itemsize
        numel = math.prod(shape)
        if numel == 0:
            return TensorEntry(dtype=name, shape=shape, chunks=(), replicated=replicated)
        # Tied weights again; a conjugate or negated view of the same memory holds other
        # values, so those flags are part of the key.
        key = None
        if prepare is None:
            key = (
                tensor.data_ptr(),
                tensor.get_device(),
                dtype,
                shape,
                tensor.stride(),
                tensor.is_conj(),
                tensor.is_neg(),
            )
            earlier = self._written.get(key)
            if earlier is not None and earlier.replicated == replicated:
                return _TensorDraft(name, shape, _payloads(earlier), replicated)
            if key[1] < 0:  # on the CPU: perhaps a view of another leaf (``relate``)
                self._views_possible = True
        source = _TensorSource(path, logical, tensor, prepare, dtype, shape)
        payloads = [
            Payload(
                logical,
                i,
                (stop - start) * itemsize,
                path,
                replicated,
                source=source,
                start=start,
                stop=stop,
            )
            for i, (start, stop) in enumerate(self._bounds(numel, itemsize))
        ]
        self._emit(payloads)
        draft = _TensorDraft(name, shape, payloads, replicated)
        if key is not None:
            self._written[key] = draft
        return draft


def _without_memory(path: str, tensor: torch.Tensor) -> UnsupportedValueError:
    """The error for a tensor whose storage does not hold the elements it views (its bytes
    would be read out of bounds)."""
    needed, held = storage_shortfall(tensor) or (0, 0)
    return UnsupportedValueError(
        f"{path}: the {dtype_name(tensor.dtype)}{list(tensor.shape)} tensor views {needed} bytes "
        f"of a storage that holds {held}: its memory was freed or shrunk (as FSDP frees a "
        "parameter's unsharded storage); snapshot the tensors that hold the data"
    )


_ADDRESS = attrgetter("address")
_NBYTES = attrgetter("nbytes")


def _tensor_of(draft: _Draft) -> torch.Tensor:
    """The tensor whose memory a draft's bytes come from (for a tied leaf, the first leaf's:
    the same view of the same memory)."""
    first = _payloads(draft)[0]
    if first.tensor is not None:
        return first.tensor
    assert first.source is not None
    return first.source.tensor


def _span(draft: _TensorDraft) -> tuple[int, int] | None:
    """The addresses of the first byte of a draft's tensor and of the byte after its last
    element (its memory as a range); None for a tensor whose written values are not its memory
    (prepared, negated, conjugate), or that is not on the CPU (``relate``)."""
    first = draft.payloads[0]
    if first.tensor is not None:  # a contiguous CPU tensor in several chunks
        return first.address, first.address + sum(p.nbytes for p in draft.payloads)
    source = first.source
    assert source is not None
    t = source.tensor
    if source.prepare is not None or not t.is_cpu or t.is_neg() or t.is_conj():
        return None
    start = t.data_ptr()
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (reach + 1) * t.itemsize


def _overlapping(starts: array[int], sizes: array[int]) -> list[list[int]]:
    """The groups of indices of the ranges of ``sizes[i]`` bytes at ``starts[i]`` that overlap
    one another (through any chain of overlaps), each of two ranges or more: sorted and scanned
    in C."""
    if len(starts) < 2:
        return []
    first = torch.frombuffer(starts, dtype=torch.int64)
    ends = first + torch.frombuffer(sizes, dtype=torch.int64)
    first, order = torch.sort(first)
    # (``index_select``: indexing by a tensor of indices takes torch's general advanced-indexing
    # path, many times slower.)
    reach = _running_max(ends.index_select(0, order))
    joins = first[1:] < reach[:-1]  # each range overlapping one before it in start order
    if not bool(joins.any()):
        return []
    group = torch.cat([torch.zeros(1, dtype=torch.int64), (~joins).cumsum(0)])
    joined = group[1:].masked_select(joins)
    at = torch.isin(group, joined).nonzero().flatten()
    groups: dict[int, list[int]] = {}
    members = order.index_select(0, at).tolist()
    for g, i in zip(group.index_select(0, at).tolist(), members, strict=True):
        groups.setdefault(g, []).append(i)
    return list(groups.values())


def _running_max(x: torch.Tensor) -> torch.Tensor:
    """The maximum of ``x[: i + 1]`` at each ``i`` of a 1-d tensor, by doubling steps of
    element-wise maxima (``cummax`` also tracks indices, element by element, and was many
    times slower)."""
    step = 1
    while step < len(x):
        x = torch.cat([x[:step], torch.maximum(x[step:], x[:-step])])
        step *= 2
    return x


def collect(
    states: Iterable[tuple[str, Any]],
    *,
    rank: int,
    prepare: PrepareFunc | None,
    replicated: Sequence[str],
    inline_max_bytes: int,
    own: Placer | Recorder,
    submit: Callable[[WriteRequest], None] | None = None,
) -> Collected:
    """Flattens ``(key_path, state_dict)`` pairs of process ``rank`` into entries and payloads.

    Manifest paths are ``"<rank>/<key_path>/..."``; ``prepare`` and the ``replicated`` globs see
    the logical path without the rank. The rank's own payloads are placed by ``own`` as they
    are met (tensors chunked by its layout), or only recorded by a ``Recorder``; with
    ``submit``, each of their writes is handed to it as soon as its blob is complete, the last
    one when the state is done. (``own``'s writes hold every blob placed so far, also when this
    raises.)
    """
    collector = _Collector(rank, prepare, replicated, inline_max_bytes, own, submit)
    for key_path, state in states:
        collector.add(key_path, state)
    collector.relate()
    own.close()
    if submit is not None:
        collector._submit()
    return collector.out


# Slab members start at multiples of this, so a staging buffer's slice for any member can be
# viewed as the member's dtype (complex128, the widest, is 16 bytes).
_ALIGN = 16
_ZEROS = memoryview(bytes(_ALIGN))


@dataclass
class _Slab:
    blob: str
    members: list[tuple[int, Payload]] = field(default_factory=list)  # (padding before, payload)
    nbytes: int = 0
    staging_bytes: int = 0
    from_device: bool = False  # a member is copied from a device (async take pins its buffer)

    def stage(self, checksums: bool) -> Staged:
        """Views of the members (padding between them); with ``checksums``, each member's
        CRC-32 goes to its ``crc32`` (see ``Placer``)."""
        buffers: list[Buffer] = []
        keep: list[object] = [self]  # the slab holds its members, they hold their tensors
        for pad, p in self.members:
            if pad:
                buffers.append(_ZEROS[:pad])
            t = p.tensor
            if t is not None:  # most members: a view of a tensor's memory (``Payload.stage``)
                # ``raw_memoryview`` inline: a slice of the address space.
                address = p.address - 1
                view = ADDRESS_SPACE[address : address + p.nbytes]
                buffers.append(view)
                if checksums:
                    p.crc32 = crc32(view)
                continue
            bufs, keepalive = p.stage()
            buffers.extend(bufs)
            keep.append(keepalive)
            if checksums:
                value = 0
                for b in bufs:
                    value = crc32(b, value)
                p.crc32 = value
        return buffers, keep

    def label(self) -> str:
        first = self.members[0][1].label
        more = f" and {len(self.members) - 1} more" if len(self.members) > 1 else ""
        return f"{first}{more} (slab {self.blob})"


class Recorder:
    """Stands in for a rank's own ``Placer`` while a take across ranks plans: it records the
    payloads in the order they are met and places nothing (which of them are the rank's own
    is known only after the first agreement: ``replication.settle`` places them)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.payloads: list[Payload] = []
        self.writes: list[WriteRequest] = []  # none: nothing is placed

    def place(self, p: Payload) -> None:
        self.payloads.append(p)

    def close(self) -> None:
        pass


class Placer:
    """Gives payloads their blobs under one name prefix; collects the writes when ``mine``.

    With a staging ``pool`` (async take), each write's payloads are copied into one pooled
    buffer when staged, so the write never reads the application's memory.

    A slab's members are checksummed when the slab is staged, on the caller's thread (with a
    pool: right after each member's copy from host memory; after ``Lease.ready`` for a copy
    from a device, which is asynchronous), not by the plugin as it writes. A CRC call on more than
    5 KiB drops the GIL and must take it back: on a thread other than one busy in Python (the
    caller planning, or running Python while an async take writes), each call waited up to the
    interpreter's switch interval, 5 ms. Checksumming 20,000 slab members of 10 KiB on an I/O
    thread took an async take 4-6 s to commit while the caller ran a Python loop, 0.5 s while
    it slept. Large payloads, a blob each, are checksummed in a few large pieces as they are
    written.
    """

    def __init__(self, prefix: str, layout: Layout, mine: bool, pool: StagingPool | None) -> None:
        self.prefix = prefix
        self.layout = layout
        self.mine = mine
        self.pool = pool
        self.writes: list[WriteRequest] = []
        self._next = 0
        self._slab: _Slab | None = None
        self._slab_max = layout.slab_threshold_bytes
        self._slab_bytes = layout.slab_bytes

    def _blob(self, kind: str = "") -> str:
        name = f"{self.prefix}{kind}{self._next}"
        self._next += 1
        return name

    def place(self, p: Payload) -> None:
        """In the open slab when small, else in a blob of its own."""
        nbytes = p.nbytes
        pool = self.pool
        staging = nbytes if pool is not None else p.staging_bytes
        if nbytes <= self._slab_max:
            slab = self._slab
            if slab is None or slab.nbytes + (-slab.nbytes % _ALIGN) + nbytes > self._slab_bytes:
                self.close()
                slab = self._slab = _Slab(blob=self._blob("s"))
            # Appended to the slab, after the padding that aligns it (inline: once per tensor).
            pad = -slab.nbytes % _ALIGN
            slab.members.append((pad, p))
            p.blob = slab.blob
            p.pos = slab.nbytes + pad
            slab.nbytes += pad + nbytes
            slab.staging_bytes += staging
            if pool is not None and p.source is not None and not slab.from_device:
                slab.from_device = _from_device(p)
        else:
            blob = self._blob()
            p.blob = blob
            p.pos = 0
            if self.mine:
                if pool is None:
                    stage = p.stage
                else:
                    # A pooled write costs the budget its whole block (``block_bytes``).
                    from_device = p.source is not None and _from_device(p)
                    stage = self._pooled([(0, p)], p.nbytes, False, from_device)
                    staging = pool.block_bytes(p.nbytes, from_device)
                self.writes.append(
                    WriteRequest(
                        blob=blob,
                        nbytes=p.nbytes,
                        staging_bytes=staging,
                        stage=stage,
                        label=p.label,
                        checksum_ranges=((0, p.nbytes),) if self.layout.checksums else (),
                    )
                )
        if self.mine and p.source is not None:
            p.source.remaining += 1

    def close(self) -> None:
        slab, self._slab = self._slab, None
        if slab is not None and slab.members and self.mine:
            checksums = self.layout.checksums
            staging = slab.staging_bytes
            if self.pool is None:
                stage = functools.partial(slab.stage, checksums)
            else:
                stage = self._pooled(slab.members, slab.nbytes, checksums, slab.from_device)
                staging = self.pool.block_bytes(slab.nbytes, slab.from_device)
            self.writes.append(
                WriteRequest(
                    blob=slab.blob,
                    nbytes=slab.nbytes,
                    staging_bytes=staging,
                    stage=stage,
                    label=slab.label(),
                    # Its members are checksummed as they are staged.
                )
            )

    def _pooled(
        self, members: list[tuple[int, Payload]], nbytes: int, checksums: bool, from_device: bool
    ) -> Callable[[], Staged]:
        """Stages ``members`` by copying them into one pooled buffer (pinned when
        ``from_device``: a member is on a device); with ``checksums``, each member's CRC-32
        goes to its ``crc32``.

        The CRC is taken from the buffer only once the member's bytes are there: right after a
        copy from host memory (synchronous, and still in the CPU's cache), and after
        ``lease.ready()`` for a copy from a device, which is issued non-blocking on a staging
        stream and lands only when ``ready`` has waited for that stream. A stage that fails
        releases its lease, which first waits for the copies already issued into it."""
        pool = self.pool
        assert pool is not None

        def stage() -> Staged:
            lease = pool.acquire(nbytes, from_device)
            try:
                if len(members) > 1:
                    lease.touch()
                buf = lease.tensor
                view = lease.view
                pos = 0
                late: list[tuple[int, Payload]] | None = None  # copies still in flight
                for pad, p in members:
                    if pad:
                        view[pos : pos + pad] = _ZEROS[:pad]
                        pos += pad
                    source = p.source
                    if source is None:  # host memory: a tensor's, an object's bytes
                        p.copy_into(buf, pos)
                        if checksums:
                            p.crc32 = crc32(view[pos : pos + p.nbytes])
                    elif source.copy_into(p.start, p.stop, buf, pos, lease):
                        if checksums:  # issued from a device: readable after ``ready``
                            if late is None:
                                late = []
                            late.append((pos, p))
                    elif checksums:
                        p.crc32 = crc32(view[pos : pos + p.nbytes])
                    pos += p.nbytes
                lease.ready()
                if late is not None:
                    for at, p in late:
                        p.crc32 = crc32(view[at : at + p.nbytes])
            except BaseException:
                lease.release()  # waits for the copies already issued before lending it again
                raise
            return [lease.view], lease

        return stage


def _from_device(p: Payload) -> bool:
    """Whether a payload with a ``source`` is copied from a CUDA device (its buffer is then
    pinned, for asynchronous copies). The tensor as given decides: a prepare function that moves
    it elsewhere only makes the copies synchronous, or the pinning unneeded."""
    assert p.source is not None
    return device.cuda_index(p.source.tensor) is not None


def place(
    collected: Collected,
    own: Placer,
    *,
    rank: int,
    layout: Layout,
    writer_of: Mapping[tuple[str, int], int],
    pool: StagingPool | None = None,
) -> TakePlan:
    """Places the replicated payloads and makes the plan: this rank's own writes (``own``,
    which placed its own payloads while they were collected) and the writes of the replicated
    payloads ``rank`` writes.

    A rank's own payloads go to blobs ``<rank>/<n>`` and slabs ``<rank>/s<n>``. A replicated
    payload is written once, by ``writer_of[(logical, index)]``, into that writer's blobs
    ``<writer>/r<n>`` and ``<writer>/rs<n>``: every rank places all replicated payloads the same
    way (in sorted order, with the agreed ``layout``), so every rank knows every location
    without asking. With a staging ``pool``, staging copies every payload into pooled buffers.
    """
    replicated: dict[int, list[Payload]] = {}
    for p in collected.replicated:
        replicated.setdefault(writer_of[(p.logical, p.index)], []).append(p)
    writes = list(own.writes)
    for writer in sorted(replicated):
        shared = Placer(f"{writer}/r", layout, mine=writer == rank, pool=pool)
        for p in sorted(replicated[writer], key=lambda q: (q.logical, q.index)):
            shared.place(p)
        shared.close()
        writes.extend(shared.writes)
    return TakePlan(
        drafts=collected.entries,
        writes=writes,
        shared=replicated.get(rank, []),
        checksums=layout.checksums,
        grads=collected.grads,
        views=collected.views,
    )


def assign_writers(
    signature: Sequence[tuple[str, int, int, str]], local_bytes: Sequence[int]
) -> dict[tuple[str, int], int]:
    """Which rank writes each replicated payload: greedily, largest first, to the rank that has
    the fewest bytes to write so far (its own payloads included; ties go to the lower rank)."""
    load = list(local_bytes)
    writers: dict[tuple[str, int], int] = {}
    for logical, index, nbytes, _ in sorted(signature, key=lambda s: (-s[2], s[0], s[1])):
        rank = min(range(len(load)), key=lambda r: (load[r], r))
        writers[(logical, index)] = rank
        load[rank] += nbytes
    return writers


def _call_prepare(
    prepare: PrepareFunc, path: str, logical: str, tensor: torch.Tensor, *, tracing: bool
) -> torch.Tensor:
    try:
        out = prepare(logical, tensor, tracing)
    except Exception as e:
        raise SnapshotError(
            f"{path}: _custom_tensor_prepare_func raised {type(e).__name__}: {e}"
        ) from e
    if not is_dense_tensor(out):
        raise UnsupportedValueError(
            f"{path}: _custom_tensor_prepare_func must return a dense tensor, got {_type_name(out)}"
        )
    return out


class _TensorSource:
    """The bytes of one tensor, handed out piece by piece (element ranges) at staging time.

    Used for tensors that cannot simply be viewed (those are viewed by their ``Payload``): prepared,
    conjugate or negated views, non-contiguous, on a device. ``piece`` gathers a piece into new
    memory; ``copy_into`` copies it into a given staging buffer. What needs the whole tensor first
    (the prepare function, resolving a lazy conjugate or negation) is done once, at the first
    piece, and kept until the last piece this rank stages.
    """

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
        self._base: torch.Tensor | None = None

    def _resolve(self) -> torch.Tensor:
        if self._base is not None:
            return self._base
        t = self.tensor
        if self.prepare is not None:
            t = _call_prepare(self.prepare, self.path, self.logical, t, tracing=False)
            if t.dtype != self.dtype or tuple(t.shape) != self.shape:
                raise UnsupportedValueError(
                    f"{self.path}: _custom_tensor_prepare_func returned {dtype_name(t.dtype)}"
                    f"{list(t.shape)} when tracing but {dtype_name(self.dtype)}"
                    f"{list(self.shape)} when preparing; both calls must agree"
                )
        t = as_copyable(t.detach())
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        self._base = t
        return t

    def piece(self, start: int, stop: int) -> Staged:
        """Elements ``[start, stop)`` as a new contiguous CPU tensor's bytes (a view when the
        resolved tensor already is one)."""
        try:
            base = self._resolve()
            if base.is_cpu and base.is_contiguous():
                part = base.view(-1)[start:stop]
            else:
                part = gather_elements(base, start, stop)
        except RuntimeError as e:
            raise self._unreadable(e) from e
        finally:
            self._staged_one()
        return [tensor_memoryview(part)], part

    def copy_into(
        self, start: int, stop: int, buf: torch.Tensor, pos: int, lease: Lease | None = None
    ) -> bool:
        """Copies elements ``[start, stop)`` into the uint8 staging buffer ``buf`` at ``pos``.

        From host memory the copy is done when this returns (False). From a CUDA device with a
        ``lease`` (``buf`` is its tensor), the copies are issued on the lease's staging stream
        for that device, after the work queued on the device's current stream, non-blocking
        when the buffer is pinned; this returns True and the bytes may be read only after
        ``lease.ready()``. Without a lease, a device's copies are synchronous.
        """
        dst = buf[pos : pos + (stop - start) * self.dtype.itemsize]
        try:
            base = self._resolve()
            if base.is_cpu and base.is_contiguous():
                # As raw bytes: works for dtypes torch has no copy kernel for.
                dst.copy_(base.view(-1)[start:stop].view(torch.uint8))
                return False
            index = device.cuda_index(base)
            if index is None:  # host memory (not contiguous), or another device type
                scatter_into_flat(dst.view(base.dtype), range_views(base, start, stop))
                return False
            flat = dst.view(base.dtype)
            views = range_views(base, start, stop)
            if lease is None:
                for at, v in _flat_slots(views):
                    device.copy(flat[at : at + v.numel()].view(v.shape), v, False)
                return False
            # Only a machine with a GPU runs these lines for real: the copies are queued on the
            # device's staging stream (``Lease.stream``: after the kernels already queued on
            # its current stream) and, into pinned memory, return at once; ``Lease.ready``
            # waits for them. The lease keeps ``base`` alive until then: a prepared or resolved
            # tensor may have no other owner, and CUDA's caching allocator would hand its
            # memory to the next allocation on the current stream while the copy still reads
            # it on the staging stream.
            with device.use_stream(lease.stream(index, base)):
                for at, v in _flat_slots(views):
                    device.copy(flat[at : at + v.numel()].view(v.shape), v, lease.pinned)
            return True
        except RuntimeError as e:
            raise self._unreadable(e) from e
        finally:
            self._staged_one()

    def _unreadable(self, e: Exception) -> UnsupportedValueError:
        return UnsupportedValueError(
            f"{self.path}: cannot read this {dtype_name(self.dtype)} tensor on "
            f"{self.tensor.device}: {e}"
        )

    def _staged_one(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self._base = None


def _flat_slots(views: list[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """Each view with the element offset it starts at when the views are laid end to end."""
    at = 0
    for v in views:
        yield at, v
        at += v.numel()


# ---------------------------------------------------------------------------------------------
# Restore and read_object.


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
    owner: str | None = None


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
    if target.dtype != dtype and not _casts(dtype, target.dtype):
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
def _casts(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether ``copy_`` fills a ``dst`` tensor from a ``src`` one (tried on one element)."""
    try:
        torch.zeros(1, dtype=dst).copy_(torch.zeros(1, dtype=src))
    except (RuntimeError, TypeError):
        return False
    return True


def _direct(target: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        target.is_cpu
        and target.dtype == dtype
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


@dataclass
class TensorRead:
    """The needs that fill one tensor, and that tensor (the target, or a new one)."""

    needs: list[Need]
    result: torch.Tensor


def _check(
    path: str, loc: Location, pieces: int, verify: bool
) -> LocationCheck | WholeCheck | None:
    """The check of ``loc``'s bytes read in ``pieces`` needs, with ``verify`` and a recorded
    checksum only: for one piece a ``WholeCheck``, that need's ``verify`` (most tensors and
    every object: no bookkeeping of pieces); else a ``LocationCheck``, whose ``add`` each need
    gets for its offset and length (``_piece_verify``)."""
    if not verify or loc.crc32 is None:
        return None
    return WholeCheck(path, loc) if pieces == 1 else LocationCheck(path, loc, pieces)


def _piece_verify(
    check: LocationCheck | WholeCheck, offset: int, nbytes: int
) -> Callable[[int], None]:
    """The ``verify`` of the need of ``nbytes`` at ``offset`` in a location checked by
    ``check``."""
    if type(check) is WholeCheck:
        return check
    return functools.partial(check.add, offset, nbytes)


def plan_tensor_read(
    path: str,
    entry: TensorEntry,
    target: torch.Tensor | None,
    tile_bytes: int,
    piece_bytes: int,
    verify: bool = True,
    landing: Landing | None = None,
) -> TensorRead:
    """Needs for ``entry``: into ``target`` in place when given (cast like ``copy_``), else into
    a new tensor.

    Bytes land directly in the destination's memory when it is a contiguous CPU tensor of the
    stored dtype, in pieces of at most ``piece_bytes`` (so one large tensor is read by several
    workers); otherwise they go through scratch tiles of at most ``tile_bytes`` (whole elements,
    never across chunks) copied into the target by ``landing``, whatever its layout or device
    (``_tile_need``; without a ``landing``, device copies are waited for one by one). With
    ``verify``, each chunk's bytes are checked against its recorded CRC-32 as they land.

    Callers try ``direct_read`` first: it plans the most common read in fewer steps (the same
    need this plans for it).
    """
    dtype = check_tensor_entry(path, entry)
    if target is None:
        target = _allocate(path, entry.nbytes, lambda: torch.empty(entry.shape, dtype=dtype))
    else:
        check_target(path, entry, target, dtype)
    itemsize = dtype.itemsize
    direct = _direct(target, dtype)
    if landing is None:
        landing = Landing()
    if not direct:
        landing.prepare(target)
    needs: list[Need] = []
    step = piece_bytes if direct else tile_bytes
    step = max(itemsize, step - step % itemsize)
    address = target.data_ptr() if direct else 0
    base = 0
    for chunk in entry.chunks:
        check = _check(path, chunk, -(-chunk.nbytes // step), verify)
        for lo in range(0, chunk.nbytes, step):
            n = min(step, chunk.nbytes - lo)
            if direct:
                need = _direct_need(path, chunk, lo, n, address + base + lo)
            else:
                need = _tile_need(
                    path, chunk, lo, n, (base + lo) // itemsize, dtype, target, landing
                )
            if check is not None:
                need.verify = _piece_verify(check, lo, n)
            needs.append(need)
        base += chunk.nbytes
    return TensorRead(needs=needs, result=target)


def direct_read(
    path: str, entry: TensorEntry, target: Any, piece_bytes: int, verify: bool
) -> Need | None:
    """The one need of the most common read (most tensors of a state), or None when
    ``plan_tensor_read`` must plan it: a tensor stored in one range of at most ``piece_bytes``,
    into a contiguous CPU tensor of the stored dtype and shape, whose memory the bytes land in.

    The checks are ``plan_tensor_read``'s for that case, in fewer steps: a target of the stored
    dtype and shape holding exactly the stored number of bytes is one the bytes fit, and
    anything else (an error included) is left to the general path.
    """
    chunks = entry.chunks
    if len(chunks) != 1 or type(target) not in _DENSE_TYPES:
        return None
    chunk = chunks[0]
    nbytes = chunk.nbytes
    dtype = DTYPES.get(entry.dtype)
    if (
        dtype is None
        or not 0 < nbytes <= piece_bytes
        or target.dtype is not dtype
        or target.nbytes != nbytes
        or target.is_nested
        or target.shape != entry.shape
        or not target.is_cpu
        or target.layout is not _STRIDED
        or target.is_quantized
        or not target.is_contiguous()
        or target.is_neg()
        or (dtype.is_complex and target.is_conj())
        # A storage that ends before the bytes would be written out of bounds: the general
        # path refuses it (``check_receivable``).
        or target.untyped_storage().nbytes() < target.storage_offset() * dtype.itemsize + nbytes
    ):
        return None
    need = _direct_need(path, chunk, 0, nbytes, target.data_ptr())
    if verify and chunk.crc32 is not None:
        need.verify = WholeCheck(path, chunk)
    return need


def _direct_need(path: str, chunk: Location, lo: int, nbytes: int, address: int) -> Need:
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


def plan_sharded_read(
    path: str,
    entry: ShardedTensorEntry,
    target: Any,
    piece_bytes: int,
    verify: bool = True,
    *,
    gap_bytes: int = 0,
    box_bytes: int = 4 << 20,
    pool: ScratchPool | None = None,
    tile_bytes: int | None = None,
    landing: Landing | None = None,
) -> TensorRead:
    """Needs for a target's regions of a sharded tensor: the target's own piece when it is a
    ``ShardedTensor`` or ``DTensor``, or each local shard of torch's ``ShardedTensor`` (filled
    in place; resharded from whatever shards were stored), the whole tensor into a plain tensor
    target (in place, cast like ``copy_``) or a new one.

    Only the bytes of the stored shards that overlap the region are asked for, run by run.
    They land in the destination's memory when it is a contiguous CPU tensor of the stored
    dtype; else (another dtype, not contiguous, on a device: every CUDA ShardedTensor or
    DTensor) each run, cut into tiles of at most ``tile_bytes`` (default ``piece_bytes``), is
    read into a scratch tile taken when its read is about to run and charged to the read
    budget, and copied into its elements of the region by ``landing`` (``_tile_need``). An
    overlap made of many runs with gaps of at most ``gap_bytes`` between them (a column block
    of a row-sharded tensor, say) is read instead through its gaps, in boxes of at most about
    ``box_bytes`` of scratch (taken from ``pool`` and given back, so that boxes reuse memory;
    small, so that a box is still in the CPU's cache when it is copied), each moved into place
    by one strided copy. Chunks read whole are checked against their CRC-32s; a chunk read in
    part cannot be.
    """
    dtype = dtype_from_name(entry.dtype, path)
    sharded.check_entry(path, entry, dtype)
    whole = ((0,) * len(entry.shape), tuple(entry.shape))
    if sharded.is_sharded(target):
        regions, result = sharded.target_regions(path, entry, target)
    elif isinstance(target, torch.Tensor) and is_dense_tensor(target):
        regions, result = [(whole, target)], target
    else:
        result = _allocate(path, entry.nbytes, lambda: torch.empty(entry.shape, dtype=dtype))
        regions = [(whole, result)]
    if landing is None:
        landing = Landing()
    tile = piece_bytes if tile_bytes is None else min(piece_bytes, tile_bytes)
    planned: list[tuple[sharded.Region, torch.Tensor, list[sharded.Piece], list[sharded.Box]]] = []
    for region, dest in regions:
        sharded.check_region(path, entry, region, dest)
        check_receivable(path, dest)
        if dest.dtype != dtype and not _casts(dtype, dest.dtype):
            raise StateMismatchError(
                f"{path}: the snapshot holds {entry.dtype}, the object being restored is "
                f"{dtype_name(dest.dtype)}, and torch cannot copy the one into the other"
            )
        # Into the region's memory the pieces may be as long as a read request; through
        # scratch, as long as a tile.
        step = piece_bytes
        if not _direct(dest, dtype):
            step = tile
            landing.prepare(dest)
        direct, boxes = sharded.plan_region(
            entry, region, dtype.itemsize, step, gap_bytes, box_bytes
        )
        planned.append((region, dest, direct, boxes))
    # One check per stored chunk over every region's pieces: a chunk that two local shards of
    # a torch ShardedTensor target read in parts is still read whole, and checked.
    checks = sharded.checks_for(
        path, [p for _, _, d, b in planned for p in (*d, *(q for x in b for q in x.pieces))], verify
    )
    needs: list[Need] = []
    pool = pool if pool is not None else ScratchPool()
    for _, dest, direct, boxes in planned:
        needs.extend(_region_needs(path, dtype, dest, direct, checks, landing))
        for box in boxes:
            needs.extend(_box_needs(path, dtype, dest, box, checks, pool, landing))
    return TensorRead(needs=needs, result=result)


def _region_needs(
    path: str,
    dtype: torch.dtype,
    dest: torch.Tensor,
    planned: list[sharded.Piece],
    checks: Mapping[tuple[str, int], LocationCheck],
    landing: Landing,
) -> list[Need]:
    """Pieces landing at their place in the region's tensor ``dest``: straight into its memory
    when it can take raw bytes; else each piece (a run of consecutive elements in both the
    stored shard and the region, at most a tile long) through a scratch tile of its own,
    taken when its read is about to run, charged to the read budget, and copied into the
    region's elements once it has landed (``_tile_need``). A scratch tensor of the whole
    region, taken when the read was planned, held memory beyond the budget: with an 8 MiB
    budget, four 32 MiB regions held 128 MiB before the first read."""
    if not planned:
        return []
    if not _direct(dest, dtype):
        itemsize = dtype.itemsize
        needs = []
        for p in planned:
            need = _tile_need(
                path, p.chunk, p.lo, p.nbytes, p.dest // itemsize, dtype, dest, landing
            )
            need.verify = sharded.verifier(checks, p)
            needs.append(need)
        return needs
    address = dest.data_ptr()
    return [
        Need(
            blob=p.chunk.blob,
            offset=p.chunk.offset + p.lo,
            nbytes=p.nbytes,
            dest=functools.partial(raw_memoryview, address + p.dest, p.nbytes),
            done=None,
            scratch_bytes=0,
            label=path,
            verify=sharded.verifier(checks, p),
        )
        for p in planned
    ]


class ScratchPool:
    """Scratch buffers handed from one box to the next: new memory costs page faults (on this
    kind of machine a copy into fresh memory ran at 1-2 GB/s, into reused memory at 13), and
    a box's buffer is free again as soon as its copy is done. Used on the I/O loop only."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        for i, t in enumerate(self._free):
            if t.numel() >= nbytes:
                return self._free.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, t: torch.Tensor) -> None:
        self._free.append(t)


def _box_needs(
    path: str,
    dtype: torch.dtype,
    dest: torch.Tensor,
    box: sharded.Box,
    checks: Mapping[tuple[str, int], LocationCheck],
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

    def into(p: sharded.Piece) -> memoryview:
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


class _TileCopy:
    """What a tile need does: takes its tile when its read is about to run (``dest``) and
    copies it into ``count`` elements of ``target`` from ``first`` on once the bytes have
    landed (``done``). A record with two bound methods, not two closures: a column-wise
    restore makes one per run, tens of thousands, and with closures a need took 990 bytes
    (tracemalloc), with this record 440 (a need read straight into its target: 365)."""

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


def _tile_need(
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


def plan_object_read(
    path: str, entry: ObjectEntry, results: dict[str, Any], verify: bool = True
) -> Need:
    """The need of an object's bytes; ``done`` decodes them into ``results[path]`` (after, with
    ``verify``, their CRC-32 was checked)."""
    loc = entry.location
    nbytes = loc.nbytes
    buf: list[bytearray] = []

    def dest() -> memoryview:
        buf.append(_allocate(path, nbytes, lambda: bytearray(nbytes)))
        return memoryview(buf[0])

    def done() -> None:
        results[path] = decode_value(path, entry, bytes(buf.pop()))

    return Need(
        blob=loc.blob,
        offset=loc.offset,
        nbytes=nbytes,
        dest=dest,
        done=done,
        scratch_bytes=nbytes,
        label=path,
        verify=_check(path, loc, 1, verify),
    )


def plan_pickled_tensor_read(
    path: str,
    entry: PickledTensorEntry,
    target: torch.Tensor | None,
    results: dict[str, Any],
    verify: bool = True,
    landing: Landing | None = None,
) -> list[Need]:
    """The needs of a tensor stored as ``torch.save`` bytes, one per piece; when the last
    piece is decoded, ``results[path]`` holds the tensor: ``target`` filled in place (cast like
    ``copy_``; on a device, by ``landing``'s copy stream) when given, else a new one (the
    decoded tensor itself when one piece holds it all).

    The pickles are decoded by the safe loader, and each must hold a plain tensor of the
    recorded dtype and of its piece's size: the manifest says what a restore may expect, and
    the bytes must not bring anything else (another type, another shape).
    """
    dtype = dtype_from_name(entry.dtype, path)
    shape = tuple(entry.shape)
    pieces = entry.pieces
    _check_pieces(path, entry)
    copier = landing if landing is not None else Landing()
    if target is not None:
        check_target(path, new_tensor_entry(entry.dtype, shape, ()), target, dtype)
        copier.prepare(target)
    whole = len(pieces) == 1 and tuple(pieces[0].sizes) == shape
    result: list[torch.Tensor] = []  # the tensor the pieces are copied into, once made
    if target is not None:
        result.append(target)
    elif not whole:
        result.append(
            _allocate(
                path, math.prod(shape) * dtype.itemsize, lambda: torch.empty(shape, dtype=dtype)
            )
        )
    remaining = [len(pieces)]
    needs = []
    for piece in pieces:
        loc = piece.chunks[0]
        buf: list[bytearray] = []

        def dest(loc: Location = loc, buf: list[bytearray] = buf) -> memoryview:
            buf.append(_allocate(path, loc.nbytes, lambda: bytearray(loc.nbytes)))
            return memoryview(buf[0])

        def done(piece: Shard = piece, buf: list[bytearray] = buf) -> None:
            value = decode_object(bytes(buf.pop()), path)
            box = tuple(piece.sizes)
            if (
                not isinstance(value, torch.Tensor)
                or type(value) not in _DENSE_TYPES
                or value.dtype != dtype
                or tuple(value.shape) != box
            ):
                what = (
                    f"a {dtype_name(value.dtype)}{list(value.shape)} tensor"
                    if isinstance(value, torch.Tensor)
                    else f"a {_type_name(value)}"
                )
                raise CorruptSnapshotError(
                    f"{path}: the pickle of the piece at {list(piece.offsets)} holds {what}; the "
                    f"manifest records a {entry.dtype}{list(box)} tensor"
                )
            if not result:  # one piece, the whole tensor, no target: the decoded one is it
                results[path] = value.detach()
                return
            window = result[0][
                tuple(slice(o, o + n) for o, n in zip(piece.offsets, box, strict=True))
            ]
            try:
                copier.copy(window, value)
            except RuntimeError as e:
                raise StateMismatchError(
                    f"{path}: cannot copy the stored {entry.dtype} values into the "
                    f"{dtype_name(window.dtype)} tensor being restored: {e}"
                ) from e
            remaining[0] -= 1
            if remaining[0] == 0:
                results[path] = result[0]

        needs.append(
            Need(
                blob=loc.blob,
                offset=loc.offset,
                nbytes=loc.nbytes,
                dest=dest,
                done=done,
                scratch_bytes=loc.nbytes,
                label=path,
                verify=_check(path, loc, 1, verify),
            )
        )
    return needs


def _check_pieces(path: str, entry: PickledTensorEntry) -> None:
    """The pieces of a pickled tensor lie within its shape, one location each, and cover it
    exactly once (their volumes add up to its own, and no two overlap)."""
    shape = tuple(entry.shape)
    for piece in entry.pieces:
        offsets, sizes = tuple(piece.offsets), tuple(piece.sizes)
        if (
            len(piece.chunks) != 1
            or len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or any(o + n > s for o, n, s in zip(offsets, sizes, shape, strict=True))
        ):
            raise CorruptSnapshotError(
                f"{path}: a piece at {list(offsets)} of size {list(sizes)} in "
                f"{len(piece.chunks)} locations does not fit a {entry.dtype}{list(shape)} "
                "tensor stored as one pickle per piece"
            )
    # Linear in the pieces (by their corners), where comparing every pair was quadratic.
    problem = sharded.cover_problem(shape, [(p.offsets, p.sizes) for p in entry.pieces])
    if problem is not None or not entry.pieces:
        raise CorruptSnapshotError(
            f"{path}: the pieces of this {entry.dtype}{list(shape)} tensor do not cover it "
            f"exactly once{f': {problem}' if problem else ''}"
        )


def _allocate(path: str, nbytes: int, make: Callable[[], _T]) -> _T:
    """``make()``, the memory a manifest entry asks for; an allocation that fails (a damaged
    manifest can claim any size) is reported as what it most likely is."""
    try:
        return make()
    except (MemoryError, RuntimeError) as e:
        raise CorruptSnapshotError(
            f"{path}: cannot allocate the {nbytes:,} bytes the manifest says it holds "
            f"({type(e).__name__}); the manifest is damaged, or this machine lacks the memory"
        ) from e


def decode_value(path: str, entry: ObjectEntry, data: bytes) -> Any:
    """The value an object entry's bytes encode."""
    if entry.serializer == "bytes":
        return data
    if entry.serializer == "utf8":
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptSnapshotError(f"{path}: stored text is not valid UTF-8: {e}") from e
    if entry.serializer == "torch_save":
        return decode_object(data, path)
    raise CorruptSnapshotError(
        f"{path}: unknown serializer {entry.serializer!r}; known: torch_save, bytes, utf8"
    )


def coalesce(
    needs: Sequence[Need], *, max_gap_bytes: int, max_request_bytes: int, max_scratch_bytes: int
) -> list[ReadRequest]:
    """Merges needs of the same blob into few scatter reads.

    Needs are sorted by position; a need joins the read before it when it starts at most
    ``max_gap_bytes`` after that read ends (the gap is read and dropped), the read stays within
    ``max_request_bytes`` and its scratch memory within ``max_scratch_bytes``. Overlapping needs
    (one blob range restored into two targets) start a new read, so every read is one
    sequential pass.
    """
    requests: list[ReadRequest] = []
    by_blob: dict[str, list[Need]] = {}
    for need in needs:
        by_blob.setdefault(need.blob, []).append(need)
    for blob, group in by_blob.items():
        group.sort(key=attrgetter("offset"))
        current: list[Need] = []
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
                size += gap + need.nbytes
                scratch += need.scratch_bytes
            else:
                if current:
                    requests.append(_request(blob, current))
                current = [need]
                size, scratch = need.nbytes, need.scratch_bytes
            end = need.offset + need.nbytes
        if current:
            requests.append(_request(blob, current))
    return requests


def needs_label(needs: Iterable[Need]) -> str:
    """Names the entries some needs serve, for messages: ``"a"``, ``"a and 3 more"``."""
    labels = {n.label for n in needs}
    first = min(labels)
    return first if len(labels) == 1 else f"{first} and {len(labels) - 1} more"


def _request(blob: str, needs: list[Need]) -> ReadRequest:
    segments: list[Segment] = []
    pos = needs[0].offset
    for need in needs:
        if need.offset > pos:
            segments.append(Segment(nbytes=need.offset - pos, dest=None))
        segments.append(need)
        pos = need.offset + need.nbytes
    dones = [n.done for n in needs if n.done is not None]
    label = needs_label(needs)

    def done() -> None:
        for d in dones:
            d()

    return ReadRequest(
        blob=blob,
        offset=needs[0].offset,
        segments=segments,
        scratch_bytes=sum(n.scratch_bytes for n in needs),
        done=done if dones else None,
        label=label,
    )
