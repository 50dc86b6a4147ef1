"""The table of kinds of values: the ``Kind`` contract, what a kind may use of the take planner
(``TakeSink``) and of the restore's loader (``ReadPlanner``), and the lookups by value and by
entry that every path (take, restore, read_object, export) goes through."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from manifest import Entry, Location
from snapshot._engine.restore.reads import Need, allocate, location_check, piece_verify
from snapshot._engine.take.records import ObjectDraft, Payload

if TYPE_CHECKING:
    from snapshot._engine.restore.reads import Landing, ScratchPool
    from snapshot._engine.take.incremental import Reuse
    from snapshot._engine.take.plan import Collected
    from snapshot._engine.take.records import Draft, Planned, PrepareFunc


class TakeSink(Protocol):
    """What the take planner (``take.plan.Collector``) offers a kind's ``take``: its settings,
    the tensors written so far by memory (tied weights are written once), what it collects
    (``out``: entries, parameter flags, pieces of sharded values), and where payloads go."""

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
    """What the restore's loader (``restore.loader.Loader``) offers a kind's ``restore``: the
    entries, the read sizes and checks, where values land (``tensors`` for tensors, ``objects``
    for anything else), the caller's CPU tensors filled by needs (``indirect``: checked for
    shared memory), the scratch the reads share, a kind's own state (``kind_state``, by the
    kind's name), and the calls that add reads."""

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

    def add_direct(self, path: str, chunk: Location, address: int) -> None:
        """Adds the read of ``chunk``, whole, into the memory at ``address``."""

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
    by the first kind, in registration order, whose ``accepts`` does. An entry is found by its
    type among ``entry_types`` (the kind registered last first), confirmed by ``owns``.
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
        """The entry (or draft) recorded at ``path``; payloads go to ``sink.emit``."""

    @abstractmethod
    def restore(self, reader: ReadPlanner, path: str, entry: Any, target: Any) -> None:
        """Plans the reads that rebuild ``entry`` (into ``target`` where it can); the value is
        then ``reader.tensors[path]`` or ``reader.objects[path]``, or set by a read's
        ``done``."""

    def check_target(self, label: str, entry: Any, target: Any) -> None:  # noqa: B027
        """Refuses (``StateMismatchError``, naming ``label``), before any read, a ``read_object``
        target this kind cannot fill in place; by default none is ever filled (it is ignored)."""

    def allocates(self, entry: Any, target: Any) -> bool:
        """Whether restoring ``entry`` into ``target`` (None: no target) takes memory of the size
        the manifest claims (its claims are then checked against the store first)."""
        return True

    def tensor_layout(self, path: str, entry: Any) -> TensorLayout | None:
        """The entry as one tensor, for export (None: not a tensor)."""
        return None

    def archived(self, entry: Any) -> bool:
        """Whether the entry's ranges hold ``torch.save`` archives (verify checks them)."""
        return False

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
    ) -> Planned:
        """An object entry whose bytes are ``data`` (recorded with ``serializer``, ``obj_type``)."""
        return bytes_draft(sink, path, logical, serializer, obj_type, data, replicated)

    def read_bytes(
        self, reader: ReadPlanner, path: str, location: Location, done: Callable[[bytes], Any]
    ) -> None:
        """Reads ``location`` (checked against its CRC-32 when reads verify); the value at
        ``path`` is then what ``done`` makes of its bytes."""
        reader.claim()
        reader.add_needs(
            [bytes_need(path, location, reader.objects, done, reader.verify)], into_target=False
        )


def bytes_draft(
    sink: TakeSink,
    path: str,
    logical: str,
    serializer: str,
    obj_type: str,
    data: bytes,
    replicated: bool,
) -> ObjectDraft:
    """The draft of an object entry whose bytes are ``data``, handed to the planner."""
    payload = Payload(logical, 0, len(data), path, replicated, data=data)
    sink.emit([payload])
    return ObjectDraft(
        serializer=serializer, obj_type=obj_type, payload=payload, replicated=replicated
    )


