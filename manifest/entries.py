"""Manifest entry types: frozen records of what a snapshot holds at each logical path, the
strict decoding of their plain-data form (``EntryDecoder``), and the errors of reading a
manifest (every one a ``ManifestDecodeError``, a ``ValueError``)."""

from __future__ import annotations

import base64
import binascii
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from manifest.frames import Frame


class ManifestDecodeError(ValueError):
    """The bytes are not a manifest this version of the library can read."""


class UnsupportedFormatError(ManifestDecodeError):
    """The manifest was written in a newer format version."""


class ManifestChecksumError(ManifestDecodeError):
    """The manifest's bytes lack the CRC-32 its last line records, or that line (cut short)."""


class UnsafeManifestError(ManifestDecodeError):
    """The manifest uses what this library never writes, and will not expand or follow: YAML
    anchors and aliases, tags, merge keys, collections as mapping keys, plain scalars of types
    JSON has no form for (timestamps), or nesting deeper than ``MAX_DEPTH``."""


# The values a manifest stores inline. bytes are stored base64-encoded.
Primitive = int | float | str | bool | None | bytes
# The key types a dict entry can record (others make the dict an opaque object).
DictKey = str | int | bool | None

# Each version adds what older readers would refuse or misread; a writer says the lowest one
# its manifest needs. 1: dense tensors, objects, primitives, containers. 2: sharded tensors and
# objects. 3: a replicated leaf taken by several ranks is listed once, under rank 0's prefix
# (``Manifest.view``). 4: a tensor entry may record ``parameter``, ``requires_grad`` or a
# ``view``. 5: a range may lie in a sibling snapshot's blob (``reference_of``) and a tensor
# entry may record a ``digest``. 6: a range may be stored compressed (``Location.stored``).
FORMAT_VERSION = 6
REPLICATED_ONCE_VERSION = 3
TENSOR_ATTRS_VERSION = 4
INCREMENTAL_VERSION = 5
COMPRESSED_VERSION = 6


@dataclass(slots=True, unsafe_hash=True)
class Location:
    """A byte range of a blob: ``nbytes`` bytes starting at ``offset`` of blob ``blob``.

    ``blob`` is relative to the snapshot's root, ``/``-separated; one that starts with
    ``../<name>/`` lies in the sibling snapshot ``<name>`` (``reference_of``). ``crc32`` is the
    CRC-32 of the range's bytes (None when the snapshot was taken without checksums).

    ``stored``: where they lie compressed (``manifest.frames``); the rest then describe them raw.
    """

    blob: str
    offset: int
    nbytes: int
    crc32: int | None = None
    stored: Frame | None = None


new_location = Location  # (its fields positionally: blob, offset, nbytes, crc32, stored)


@dataclass(slots=True, unsafe_hash=True)
class Entry:
    """Base of every entry; ``tag`` names its kind in the manifest file (``tensor``,
    ``primitive``, ``dict``...). ``replicated`` is a keyword argument of every entry, after the
    fields of its own."""

    tag: ClassVar[str] = ""
    replicated: bool = field(default=False, kw_only=True)

    @property
    def type(self) -> str:
        """torchsnapshot's name of the entry's type: ``tag`` (a primitive's: its value's)."""
        return self.tag

    @property
    def nbytes(self) -> int:
        """Bytes this entry occupies in blobs (0 for entries stored inline)."""
        return sum(loc.nbytes for loc in self.locations)

    @property
    def locations(self) -> tuple[Location, ...]:
        """The blob ranges holding this entry's bytes, in order."""
        return ()


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class TensorView:
    """Where a tensor's elements lie in the storage of another tensor entry of the same rank:
    ``base.as_strided(shape, stride, offset)``, ``base`` being that entry's logical path without
    the rank (resolved under the reading rank's prefix)."""

    base: str
    offset: int
    stride: tuple[int, ...]


@dataclass(slots=True, unsafe_hash=True)
class TensorEntry(Entry):
    """A dense tensor of ``dtype`` (a torch dtype's name: ``"float32"``) and ``shape``, stored
    as its raw bytes in row-major (C) order: the concatenation of ``chunks``, each of which may
    live in a different blob.

    ``parameter`` (it was an ``nn.Parameter``), ``requires_grad`` and ``view`` (it shared its
    storage with another entry's tensor) are what ``torch.load`` would give back beyond the
    values; a view's ``chunks`` still hold its own bytes. ``digest`` (``"xxh3_128:<32 hex>"``)
    is the hash of its bytes that an incremental take compares to find unchanged tensors.
    """

    tag: ClassVar[str] = "tensor"
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Location, ...]
    parameter: bool = False
    requires_grad: bool = False
    view: TensorView | None = None
    digest: str | None = None

    @property
    def has_attrs(self) -> bool:
        """Whether the entry holds any field of format version 4 or 5."""
        return (
            self.parameter or self.requires_grad or self.view is not None or self.digest is not None
        )

    @property
    def locations(self) -> tuple[Location, ...]:
        return self.chunks


