"""Manifest entry types: frozen records of what a snapshot holds at each logical path."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from itertools import chain, compress, count, pairwise
from operator import add, attrgetter, ne
from typing import Any, ClassVar

# The values a manifest stores inline. bytes are stored base64-encoded.
Primitive = int | float | str | bool | None | bytes
# The key types a dict entry can record (others make the dict an opaque object).
DictKey = str | int | bool | None

# 1: dense tensors, objects, primitives, containers. 2: also sharded tensors and sharded
# objects (a manifest without them is still written as version 1, readable by older readers).
# 3: a replicated leaf taken by several ranks is listed once, under rank 0's prefix, where
# earlier writers repeated it under every rank's (``Manifest.view``). A reader of version 2
# would not find rank 1's replicated entries (a restore on rank 1 would call the manifest
# corrupt: a container lists a key that has no entry), so such a manifest says 3. A manifest
# with no replicated leaf, or of one rank, is still written as version 1 or 2.
# 4: a tensor entry may say it was an ``nn.Parameter`` or required grad, or that it is a view of
# another tensor entry's storage (``TensorEntry``). A reader of version 3 refuses those fields
# as unknown (and would call the snapshot corrupt), so a manifest holding any of them says 4;
# one without them is still written as version 1, 2 or 3.
# 5: a snapshot taken on a base (an incremental take) may point a range at a blob of a sibling
# snapshot (``../<name>/<blob>``, ``reference_of``), and a tensor entry may record a digest of
# its bytes (``TensorEntry.digest``). A reader of version 4 would refuse both, so a manifest
# holding either says 5.
FORMAT_VERSION = 5
REPLICATED_ONCE_VERSION = 3
TENSOR_ATTRS_VERSION = 4
INCREMENTAL_VERSION = 5

# What a manifest can hold that every reader reads back, which a take checks its values
# against (``snapshot._engine.flatten.check_nesting``, the primitive handler) so that it never
# commits what a restore refuses.
#
# An int is written in decimal, and Python refuses to convert a decimal text of more than
# ``sys.int_info.default_max_str_digits`` (4300) digits unless the process lifted the limit
# (``sys.set_int_max_str_digits``): another process would then call the manifest corrupt. A
# take refuses a larger int, as a value or a dict key (pickled, it would not load either: the
# safe unpickler reads no int of that length).
MAX_INT_DIGITS = 4300
_INT_BOUND = 10**MAX_INT_DIGITS
# Containers (dict, list, tuple) are entries of their own, and a restore rebuilds them with one
# level of recursion each (``flatten.inflate``): a take refuses containers nested deeper than
# this below an app_state key (the key's state dict being level 1), which keeps a restore far
# from the interpreter's recursion limit.
MAX_NESTING = 100


def int_fits(value: int) -> bool:
    """Whether ``value`` is an int every reader can read from a manifest (at most
    ``MAX_INT_DIGITS`` decimal digits)."""
    return -_INT_BOUND < value < _INT_BOUND


@dataclass(frozen=True, kw_only=True, slots=True)
class Location:
    """A byte range of a blob: ``nbytes`` bytes starting at ``offset`` of blob ``blob``.

    ``blob`` is relative to the snapshot's root, ``/``-separated; one that starts with
    ``../<name>/`` lies in the sibling snapshot ``<name>`` (the folder beside this one that an
    incremental take's base was, or that base's own base): ``reference_of``. ``crc32`` is the
    CRC-32 of the range's bytes (None when the snapshot was taken without checksums).
    """

    blob: str
    offset: int
    nbytes: int
    crc32: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """Base of every entry; ``type`` tags the kind in the manifest file."""

    type: ClassVar[str] = ""
    replicated: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes this entry occupies in blobs (0 for entries stored inline)."""
        return 0

    @property
    def locations(self) -> tuple[Location, ...]:
        """The blob ranges holding this entry's bytes, in order."""
        return ()


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorView:
    """Where a tensor's elements lie in the storage of another tensor entry of the same rank.

    ``base`` is that entry's logical path without the rank (``"model/emb.weight"``), resolved
    under the reading rank's prefix, so a view stays within one rank's state. The tensor's
    element at index ``i`` is the base's element number ``offset + sum(i[k] * stride[k])`` in
    row-major order, as ``base.as_strided(shape, stride, offset)`` gives it.
    """

    base: str
    offset: int
    stride: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorEntry(Entry):
    """A dense tensor, stored as its raw bytes in row-major (C) order.

    The concatenation of ``chunks`` is the tensor's bytes; each chunk may live in a different blob.

    What ``torch.load`` would give back beyond the values: ``parameter`` (the value was an
    ``nn.Parameter``), ``requires_grad``, and ``view`` (the value shared its storage with the
    tensor of another entry, whose elements hold its own). A view's ``chunks`` still hold its
    own bytes: a read into an existing tensor, and every reader that does not know views, reads
    those; a read that builds new tensors makes it a view of the base's tensor instead.
    """

    type: ClassVar[str] = "tensor"
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Location, ...]
    parameter: bool = False
    requires_grad: bool = False
    view: TensorView | None = None
    # ``"xxh3_128:<32 hex digits>"``: the XXH3 128-bit hash of the tensor's bytes, recorded by
    # takes that may serve as an incremental take's base (format version 5). A later take
    # compares its tensors' digests with it to find those that did not change.
    digest: str | None = None

    @property
    def has_attrs(self) -> bool:
        """Whether the entry holds any field of format version 4 or 5 (it is then written as an
        object, not by the tensor line formatter)."""
        return (
            self.parameter or self.requires_grad or self.view is not None or self.digest is not None
        )

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def locations(self) -> tuple[Location, ...]:
        return self.chunks