def whole_check(path: str, loc: Location, verify: bool) -> Callable[[int], None] | None:
    """The check of a location read whole, with ``verify`` and a recorded CRC-32 only."""
    check = location_check(path, loc, 1, verify)
    return None if check is None else piece_verify(check, 0, loc.nbytes)


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
        verify=whole_check(path, location, verify),
    )


class _Shared(Kind):
    """The kinds registered for one entry type, asked by ``owns`` (the one registered last
    first): the table's entry for a type more than one kind restores."""

    name = "shared"

    def __init__(self, kinds: list[Kind]) -> None:
        self.kinds = kinds

    def owner(self, entry: Entry) -> Kind:
        for kind in self.kinds:
            if kind.owns(entry):
                return kind
        return self.kinds[-1]

    def owns(self, entry: Entry) -> bool:
        return any(kind.owns(entry) for kind in self.kinds)

    def take(
        self, sink: TakeSink, path: str, logical: str, value: Any, replicated: bool
    ) -> Planned:
        raise NotImplementedError("a shared entry type takes nothing")

    def restore(self, reader: ReadPlanner, path: str, entry: Any, target: Any) -> None:
        self.owner(entry).restore(reader, path, entry, target)

    def check_target(self, label: str, entry: Any, target: Any) -> None:
        self.owner(entry).check_target(label, entry, target)

    def allocates(self, entry: Any, target: Any) -> bool:
        return self.owner(entry).allocates(entry, target)

    def tensor_layout(self, path: str, entry: Any) -> TensorLayout | None:
        return self.owner(entry).tensor_layout(path, entry)

    def archived(self, entry: Any) -> bool:
        return self.owner(entry).archived(entry)


_kinds: list[Kind] = []
by_value_type: dict[type, Kind] = {}
# The kind restoring each entry type (a ``_Shared`` one where several kinds register it): a
# dict lookup, no call, on the restore's path.
by_entry_type: dict[type, Kind] = {}
_entry_kinds: dict[type, list[Kind]] = {}


def _index_entry_type(t: type) -> None:
    kinds = _entry_kinds.get(t, [])
    if not kinds:
        by_entry_type.pop(t, None)
    else:
        by_entry_type[t] = kinds[0] if len(kinds) == 1 else _Shared(kinds)


def register(kind: Kind, *, before: str | None = None) -> Callable[[], None]:
    """Adds ``kind`` to the table (before the kind named ``before``: its ``accepts`` is then
    asked first). Its ``value_types`` take over those types from kinds registered earlier, and
    entries of its ``entry_types`` are offered to it (``owns``) first. Returns a function that
    undoes the registration."""
    at = len(_kinds)
    if before is not None:
        at = next(i for i, k in enumerate(_kinds) if k.name == before)
    _kinds.insert(at, kind)
    earlier = {t: by_value_type.get(t) for t in kind.value_types}
    for t in kind.value_types:
        by_value_type[t] = kind
    for t in kind.entry_types:
        _entry_kinds.setdefault(t, []).insert(0, kind)
        _index_entry_type(t)

    def undo() -> None:
        _kinds.remove(kind)
        for t, k in earlier.items():
            if k is None:
                by_value_type.pop(t, None)
            else:
                by_value_type[t] = k
        for t in kind.entry_types:
            _entry_kinds[t].remove(kind)
            _index_entry_type(t)

    return undo


def for_value(value: Any) -> Kind:
    """The kind of a leaf value: by its exact type, else the first whose ``accepts`` does."""
    kind = by_value_type.get(type(value))
    if kind is not None and kind.accepts(value):
        return kind
    for kind in _kinds:
        if kind.accepts(value):
            return kind
    raise LookupError(f"no kind for a {type(value).__name__}")  # the object kind takes all


def merge_entries(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Every rank's entries in one mapping, rewritten by each kind that merges its entries
    across ranks (``Kind.merge``), only where any of its ``merged_types`` is there."""
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
    return by_entry_type.get(type(entry))