def new_tensor_entry(
    dtype: str, shape: tuple[int, ...], chunks: tuple[Location, ...], replicated: bool = False
) -> TensorEntry:
    """``TensorEntry(dtype=..., shape=..., chunks=..., replicated=...)``."""
    return TensorEntry(dtype, shape, chunks, replicated=replicated)


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class Shard:
    """One stored piece of a sharded tensor: the box ``offsets`` .. ``offsets + sizes`` of the
    global tensor (one number per axis), its bytes in row-major order across ``chunks``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunks: tuple[Location, ...]


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class ShardedTensorEntry(Entry):
    """A global tensor stored as shards written by the ranks that held them.

    ``key`` names the global tensor (the same on every rank); ``dtype`` is its dtype's name,
    ``shape`` the global shape; ``shards`` cover it exactly once, and every rank's entry lists
    every shard.
    """

    tag: ClassVar[str] = "sharded_tensor"
    key: str
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[Shard, ...]

    @property
    def locations(self) -> tuple[Location, ...]:
        return tuple(c for s in self.shards for c in s.chunks)


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class ObjectEntry(Entry):
    """A value serialized into the blob range ``location``. ``serializer``: ``"torch_save"``
    (decoded with a restricted unpickler), ``"bytes"`` (a ``bytes`` value) or ``"utf8"`` (a
    long ``str``); ``obj_type`` is the value's qualified type name, for people reading the
    manifest."""

    tag: ClassVar[str] = "object"
    serializer: str
    obj_type: str
    location: Location

    @property
    def locations(self) -> tuple[Location, ...]:
        return (self.location,)


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class PrimitiveEntry(Entry):
    """An int, float, str, bool, None or bytes ``value`` stored in the manifest itself. Read
    as torchsnapshot's ``PrimitiveEntry`` is: ``type`` (the value's type name, also
    ``value_type``), ``serialized_value``, ``readable`` and ``get_value()`` are theirs."""

    tag: ClassVar[str] = "primitive"
    value: Primitive

    @property
    def value_type(self) -> str:
        """The value's type name: ``int``, ``float``, ``str``, ``bool``, ``bytes`` or ``None``."""
        return type(self.value).__name__ if self.value is not None else "None"

    type = value_type  # (torchsnapshot's PrimitiveEntry.type holds that name)

    @property
    def serialized_value(self) -> str:
        """As torchsnapshot writes it: base64 of bytes, or of a float's C double (its
        ``struct.pack("d", value)``); else ``str(value)``."""
        value = struct.pack("d", self.value) if type(self.value) is float else self.value
        return base64.b64encode(value).decode() if type(value) is bytes else str(value)

    @property
    def readable(self) -> str | None:
        """``str(value)`` for a float, else None (as torchsnapshot records it)."""
        return str(self.value) if type(self.value) is float else None

    def get_value(self) -> Primitive:
        """``value`` (torchsnapshot's way to read it)."""
        return self.value


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class DictEntry(Entry):
    """A dict (OrderedDict if ``ordered``), ``keys`` in order; children at ``<path>/<key>``."""

    tag: ClassVar[str] = "dict"
    keys: tuple[DictKey, ...]
    ordered: bool = False


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class ListEntry(Entry):
    """A list of ``length`` items; children live at ``<path>/0`` ... ``<path>/<length-1>``."""

    tag: ClassVar[str] = "list"
    length: int


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class TupleEntry(Entry):
    """A tuple of ``length`` items; children live at ``<path>/0`` ...."""

    tag: ClassVar[str] = "tuple"
    length: int


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class ShardedObjectEntry(Entry):
    """One piece of a sharded object, serialized like an ``ObjectEntry`` (``serializer``,
    ``obj_type``, its bytes at ``location``), written once and found by ``key`` (the object's
    key with its offset in the global grid) by every rank that holds a replica of it."""

    tag: ClassVar[str] = "sharded_object"
    key: str
    serializer: str
    obj_type: str
    location: Location

    @property
    def locations(self) -> tuple[Location, ...]:
        return (self.location,)


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class PickledTensorEntry(Entry):
    """A tensor of ``dtype`` and ``shape`` stored as ``torch.save`` bytes: what torchsnapshot
    wrote for dtypes it had no raw layout for (quantized ones). Read-only: translated from a
    torchsnapshot manifest, never written. Each of ``pieces`` is a box of the tensor whose one
    chunk holds that box's bytes."""

    tag: ClassVar[str] = "pickled_tensor"
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Shard, ...]

    @property
    def locations(self) -> tuple[Location, ...]:
        return tuple(c for p in self.pieces for c in p.chunks)