# Constructors of the two records a manifest holds one of per tensor, for the paths that make
# tens of thousands of them (planning a take, decoding a manifest): the same objects as the
# dataclass constructors make, for less work (they set the slots directly, where the generated
# ``__init__`` parses keywords and goes through ``object.__setattr__`` per field).
# Like the constructors, they check nothing.
_new = object.__new__
_set_blob = Location.blob.__set__  # type: ignore[attr-defined]
_set_offset = Location.offset.__set__  # type: ignore[attr-defined]
_set_nbytes = Location.nbytes.__set__  # type: ignore[attr-defined]
_set_crc32 = Location.crc32.__set__  # type: ignore[attr-defined]


def new_location(blob: str, offset: int, nbytes: int, crc32: int | None = None) -> Location:
    """``Location(blob=blob, offset=offset, nbytes=nbytes, crc32=crc32)``, faster."""
    loc = _new(Location)
    _set_blob(loc, blob)
    _set_offset(loc, offset)
    _set_nbytes(loc, nbytes)
    _set_crc32(loc, crc32)
    return loc


@dataclass(frozen=True, kw_only=True, slots=True)
class Shard:
    """One stored piece of a sharded tensor: the box ``offsets`` .. ``offsets + sizes`` of the
    global tensor (one number per axis), its bytes in row-major order across ``chunks``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunks: tuple[Location, ...]


_set_replicated = Entry.replicated.__set__  # type: ignore[attr-defined]
_set_dtype = TensorEntry.dtype.__set__  # type: ignore[attr-defined]
_set_shape = TensorEntry.shape.__set__  # type: ignore[attr-defined]
_set_chunks = TensorEntry.chunks.__set__  # type: ignore[attr-defined]
_set_parameter = TensorEntry.parameter.__set__  # type: ignore[attr-defined]
_set_requires_grad = TensorEntry.requires_grad.__set__  # type: ignore[attr-defined]
_set_view = TensorEntry.view.__set__  # type: ignore[attr-defined]
_set_digest = TensorEntry.digest.__set__  # type: ignore[attr-defined]


def new_tensor_entry(
    dtype: str, shape: tuple[int, ...], chunks: tuple[Location, ...], replicated: bool = False
) -> TensorEntry:
    """``TensorEntry(dtype=dtype, shape=shape, chunks=chunks, replicated=replicated)``,
    faster."""
    entry = _new(TensorEntry)
    _set_replicated(entry, replicated)
    _set_dtype(entry, dtype)
    _set_shape(entry, shape)
    _set_chunks(entry, chunks)
    # Slots have no defaults outside ``__init__``: each is set.
    _set_parameter(entry, False)
    _set_requires_grad(entry, False)
    _set_view(entry, None)
    _set_digest(entry, None)
    return entry


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedTensorEntry(Entry):
    """A global tensor stored as shards written by the ranks that held them.

    ``key`` names the global tensor (the same on every rank, whatever logical path each rank
    holds its piece under); ``shape`` is the global shape; ``shards`` cover it exactly once.
    Every rank's entry for the tensor lists every shard, so any rank can read any region.
    """

    type: ClassVar[str] = "sharded_tensor"
    key: str
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[Shard, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for s in self.shards for c in s.chunks)

    @property
    def locations(self) -> tuple[Location, ...]:
        return tuple(c for s in self.shards for c in s.chunks)


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectEntry(Entry):
    """A value serialized into a blob.

    ``serializer`` says how: ``"torch_save"`` (decoded with a restricted unpickler),
    ``"bytes"`` (the raw bytes of a ``bytes`` value), ``"utf8"`` (a long ``str``).
    ``obj_type`` is the value's qualified type name, for people reading the manifest.
    """

    type: ClassVar[str] = "object"
    serializer: str
    obj_type: str
    location: Location

    @property
    def nbytes(self) -> int:
        return self.location.nbytes

    @property
    def locations(self) -> tuple[Location, ...]:
        return (self.location,)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrimitiveEntry(Entry):
    """An int, float, str, bool, None or bytes value stored in the manifest itself."""

    type: ClassVar[str] = "primitive"
    value: Primitive

    @property
    def value_type(self) -> str:
        return type(self.value).__name__ if self.value is not None else "None"


@dataclass(frozen=True, kw_only=True, slots=True)
class DictEntry(Entry):
    """A dict (or OrderedDict when ``ordered``); children live at ``<path>/<escaped key>``."""

    type: ClassVar[str] = "dict"
    keys: tuple[DictKey, ...]
    ordered: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class ListEntry(Entry):
    """A list of ``length`` items; children live at ``<path>/0`` ... ``<path>/<length-1>``."""

    type: ClassVar[str] = "list"
    length: int


@dataclass(frozen=True, kw_only=True, slots=True)
class TupleEntry(Entry):
    """A tuple of ``length`` items; children live at ``<path>/0`` ...."""

    type: ClassVar[str] = "tuple"
    length: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedObjectEntry(Entry):
    """One piece of a sharded object: a value serialized like an ``ObjectEntry``, written once
    (by the rank holding its main replica) and found by ``key``, its unique key (the object's
    key with its offset in the global grid), by every rank that holds a replica of it."""

    type: ClassVar[str] = "sharded_object"
    key: str
    serializer: str
    obj_type: str
    location: Location

    @property
    def nbytes(self) -> int:
        return self.location.nbytes

    @property
    def locations(self) -> tuple[Location, ...]:
        return (self.location,)


@dataclass(frozen=True, kw_only=True, slots=True)
class PickledTensorEntry(Entry):
    """A dense tensor stored as ``torch.save`` bytes instead of raw ones: what torchsnapshot
    wrote for dtypes it had no raw layout for (complex, quantized). Read-only: this library
    never writes one, and its manifest codec does not accept one (a snapshot of another format
    is translated into entries when opened, ``snapshot._engine.format.torchsnapshot_format``).

    Each of ``pieces`` is the box ``offsets .. offsets + sizes`` of the tensor (one piece
    covering it all unless the writer cut the tensor up), whose ``chunks`` hold exactly one
    location: the ``torch.save`` bytes of that box, decoded by the safe loader.
    """

    type: ClassVar[str] = "pickled_tensor"
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Shard, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for p in self.pieces for c in p.chunks)

    @property
    def locations(self) -> tuple[Location, ...]:
        return tuple(c for p in self.pieces for c in p.chunks)


ContainerEntry = DictEntry | ListEntry | TupleEntry

# The entries a manifest file of this library may hold (``PickledTensorEntry`` is not one).
ENTRY_TYPES: dict[str, type[Entry]] = {
    cls.type: cls
    for cls in (
        TensorEntry,
        ObjectEntry,
        PrimitiveEntry,
        DictEntry,
        ListEntry,
        TupleEntry,
        ShardedTensorEntry,
        ShardedObjectEntry,
    )
}


# Entries that are never listed once for every rank (``Manifest.view``).
_NOT_SHARED = (DictEntry, ListEntry, TupleEntry, ShardedTensorEntry, ShardedObjectEntry)


def is_container(entry: Entry) -> bool:
    """Whether ``entry`` has children in the manifest."""
    return isinstance(entry, (DictEntry, ListEntry, TupleEntry))


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A whole snapshot's description: logical path -> entry, plus facts about the snapshot.

    ``entries`` keeps the order in which the snapshot was taken. ``world_size`` is the number of
    processes that took it. ``metadata`` holds free-form facts (library version, time taken).
    """

    format_version: int = 1  # what the writer needs; FORMAT_VERSION is the newest readable
    world_size: int = 1
    entries: dict[str, Entry]
    metadata: dict[str, Any] = field(default_factory=dict)

    def view(self, rank: int) -> dict[str, Entry]:
        """The entries as rank ``rank`` of the take reads them: every entry, and under
        ``<rank>/`` also each replicated leaf that is listed under ``0/`` only (version 3
        manifests list a replicated leaf once, under rank 0's prefix; earlier ones repeated it
        under every rank's, and then nothing is added). ``entries`` itself when nothing is
        added; otherwise a new dict, made once per rank and kept.

        Containers are never replicated (each rank lists its own), nor are sharded entries
        (each rank's lists every shard already, under the path that rank holds it at).
        """
        entries = self.entries
        if rank == 0 or self.world_size == 1:
            return entries
        views: dict[int, dict[str, Entry]] = self.__dict__.setdefault("_views", {})
        view = views.get(rank)
        if view is None:
            prefix = f"{rank}/"
            added = {
                prefix + p[2:]: e
                for p, e in entries.items()
                if e.replicated
                and p.startswith("0/")
                and not isinstance(e, _NOT_SHARED)
                and prefix + p[2:] not in entries
            }
            view = views[rank] = {**entries, **added} if added else entries
        return view

    @functools.cached_property
    def blob_sizes(self) -> dict[str, int]:
        """The length each of the snapshot's own blobs must have: the end of the last range the
        manifest records in it (a blob holds nothing beyond its last location). For a blob of
        a sibling snapshot (``reference_of``), the length it must have at least: this manifest
        sees only the ranges it reuses; the sibling's own manifest bounds it."""
        # Every restore asks (``bases`` too): the ranges are gathered and their ends computed
        # in C-level passes, and the largest end is taken per run of ranges in one blob (a
        # slab's members follow one another in the manifest), not range by range.
        locs = list(chain.from_iterable(map(_LOCATIONS, self.entries.values())))
        blobs = list(map(_BLOB, locs))
        ends = list(map(add, map(_OFFSET, locs), map(_NBYTES, locs)))
        cuts = [0, *compress(count(1), map(ne, blobs[1:], blobs)), len(blobs)] if blobs else []
        sizes: dict[str, int] = {}
        get = sizes.get
        for lo, hi in pairwise(cuts):
            end = max(ends[lo:hi])
            if end > get(blobs[lo], -1):
                sizes[blobs[lo]] = end
        return sizes

    @functools.cached_property
    def bases(self) -> tuple[str, ...]:
        """The names of the sibling snapshots whose blobs this one's entries point at (its base
        and the bases that base pointed at), sorted; empty for a snapshot that holds all its
        bytes."""
        refs = filter(None, map(reference_of, self.blob_sizes))  # each blob once
        return tuple(sorted({name for name, _ in refs}))


_LOCATIONS = attrgetter("locations")
_BLOB = attrgetter("blob")
_OFFSET = attrgetter("offset")
_NBYTES = attrgetter("nbytes")


# A range in a sibling snapshot's blob is written ``../<name>/<blob>`` (``Location``).
REFERENCE_PREFIX = "../"


def reference_of(blob: str) -> tuple[str, str] | None:
    """``(sibling name, blob within it)`` for a blob path that points into a sibling snapshot
    (``"../step_100/0/17"`` -> ``("step_100", "0/17")``); None for the snapshot's own blob."""
    if not blob.startswith(REFERENCE_PREFIX):
        return None
    name, _, rest = blob[len(REFERENCE_PREFIX) :].partition("/")
    return name, rest
