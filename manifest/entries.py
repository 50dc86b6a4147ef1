"""Manifest entry types: frozen records of what a snapshot holds at each logical path."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

# The values a manifest stores inline. bytes are stored base64-encoded.
Primitive = int | float | str | bool | None | bytes
# The key types a dict entry can record (others make the dict an opaque object).
DictKey = str | int | bool | None

FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Location:
    """A byte range of a blob: ``nbytes`` bytes starting at ``offset`` of blob ``blob``.

    ``blob`` is relative to the snapshot's root, ``/``-separated. ``crc32`` is the CRC-32 of
    the range's bytes (None when the snapshot was taken without checksums).
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
class TensorEntry(Entry):
    """A dense tensor, stored as its raw bytes in row-major (C) order.

    The concatenation of ``chunks`` is the tensor's bytes; each chunk may live in a different blob.
    """

    type: ClassVar[str] = "tensor"
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Location, ...]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def locations(self) -> tuple[Location, ...]:
        return self.chunks


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


ContainerEntry = DictEntry | ListEntry | TupleEntry

ENTRY_TYPES: dict[str, type[Entry]] = {
    cls.type: cls
    for cls in (TensorEntry, ObjectEntry, PrimitiveEntry, DictEntry, ListEntry, TupleEntry)
}


def is_container(entry: Entry) -> bool:
    """Whether ``entry`` has children in the manifest."""
    return isinstance(entry, (DictEntry, ListEntry, TupleEntry))


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A whole snapshot's description: logical path -> entry, plus facts about the snapshot.

    ``entries`` keeps the order in which the snapshot was taken. ``world_size`` is the number of
    processes that took it. ``metadata`` holds free-form facts (library version, time taken).
    """

    format_version: int = FORMAT_VERSION
    world_size: int = 1
    entries: dict[str, Entry]
    metadata: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def blob_sizes(self) -> dict[str, int]:
        """The length each blob must have: the end of the last range the manifest records in
        it (a blob holds nothing beyond its last location)."""
        sizes: dict[str, int] = {}
        for entry in self.entries.values():
            for loc in entry.locations:
                end = loc.offset + loc.nbytes
                if end > sizes.get(loc.blob, -1):
                    sizes[loc.blob] = end
        return sizes