def is_container(entry: Entry) -> bool:
    """Whether ``entry`` has children in the manifest."""
    return isinstance(entry, (DictEntry, ListEntry, TupleEntry))


# A range in a sibling snapshot's blob is written ``../<name>/<blob>`` (``Location``).
REFERENCE_PREFIX = "../"


def reference_of(blob: str) -> tuple[str, str] | None:
    """``(sibling name, blob within it)`` for a blob path that points into a sibling snapshot
    (``"../step_100/0/17"`` -> ``("step_100", "0/17")``); None for the snapshot's own blob."""
    if not blob.startswith(REFERENCE_PREFIX):
        return None
    name, _, rest = blob[len(REFERENCE_PREFIX) :].partition("/")
    return name, rest


# -- the plain-data form, and its strict decoding --------------------------------------------

# The names the writer gives blobs ("0/17", "3/s2", "0/1f2e3d4c-s2", "1/1f2e3d4c-rs0").
PLAIN_BLOB = re.compile(r"[0-9]+/(?:[0-9a-f]{8}-)?[a-z]{0,2}[0-9]+")
MAX_CRC32 = 0xFFFFFFFF
# The name of a sibling snapshot a blob may lie in: one path component, never ``.`` or ``..``.
SIBLING_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,254}")
DIGEST = re.compile(r"xxh3_128:[0-9a-f]{32}")


def check_blob_path(blob: str, where: str = "blob") -> str:
    """Refuses blob paths that could escape the snapshot's root (``UnsafeManifestError``), but
    for one leading ``../<name>/`` naming a sibling snapshot (``reference_of``), which a reader
    follows only into a committed sibling and within the ranges its manifest records."""
    if PLAIN_BLOB.fullmatch(blob):
        return blob
    ref = reference_of(blob)
    if ref is not None:
        name, rest = ref
        if SIBLING_NAME.fullmatch(name) and rest and not rest.startswith(REFERENCE_PREFIX):
            check_blob_path(rest, where)
            return blob
    if (
        not blob
        or blob.startswith("/")
        or "\\" in blob
        or "\x00" in blob
        or ":" in blob
        or any(part in ("", ".", "..") for part in blob.split("/"))
    ):
        raise UnsafeManifestError(
            f"{where}: unsafe blob path {blob!r}: must be relative, without '..'"
        )
    return blob


def _fail(where: str, what: str) -> ManifestDecodeError:
    return ManifestDecodeError(f"{where}: {what}")


def _int(value: Any, where: str) -> int:
    if type(value) is not int or value < 0:
        raise _fail(where, f"expected an integer >= 0, got {value!r}")
    return value


def _str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise _fail(where, f"expected a string, got {value!r}")
    return value


def _bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise _fail(where, f"expected true or false, got {value!r}")
    return value


def _list(value: Any, where: str, what: str) -> list[Any]:
    if type(value) is not list:
        raise _fail(where, f"{what} must be a list, got {value!r}")
    return value


def _ints(value: Any, where: str, what: str) -> tuple[int, ...]:
    for x in _list(value, where, what):
        _int(x, where)
    return tuple(value)


class EntryDecoder:
    """Decodes entries from their plain-data form, checking every field: anything unexpected
    is a ``ManifestDecodeError`` naming the entry's path (an ``UnsafeManifestError`` for a
    blob path that could leave the root, or, before format ``version`` 5, that points into a
    sibling snapshot). One decoder reads one manifest: each blob path there is checked once,
    and every range in that blob shares one string."""

    def __init__(self, version: int = FORMAT_VERSION) -> None:
        self.version = version
        self.blobs: dict[str, str] = {}

    def __call__(self, d: Any, where: str) -> Entry:
        if type(d) is not dict:
            raise _fail(where, f"expected a mapping, got {d!r}")
        tag = d.get("type")
        if type(tag) is not str or tag not in TYPES:
            raise _fail(where, f"unknown entry type {tag!r}; known: {', '.join(TYPES)}")
        cls, required, optional, allowed = TYPES[tag]
        if not required.keys() <= d.keys() <= allowed:
            missing, unknown = required.keys() - d.keys(), d.keys() - allowed
            raise _fail(
                where, f"{tag} entry: missing fields {sorted(missing)}, unknown {sorted(unknown)}"
            )
        replicated = _bool(d.get("replicated", False), where)
        if len(d) == 4 and cls is TensorEntry:  # type, dtype, shape, chunks: most tensors
            shape = _ints(d["shape"], where, "shape")
            entry: Entry = TensorEntry(
                _str(d["dtype"], where), shape, self.locations(d["chunks"], where)
            )
        else:
            # In the table's order: a field checked against another comes after it.
            got: dict[str, Any] = {}
            for name in (*required, *(n for n in optional if n in d)):
                got[name] = _FIELDS[name](self, d[name], where, got)
            got.pop("value_type", None)  # (a primitive's, checked with its value)
            entry = cls(**got)
        if replicated:
            entry.replicated = True
        return entry

    def location(self, value: Any, where: str) -> Location:
        longest = 5 if self.version >= COMPRESSED_VERSION else 4
        if type(value) is not list or not 3 <= len(value) <= longest:
            raise _fail(where, f"expected [blob, offset, nbytes, crc32], got {value!r}")
        blob, offset, nbytes = value[0], value[1], value[2]
        crc = value[3] if len(value) >= 4 else None
        if (
            type(offset) is not int
            or type(nbytes) is not int
            or offset < 0
            or nbytes < 0
            or not (crc is None or (type(crc) is int and 0 <= crc <= MAX_CRC32))
        ):
            raise _fail(where, f"expected [blob, offset, nbytes, crc32], got {value!r}")
        known = self.blobs.get(_str(blob, where))
        if known is None:  # a blob not met before in this manifest
            known = self.blobs[blob] = check_blob_path(blob, where)
            if self.version < INCREMENTAL_VERSION and blob.startswith(REFERENCE_PREFIX):
                raise UnsafeManifestError(
                    f"{where}: unsafe blob path {blob!r}: a manifest of format version "
                    f"{self.version} keeps every blob under its root"
                )
        if len(value) == 5:  # compressed: the module is imported only for such a manifest
            from manifest.frames import decode_frame

            stored = decode_frame(value[4], nbytes, where, ManifestDecodeError)
            return Location(known, offset, nbytes, crc, stored)
        return Location(known, offset, nbytes, crc)

    def locations(self, value: Any, where: str, what: str = "chunks") -> tuple[Location, ...]:
        return tuple([self.location(c, where) for c in _list(value, where, what)])


def _view(dec: EntryDecoder, view: Any, where: str, got: dict[str, Any]) -> TensorView:
    if type(view) is not dict or view.keys() != {"base", "offset", "stride"}:
        raise _fail(where, f"expected a view {{base, offset, stride}}, got {view!r}")
    stride = _ints(view["stride"], where, "a view's stride")
    if len(stride) != len(got["shape"]):
        raise _fail(where, f"a view of a {len(got['shape'])}-d tensor has stride {list(stride)}")
    return TensorView(
        base=_str(view["base"], where), offset=_int(view["offset"], where), stride=stride
    )


def _digest(dec: EntryDecoder, digest: Any, where: str, got: dict[str, Any]) -> str:
    if type(digest) is not str or not DIGEST.fullmatch(digest):
        raise _fail(where, f"digest must be 'xxh3_128:' and 32 hex digits, got {digest!r}")
    return digest


_PRIMITIVETYPES: dict[str, type] = {"int": int, "str": str, "bool": bool, "None": type(None)}


def _value(dec: EntryDecoder, value: Any, where: str, got: dict[str, Any]) -> Any:
    value_type = got["value_type"]
    if value_type == "bytes":
        try:
            return base64.b64decode(_str(value, where), validate=True)
        except binascii.Error as e:
            raise _fail(where, f"bytes value is not valid base64: {e}") from None
    if value_type == "float":
        try:
            return float(_str(value, where))
        except ValueError:
            raise _fail(where, f"float value {value!r} is not a number") from None
    if value_type not in _PRIMITIVETYPES:
        raise _fail(where, f"unknown primitive type {value_type!r}")
    if type(value) is not _PRIMITIVETYPES[value_type]:
        raise _fail(where, f"value {value!r} is not of type {value_type}")
    return value


def _keys(dec: EntryDecoder, keys: Any, where: str, got: dict[str, Any]) -> tuple[DictKey, ...]:
    for k in _list(keys, where, "keys"):
        if k is not None and type(k) not in (str, int, bool):
            raise _fail(where, f"unsupported dict key {k!r}")
    if len(set(keys)) != len(keys):
        raise _fail(where, "duplicate dict keys")
    return tuple(keys)


def _shards(dec: EntryDecoder, value: Any, where: str, got: dict[str, Any]) -> tuple[Shard, ...]:
    shape = got["shape"]
    shards = []
    for s in _list(value, where, "shards"):
        if type(s) is not dict or s.keys() != {"offsets", "sizes", "chunks"}:
            raise _fail(where, f"expected a shard {{offsets, sizes, chunks}}, got {s!r}")
        offsets = _ints(s["offsets"], where, "a shard's offsets")
        sizes = _ints(s["sizes"], where, "a shard's sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise _fail(where, f"a shard of a {len(shape)}-d tensor has offsets {list(offsets)}")
        if any(o + n > g for o, n, g in zip(offsets, sizes, shape, strict=True)):
            raise _fail(
                where,
                f"shard at {list(offsets)} of size {list(sizes)} exceeds the shape {list(shape)}",
            )
        chunks = dec.locations(s["chunks"], where, "a shard's chunks")
        shards.append(Shard(offsets=offsets, sizes=sizes, chunks=chunks))
    return tuple(shards)


# How each field an entry's plain data may hold is decoded and checked: ``(decoder, value, the
# entry's path, the fields decoded before it)``; ``_ENCODERS`` writes them.
_FIELDS: dict[str, Callable[[EntryDecoder, Any, str, dict[str, Any]], Any]] = {
    **dict.fromkeys(
        ("dtype", "serializer", "obj_type", "key", "value_type"), lambda _, v, at, __: _str(v, at)
    ),
    **dict.fromkeys(("parameter", "requires_grad", "ordered"), lambda _, v, at, __: _bool(v, at)),
    "length": lambda _, v, at, __: _int(v, at),
    "shape": lambda _, v, at, __: _ints(v, at, "shape"),
    "chunks": lambda dec, v, at, _: dec.locations(v, at),
    "location": lambda dec, v, at, _: dec.location(v, at),
    "view": _view,
    "digest": _digest,
    "value": _value,
    "keys": _keys,
    "shards": _shards,
}


def _location_to_list(loc: Location) -> list[Any]:
    if (f := loc.stored) is not None:
        return [loc.blob, loc.offset, loc.nbytes, loc.crc32, [f.codec, f.offset, f.nbytes, f.crc32]]
    if loc.crc32 is None:
        return [loc.blob, loc.offset, loc.nbytes]
    return [loc.blob, loc.offset, loc.nbytes, loc.crc32]


def _plain_value(value: Any) -> Any:
    """A primitive's value as written: floats as their ``repr`` in a string (exact, and the same
    to JSON and YAML readers), bytes as base64."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    return repr(value) if isinstance(value, float) else value


# How each field of ``TYPES`` is written, from the entry's attribute of that name (the rest
# are written as they are).
_ENCODERS: dict[str, Callable[[Any], Any]] = {
    "shape": list,
    "keys": list,
    "chunks": lambda chunks: [_location_to_list(c) for c in chunks],
    "location": _location_to_list,
    "view": lambda v: {"base": v.base, "offset": v.offset, "stride": list(v.stride)},
    "value": _plain_value,
    "shards": lambda shards: [
        {
            "offsets": list(s.offsets),
            "sizes": list(s.sizes),
            "chunks": _ENCODERS["chunks"](s.chunks),
        }
        for s in shards
    ],
}


# What a manifest file may hold (``PickledTensorEntry`` is no such entry), for the decoder and
# the writer (``codec.entry_to_dict``) alike: each type's class, its required fields, the
# optional ones (written only when set), and every field it may have.
TYPES: dict[str, tuple[Any, dict[str, None], tuple[str, ...], frozenset[str]]] = {
    tag: (
        cls,
        dict.fromkeys(required),
        optional,
        frozenset(("type", "replicated", *required, *optional)),
    )
    for tag, cls, required, optional in (
        (
            "tensor",
            TensorEntry,
            ("dtype", "shape", "chunks"),
            ("parameter", "requires_grad", "view", "digest"),
        ),
        ("object", ObjectEntry, ("serializer", "obj_type", "location"), ()),
        ("primitive", PrimitiveEntry, ("value_type", "value"), ()),
        ("dict", DictEntry, ("keys",), ("ordered",)),
        ("list", ListEntry, ("length",), ()),
        ("tuple", TupleEntry, ("length",), ()),
        ("sharded_tensor", ShardedTensorEntry, ("key", "dtype", "shape", "shards"), ()),
        ("sharded_object", ShardedObjectEntry, ("key", "serializer", "obj_type", "location"), ()),
    )
}
