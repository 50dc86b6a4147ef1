"""The manifest file: YAML whose entries are one JSON object per line, decoded strictly.

The file is YAML (a block mapping of header fields and ``entries``), and every entry line is
written in JSON syntax, which is also YAML. So any YAML reader (or person) can read it, while this
codec reads the entry lines with the C JSON decoder, one line at a time: about fifty times faster
than a YAML loader on a manifest of 100,000 entries. A file that is not laid out as the writer lays
it out (hand-edited, say) is read with the YAML safe loader instead; both paths feed the same
strict decoding of every field.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Collection, Mapping
from itertools import compress, count, repeat
from operator import is_not
from typing import Any

import yaml
from isal import isal_zlib

from manifest.entries import (
    ENTRY_TYPES,
    FORMAT_VERSION,
    DictEntry,
    Entry,
    ListEntry,
    Location,
    Manifest,
    ObjectEntry,
    PrimitiveEntry,
    Shard,
    ShardedObjectEntry,
    ShardedTensorEntry,
    TensorEntry,
    TensorView,
    TupleEntry,
    new_location,
    new_tensor_entry,
)

# libyaml's C classes when PyYAML has them; the pure-Python ones behave identically.
_Loader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

FORMAT_NAME = "statesnap"
_ENTRIES_LINE = "entries:"


class ManifestDecodeError(ValueError):
    """The bytes are not a manifest this version of the library can read."""


class UnsupportedFormatError(ManifestDecodeError):
    """The manifest was written in a newer format version."""


class ManifestChecksumError(ManifestDecodeError):
    """The manifest's bytes do not have the CRC-32 its last line records, or it has no such
    line (it was cut short)."""


class UnsafeManifestError(ManifestDecodeError):
    """The manifest uses what this library never writes, and will not expand or follow: YAML
    anchors and aliases, tags, merge keys, collections as mapping keys, plain scalars of types
    JSON has no form for (timestamps), or nesting deeper than ``MAX_DEPTH``."""


# The last line of a manifest: a YAML comment (so any YAML reader ignores it) holding the
# CRC-32 of every byte before it.
_TRAILER = b"# crc32 %08x\n"
_TRAILER_RE = re.compile(rb"# crc32 ([0-9a-f]{8})\n\Z")


def _split_trailer(data: bytes, source: str, verify: bool) -> bytes:
    """The manifest's bytes before its checksum line, after checking them against it (when
    ``verify``)."""
    start = data.rfind(b"\n", 0, len(data) - 1) + 1
    match = _TRAILER_RE.match(data, start)
    if match is None:
        if verify:
            raise ManifestChecksumError(
                f"{source} does not end with its checksum line: it was cut short or edited"
            )
        return data
    body = data[:start]
    if verify:
        expected = int(match.group(1), 16)
        actual = isal_zlib.crc32(body)
        if actual != expected:
            raise ManifestChecksumError(
                f"{source} is damaged: its bytes have crc32 {actual:#010x}, its last line "
                f"records {expected:#010x}"
            )
    return body


# JSON leaves these characters raw, but YAML reads them as line breaks or does not allow them
# unescaped; \uXXXX escapes mean the same character to both.
_NOT_YAML_PRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ufffe\uffff]")


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(", ", ": "))


def _yaml_printable(text: str) -> str:
    # The common case, ASCII text, in two scans in C (the regex alone ran at ~60 MB/s here).
    if text.isascii() and "\x7f" not in text:
        return text
    if _NOT_YAML_PRINTABLE.search(text):
        text = _NOT_YAML_PRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text


def _location_to_list(loc: Location) -> list[Any]:
    if loc.crc32 is None:
        return [loc.blob, loc.offset, loc.nbytes]
    return [loc.blob, loc.offset, loc.nbytes, loc.crc32]


def entry_to_dict(entry: Entry) -> dict[str, Any]:
    """The plain-data form of an entry, as written in the manifest file.

    Floats are written as their ``repr`` in a string (``"0.1"``, ``"nan"``): exact, and the same
    to JSON and YAML readers; bytes as base64.
    """
    out: dict[str, Any] = {"type": entry.type}
    if isinstance(entry, TensorEntry):
        out["dtype"] = entry.dtype
        out["shape"] = list(entry.shape)
        out["chunks"] = [_location_to_list(c) for c in entry.chunks]
        # Written only when set: an ordinary tensor's line is the same as before they existed.
        if entry.parameter:
            out["parameter"] = True
        if entry.requires_grad:
            out["requires_grad"] = True
        view = entry.view
        if view is not None:
            out["view"] = {"base": view.base, "offset": view.offset, "stride": list(view.stride)}
    elif isinstance(entry, ObjectEntry):
        out["serializer"] = entry.serializer
        out["obj_type"] = entry.obj_type
        out["location"] = _location_to_list(entry.location)
    elif isinstance(entry, PrimitiveEntry):
        value = entry.value
        out["value_type"] = entry.value_type
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode("ascii")
        elif isinstance(value, float):
            value = repr(value)
        out["value"] = value
    elif isinstance(entry, DictEntry):
        out["keys"] = list(entry.keys)
        if entry.ordered:
            out["ordered"] = True
    elif isinstance(entry, (ListEntry, TupleEntry)):
        out["length"] = entry.length
    elif isinstance(entry, ShardedTensorEntry):
        out["key"] = entry.key
        out["dtype"] = entry.dtype
        out["shape"] = list(entry.shape)
        out["shards"] = [
            {
                "offsets": list(s.offsets),
                "sizes": list(s.sizes),
                "chunks": [_location_to_list(c) for c in s.chunks],
            }
            for s in entry.shards
        ]
    elif isinstance(entry, ShardedObjectEntry):
        out["key"] = entry.key
        out["serializer"] = entry.serializer
        out["obj_type"] = entry.obj_type
        out["location"] = _location_to_list(entry.location)
    else:  # pragma: no cover - every entry type is listed above
        raise TypeError(f"unknown entry class {type(entry).__name__}")
    if entry.replicated:
        out["replicated"] = True
    return out


# Strings JSON writes verbatim between quotes. A character class repeated: a concatenation of
# strings matches exactly when each of them does.
_VERBATIM = re.compile(r"[ !#-\[\]-~]*")


class EntryFormatter:
    """Formats entries as manifest lines, each exactly as the JSON encoder would write it.

    ``tensor`` formats a tensor stored in one range from its fields, without an entry object: a
    take of many small tensors formats one such line per tensor, and building two records per
    tensor only to format them cost as much again. The formatter keeps the constant text of the
    lines of each (dtype, blob) pair that JSON writes verbatim (thousands of slab members share
    one) and the text of each shape.

    ``paths`` (a set, or a mapping's keys: membership is asked once per line): the paths the
    lines will be for, checked for verbatim writing in one pass over them all, where a pattern
    match per line cost a quarter of formatting it; a path not among them is checked when its
    line is made.
    """

    __slots__ = ("_heads", "_paths", "_shapes")

    def __init__(self, paths: Collection[str] = ()) -> None:
        self._heads: dict[tuple[str, str], tuple[str, str] | None] = {}
        self._shapes: dict[tuple[int, ...], str] = {}
        self._paths = paths if _VERBATIM.fullmatch("".join(paths)) is not None else ()

    def _head(self, dtype: str, blob: str) -> tuple[str, str] | None:
        """The text between a line's path and its shape, and between its shape and its offset;
        None when the dtype or blob needs escapes."""
        key = (dtype, blob)
        if key not in self._heads:
            self._heads[key] = (
                (
                    f'": {{"type": "tensor", "dtype": "{dtype}", "shape": [',
                    f'], "chunks": [["{blob}", ',
                )
                if _VERBATIM.fullmatch(dtype) and _VERBATIM.fullmatch(blob)
                else None
            )
        return self._heads[key]

    def _shape(self, shape: tuple[int, ...]) -> str:
        text = self._shapes.get(shape)
        if text is None:
            text = self._shapes[shape] = ", ".join(map(str, shape))
        return text

    def tensor(
        self,
        path: str,
        dtype: str,
        shape: tuple[int, ...],
        blob: str,
        offset: int,
        nbytes: int,
        crc32: int | None,
        replicated: bool = False,
    ) -> str:
        """The line of a ``TensorEntry`` whose one chunk is ``blob[offset : offset + nbytes]``
        with CRC-32 ``crc32`` (None: not recorded)."""
        head = self._heads.get((dtype, blob)) or self._head(dtype, blob)
        if head is not None and (path in self._paths or _VERBATIM.fullmatch(path)):
            dims = self._shapes.get(shape) or self._shape(shape)
            crc = "" if crc32 is None else f", {crc32}"
            tail = ', "replicated": true}' if replicated else "}"
            return f'  "{path}{head[0]}{dims}{head[1]}{offset}, {nbytes}{crc}]]{tail}'
        location = new_location(blob, offset, nbytes, crc32)
        return self._encoded(path, new_tensor_entry(dtype, shape, (location,), replicated))

    def entry(self, path: str, entry: Entry) -> str:
        """The line of any entry."""
        if type(entry) is TensorEntry and len(entry.chunks) == 1 and not entry.has_attrs:
            c = entry.chunks[0]
            return self.tensor(
                path, entry.dtype, entry.shape, c.blob, c.offset, c.nbytes, c.crc32,
                entry.replicated,
            )  # fmt: skip
        return self._encoded(path, entry)

    @staticmethod
    def _encoded(path: str, entry: Entry) -> str:
        # {"path": {...}} without its braces is the line.
        return "  " + _ENCODER.encode({path: entry_to_dict(entry)})[1:-1]


def dumps(manifest: Manifest) -> bytes:
    """Serializes a manifest (UTF-8 YAML, one line per entry)."""
    return dumps_entries(
        manifest.format_version, manifest.world_size, manifest.metadata, manifest.entries
    )


def dumps_entries(
    format_version: int,
    world_size: int,
    metadata: Mapping[str, Any],
    entries: Mapping[str, Entry | str],
) -> bytes:
    """Serializes a manifest given by its fields, where an entry may already be formatted: a
    ``str`` is a line an ``EntryFormatter`` made for that path, written as it is."""
    encode = _ENCODER.encode
    lines = [
        f"format: {FORMAT_NAME}",
        f"format_version: {format_version}",
        f"world_size: {world_size}",
        f"metadata: {encode(dict(metadata))}",
    ]
    if entries:
        lines.append(_ENTRIES_LINE)
        # A take's entries are mostly lines already: the others are found by passes in C.
        values = list(entries.values())
        others = list(compress(count(), map(is_not, repeat(str), map(type, values))))
        if others:
            paths = list(entries)
            line = EntryFormatter({paths[i] for i in others}).entry
            for i in others:
                values[i] = line(paths[i], values[i])
        lines.extend(values)
    else:
        lines.append(f"{_ENTRIES_LINE} {{}}")
    lines.append("")
    body = _yaml_printable("\n".join(lines)).encode("utf-8")
    return body + _TRAILER % isal_zlib.crc32(body)


# ---------------------------------------------------------------------------------------------
# Reading YAML: the subset the writer emits, nothing more.

# The deepest nesting a manifest may hold, the document's own mapping counting as level 1. The
# writer nests at most 7 levels (the document, ``entries``, an entry, its ``shards``, a shard,
# its ``chunks``, a location) and ``metadata`` 4 (its ``strategies``); the limit leaves room for
# fields added later and for files edited by hand, and keeps every walk of a decoded value (the
# JSON decoder's, the field checks', an error message's ``repr``) far from the interpreter's
# recursion limit, whatever the file holds.
MAX_DEPTH = 32

_NULL_TAG = "tag:yaml.org,2002:null"
_BOOL_TAG = "tag:yaml.org,2002:bool"
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_NO_KEY = object()  # what an open mapping holds while it waits for its next key
_SHOWN_KEY_CHARS = 200  # of a key quoted in a message


def load_yaml(text: str, source: str = "manifest") -> Any:
    """The one document in YAML ``text``, as plain data (dict, list, str, int, float, bool,
    None), read as the safe loader reads it; ``source`` names the file in error messages.

    The document is built from the parser's events, one at a time, with a stack of the open
    collections: the file's nesting never becomes recursion here, and whatever the writer never
    emits is refused when its event arrives, before anything is built from it. So an alias is
    refused where it stands, instead of sharing a node that later walks would repeat (a file of
    a few hundred KB of aliases reads as millions of locations); a tag (``!!python/...``,
    ``!!binary``, ``!!set``...) is refused instead of constructed; a plain scalar the resolver
    gives a type JSON cannot write (a timestamp) or a merge key (``<<``) is refused; nesting
    past ``MAX_DEPTH`` is refused at the level that passes it.

    Raises:
        UnsafeManifestError: an anchor, alias, tag, merge key, collection as a mapping key,
            plain scalar of another type, or nesting past ``MAX_DEPTH``.
        ManifestDecodeError: the text is not YAML, holds more than one document, or a
            mapping repeats a key.
    """
    loader = _Loader(text)
    try:
        return _build(loader, source)
    except yaml.YAMLError as e:
        # libyaml's scanner reads ahead of the events (up to a simple key's length), and has a
        # nesting limit of its own, far above ours: a deep flow collection can meet it first.
        if "nesting depth" in str(getattr(e, "problem", "")):
            raise UnsafeManifestError(
                f"{source}: nesting deeper than {MAX_DEPTH} levels, which this library never "
                f"writes ({e})"
            ) from None
        raise ManifestDecodeError(f"{source} is not valid YAML: {e}") from None
    finally:
        loader.dispose()


def _build(loader: Any, source: str) -> Any:
    """The document ``loader``'s events describe (``load_yaml``)."""
    get_event = loader.get_event
    stack: list[Any] = []  # the open collections, outermost first
    keys: list[Any] = []  # beside each: a mapping's pending key (or _NO_KEY); None for a list
    root: Any = None
    documents = 0
    while True:
        event = get_event()
        kind = type(event)
        if kind is yaml.ScalarEvent:
            if event.anchor is not None or event.tag is not None:
                raise _refused(event, stack, keys, source)
            # implicit[0]: a plain scalar, typed by the resolver; any other style is a string.
            value = _plain(loader, event, stack, keys, source) if event.implicit[0] else event.value
        elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
            if event.anchor is not None or event.tag is not None:
                raise _refused(event, stack, keys, source)
            if len(stack) >= MAX_DEPTH:
                raise _unsafe(
                    event, stack, keys, source,
                    f"nesting deeper than {MAX_DEPTH} levels, which this library never writes",
                )  # fmt: skip
            value = {} if kind is yaml.MappingStartEvent else []
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            stack.pop()
            keys.pop()
            if keys and keys[-1] is not None:
                keys[-1] = _NO_KEY  # the value of a mapping's key is complete
            continue
        elif kind is yaml.AliasEvent:
            raise _refused(event, stack, keys, source)
        elif kind is yaml.DocumentStartEvent:
            documents += 1
            if documents > 1:
                raise ManifestDecodeError(f"{source} holds more than one YAML document")
            continue
        elif kind is yaml.StreamEndEvent:
            return root
        else:  # the stream's start, a document's end
            continue
        if not stack:
            root = value
        elif keys[-1] is None:
            stack[-1].append(value)
        elif keys[-1] is _NO_KEY:
            if type(value) is dict or type(value) is list:
                raise _unsafe(
                    event, stack, keys, source,
                    "a collection as a mapping key, which this library never writes",
                )  # fmt: skip
            if value in stack[-1]:
                raise ManifestDecodeError(
                    f"{_place(event, stack, keys, source)}: the key {_shown(value)} appears "
                    "twice in one mapping"
                )
            keys[-1] = value
        else:
            # A collection's key stays pending until it is closed: messages name the entry.
            stack[-1][keys[-1]] = value
            if kind is yaml.ScalarEvent:
                keys[-1] = _NO_KEY
        if kind is not yaml.ScalarEvent:
            stack.append(value)
            keys.append(_NO_KEY if type(value) is dict else None)


def _plain(loader: Any, event: Any, stack: list[Any], keys: list[Any], source: str) -> Any:
    """A plain scalar's value, of one of the types a JSON reader would give it (the safe
    loader's resolver and constructors decide which, and the value)."""
    text = event.value
    tag = loader.resolve(yaml.ScalarNode, text, (True, False))
    if tag == _STR_TAG:
        return text
    if tag == _NULL_TAG:
        return None
    if tag == _BOOL_TAG:
        return loader.bool_values[text.lower()]
    if tag in (_INT_TAG, _FLOAT_TAG):
        try:
            return loader.yaml_constructors[tag](loader, yaml.ScalarNode(tag, text))
        except ValueError:  # the resolver's patterns take "0b_" for an int that int() refuses
            raise ManifestDecodeError(
                f"{_place(event, stack, keys, source)}: the plain scalar {_shown(text)} reads "
                "as a number but is none"
            ) from None
    what = "a merge key (<<)" if tag == _MERGE_TAG else f"a plain scalar read as {tag}"
    raise _unsafe(event, stack, keys, source, f"{what}, which this library never writes")


def _refused(event: Any, stack: list[Any], keys: list[Any], source: str) -> UnsafeManifestError:
    """The error for an anchor, alias or tag."""
    if type(event) is yaml.AliasEvent:
        what = f"the YAML alias *{_clip(event.anchor)}"
    elif event.anchor is not None:
        what = f"the YAML anchor &{_clip(event.anchor)}"
    else:
        what = f"the YAML tag {_clip(event.tag)}"
    return _unsafe(event, stack, keys, source, f"{what}, which this library never writes")


def _unsafe(
    event: Any, stack: list[Any], keys: list[Any], source: str, what: str
) -> UnsafeManifestError:
    return UnsafeManifestError(f"{_place(event, stack, keys, source)}: {what}")


def _place(event: Any, stack: list[Any], keys: list[Any], source: str) -> str:
    """Where an event stands, for a message: the file, the entry (when inside ``entries``:
    its logical path), and the line and column."""
    mark = event.start_mark
    at = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"
    if len(stack) >= 2 and keys[0] == "entries" and keys[1] not in (None, _NO_KEY):
        return f"{source}: entry {_shown(keys[1])} ({at})"
    if keys and keys[0] not in (None, _NO_KEY):
        return f"{source}: {_shown(keys[0])} ({at})"
    return f"{source} ({at})"


def _clip(text: str) -> str:
    return text if len(text) <= _SHOWN_KEY_CHARS else text[:_SHOWN_KEY_CHARS] + "..."


def _shown(key: Any) -> str:
    return repr(_clip(key)) if type(key) is str else repr(key)


# ---------------------------------------------------------------------------------------------
# Decoding: every field is checked; anything unexpected is a ManifestDecodeError naming the path.


def _fail(where: str, what: str) -> ManifestDecodeError:
    return ManifestDecodeError(f"{where}: {what}")


def _int(value: Any, where: str, *, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise _fail(where, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise _fail(where, f"expected a string, got {value!r}")
    return value


def _bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise _fail(where, f"expected true or false, got {value!r}")
    return value


# The names the writer gives blobs ("0/17", "3/s2"): safe without further checks.
_PLAIN_BLOB = re.compile(r"[0-9]+/[a-z]?[0-9]+")
_MAX_CRC32 = 0xFFFFFFFF


def check_blob_path(blob: str, where: str = "blob") -> str:
    """Refuses blob paths that could escape the snapshot's root (``UnsafeManifestError``: the
    writer names blobs ``<rank>/<name>`` only)."""
    if _PLAIN_BLOB.fullmatch(blob):
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


def _location(value: Any, where: str) -> Location:
    if type(value) is not list or len(value) not in (3, 4):
        raise _fail(where, f"expected [blob, offset, nbytes, crc32], got {value!r}")
    blob, offset, nbytes = value[:3]
    crc = value[3] if len(value) == 4 else None
    if (
        type(offset) is not int
        or type(nbytes) is not int
        or offset < 0
        or nbytes < 0
        or not (crc is None or (type(crc) is int and 0 <= crc <= _MAX_CRC32))
    ):
        raise _fail(where, f"expected [blob, offset, nbytes, crc32], got {value!r}")
    return new_location(check_blob_path(_str(blob, where), where), offset, nbytes, crc)


def _decode_tensor(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    shape = d["shape"]
    if not isinstance(shape, list):
        raise _fail(where, f"shape must be a list, got {shape!r}")
    chunks = d["chunks"]
    if not isinstance(chunks, list):
        raise _fail(where, f"chunks must be a list, got {chunks!r}")
    dims = tuple(_int(s, where) for s in shape)
    view = d.get("view")
    return {
        "dtype": _str(d["dtype"], where),
        "shape": dims,
        "chunks": tuple(_location(c, where) for c in chunks),
        "parameter": _bool(d.get("parameter", False), where),
        "requires_grad": _bool(d.get("requires_grad", False), where),
        "view": None if view is None else _decode_view(view, len(dims), where),
    }


def _decode_view(value: Any, ndim: int, where: str) -> TensorView:
    """A tensor's ``view``: its fields' types and one stride per axis. Whether the base exists
    and holds the elements is the reader's check (``planner.resolve_view``): it needs the other
    entries."""
    if type(value) is not dict or value.keys() != {"base", "offset", "stride"}:
        raise _fail(where, f"expected a view {{base, offset, stride}}, got {value!r}")
    stride = _ints(value["stride"], where, "a view's stride")
    if len(stride) != ndim:
        raise _fail(where, f"a view of a {ndim}-d tensor has stride {list(stride)}")
    return TensorView(
        base=_str(value["base"], where), offset=_int(value["offset"], where), stride=stride
    )


def _decode_object(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {
        "serializer": _str(d["serializer"], where),
        "obj_type": _str(d["obj_type"], where),
        "location": _location(d["location"], where),
    }


_PRIMITIVE_TYPES: dict[str, type] = {
    "int": int,
    "str": str,
    "bool": bool,
    "None": type(None),
}


def _decode_primitive(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    value_type = _str(d["value_type"], where)
    value = d["value"]
    if value_type == "bytes":
        try:
            return {"value": base64.b64decode(_str(value, where), validate=True)}
        except binascii.Error as e:
            raise _fail(where, f"bytes value is not valid base64: {e}") from None
    if value_type == "float":
        try:
            return {"value": float(_str(value, where))}
        except ValueError:
            raise _fail(where, f"float value {value!r} is not a number") from None
    expected = _PRIMITIVE_TYPES.get(value_type)
    if expected is None:
        raise _fail(where, f"unknown primitive type {value_type!r}")
    if type(value) is not expected:
        raise _fail(where, f"value {value!r} is not of type {value_type}")
    return {"value": value}


def _decode_dict(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    keys = d["keys"]
    if not isinstance(keys, list):
        raise _fail(where, f"keys must be a list, got {keys!r}")
    for k in keys:
        if k is not None and type(k) not in (str, int, bool):
            raise _fail(where, f"unsupported dict key {k!r}")
    if len(set(keys)) != len(keys):
        raise _fail(where, "duplicate dict keys")
    return {"keys": tuple(keys), "ordered": _bool(d.get("ordered", False), where)}


def _decode_sequence(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {"length": _int(d["length"], where)}


def _ints(value: Any, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _fail(where, f"{what} must be a list, got {value!r}")
    return tuple(_int(x, where) for x in value)


def _decode_sharded_tensor(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    shape = _ints(d["shape"], where, "shape")
    shards = d["shards"]
    if not isinstance(shards, list):
        raise _fail(where, f"shards must be a list, got {shards!r}")
    decoded = []
    for s in shards:
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
        chunks = s["chunks"]
        if not isinstance(chunks, list):
            raise _fail(where, f"a shard's chunks must be a list, got {chunks!r}")
        decoded.append(
            Shard(offsets=offsets, sizes=sizes, chunks=tuple(_location(c, where) for c in chunks))
        )
    return {
        "key": _str(d["key"], where),
        "dtype": _str(d["dtype"], where),
        "shape": shape,
        "shards": tuple(decoded),
    }


def _decode_sharded_object(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {"key": _str(d["key"], where), **_decode_object(d, where)}


_DECODERS: dict[
    type[Entry], tuple[Callable[[Mapping[str, Any], str], dict[str, Any]], set[str]]
] = {
    TensorEntry: (
        _decode_tensor,
        {"dtype", "shape", "chunks", "parameter", "requires_grad", "view"},
    ),
    ObjectEntry: (_decode_object, {"serializer", "obj_type", "location"}),
    PrimitiveEntry: (_decode_primitive, {"value_type", "value"}),
    DictEntry: (_decode_dict, {"keys", "ordered"}),
    ListEntry: (_decode_sequence, {"length"}),
    TupleEntry: (_decode_sequence, {"length"}),
    ShardedTensorEntry: (_decode_sharded_tensor, {"key", "dtype", "shape", "shards"}),
    ShardedObjectEntry: (_decode_sharded_object, {"key", "serializer", "obj_type", "location"}),
}
_OPTIONAL_FIELDS = {"ordered", "replicated", "parameter", "requires_grad", "view"}


_TENSOR_FIELDS = frozenset({"type", "dtype", "shape", "chunks"})


def entry_from_dict(d: Any, where: str) -> Entry:
    """Decodes one entry, checking every field."""
    if type(d) is not dict:
        raise _fail(where, f"expected a mapping, got {d!r}")
    if d.keys() == _TENSOR_FIELDS and d["type"] == "tensor":
        # The common case, checked inline: a manifest is mostly tensors.
        dtype, shape, chunks = d["dtype"], d["shape"], d["chunks"]
        if (
            type(dtype) is str
            and type(shape) is list
            and type(chunks) is list
            and all(type(x) is int and x >= 0 for x in shape)
        ):
            return new_tensor_entry(
                dtype, tuple(shape), tuple([_location(c, where) for c in chunks])
            )
    tag = d.get("type")
    cls = ENTRY_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise _fail(where, f"unknown entry type {tag!r}; known: {', '.join(ENTRY_TYPES)}")
    decode, allowed = _DECODERS[cls]
    fields = set(d) - {"type", "replicated"}
    missing = allowed - _OPTIONAL_FIELDS - fields
    unknown = fields - allowed
    if missing or unknown:
        raise _fail(
            where, f"{tag} entry: missing fields {sorted(missing)}, unknown {sorted(unknown)}"
        )
    kwargs = decode(d, where)
    kwargs["replicated"] = _bool(d.get("replicated", False), where)
    return cls(**kwargs)


# A tensor line exactly as ``EntryFormatter.tensor`` writes the common case (one chunk with a
# CRC, not replicated, path written verbatim), every field in a form the JSON decoder would read
# identically (no escapes, no leading zeros). Such lines are decoded by this pattern straight
# into entries: about a fifth fewer instructions than decoding the JSON and checking the fields
# it gives (callgrind, 20,000 lines). The blob must be a ``_PLAIN_BLOB``, so it needs no
# further check; the CRC's bound is checked by the caller.
_NATURAL = "0|[1-9][0-9]*"
_TENSOR_LINE = re.compile(
    rf'  "({_VERBATIM.pattern})": \{{"type": "tensor", "dtype": "([a-z0-9_]+)", '
    rf'"shape": \[((?:{_NATURAL})(?:, (?:{_NATURAL}))*)?\], '
    rf'"chunks": \[\["({_PLAIN_BLOB.pattern})", ({_NATURAL}), ({_NATURAL}), ({_NATURAL})\]\]\}}'
)


# A depth scan of JSON text (``nests_within``) keeps its quotes and brackets only: an escape
# (a backslash and the character after it, which may be a quote) goes first, every other byte
# is then deleted by one translation in C.
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
# A string, its closing quote included (a string left open runs to the end of the text: the
# JSON decoder fails there, past the brackets counted before it).
_STRING = re.compile(rb'"[^"]*"?')
# A pair of brackets with nothing left between them: a collection nested no further.
_INNERMOST = re.compile(rb"\[\]|\{\}")


def nests_within(text: str, levels: int) -> bool:
    """Whether JSON text ``text`` is balanced and opens at most ``levels`` levels of brackets.

    Without recursion, in passes in C. Once escapes are dropped, a bracket is inside a string
    when an odd number of quotes precede it; dropping two quotes in a row (most strings, once
    only quotes and brackets are left) keeps that parity for every other character, so the
    few strings left holding brackets are dropped next, one match each. Then each pass removes
    the pairs that hold no other (the innermost level): a text nesting ``n`` levels is empty
    after ``n`` passes. At most ``levels`` passes, each over what the one before left.
    """
    data = text.encode("utf-8", "surrogatepass")
    if b"\\" in data:
        data = _ESCAPE.sub(b"", data)
    rest = data.translate(None, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in rest:
        rest = _STRING.sub(b"", rest)
    for _ in range(levels):
        if not rest:
            return True
        rest, removed = _INNERMOST.subn(b"", rest)
        if not removed:
            return False  # unbalanced: not for the fast path
    return not rest


def _parse_fast(text: str, source: str = "manifest") -> dict[str, Any] | None:
    """The document, if it is laid out exactly as ``dumps`` writes it; else None.

    Its ``entries`` map each path to the entry's raw mapping, or for a tensor line in the
    writer's common layout, to the ``TensorEntry`` it holds, already checked. The other entry
    lines, joined with commas and wrapped in braces, are one JSON object: a single call of the
    C decoder reads them all. Each line must hold exactly one entry and no path may repeat (the
    count of lines and of entries must agree, and the lines must nest no deeper than
    ``MAX_DEPTH``); anything else goes to the YAML path, which refuses or reports it.

    Raises:
        UnsafeManifestError: the header uses what the writer never emits (``load_yaml``).
    """
    head, sep, body = text.partition(f"\n{_ENTRIES_LINE}\n")
    if not sep:
        return None
    try:
        doc = load_yaml(head, source)
    except UnsafeManifestError:
        raise
    except ManifestDecodeError:
        return None
    if not isinstance(doc, dict) or "entries" in doc:
        return None
    lines = body.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not all(line.startswith('  "') for line in lines):
        return None
    match = _TENSOR_LINE.fullmatch
    tensors: list[tuple[str, TensorEntry] | None] = []  # None: the line is among ``others``
    others: list[str] = []
    shapes: dict[str, tuple[int, ...]] = {}  # by their text: shapes repeat across tensors
    for line in lines:
        m = match(line)
        if m is not None:
            path, dtype, shape, blob, offset, nbytes, crc = m.groups()
            crc32 = int(crc)
            if crc32 <= _MAX_CRC32:
                loc = new_location(blob, int(offset), int(nbytes), crc32)
                dims = shapes.get(shape)
                if dims is None:
                    dims = shapes[shape] = tuple(map(int, shape.split(", "))) if shape else ()
                tensors.append((path, new_tensor_entry(dtype, dims, (loc,))))
                continue
        tensors.append(None)
        others.append(line)
    joined = ",".join(others)
    # The lines are the values of ``entries`` (level 2): they may open MAX_DEPTH - 2 levels.
    if not nests_within(joined, MAX_DEPTH - 2):
        return None
    try:
        decoded = json.loads("{" + joined + "}") if others else {}
    except ValueError:
        return None
    if len(decoded) != len(others):
        return None
    rest = iter(decoded.items())
    entries = dict(item if item is not None else next(rest) for item in tensors)
    if len(entries) != len(lines):
        return None
    doc["entries"] = entries
    return doc


def loads(data: bytes, source: str = "manifest", *, verify: bool = True) -> Manifest:
    """Parses manifest bytes; ``source`` names the file in error messages.

    With ``verify``, the bytes must end with the checksum line ``dumps`` writes, and match it.

    Raises:
        ManifestChecksumError: (with ``verify``) the checksum line is missing or does not match.
        ManifestDecodeError: the bytes are not valid UTF-8 YAML of a manifest, or any field is
            missing, of the wrong type or unknown.
        UnsafeManifestError: (a ManifestDecodeError) the bytes use what the writer never
            emits: a YAML anchor, alias, tag or merge key, nesting past ``MAX_DEPTH``, a blob
            path leaving the root (``load_yaml``, ``check_blob_path``).
        UnsupportedFormatError: the manifest's format version is newer than this library's.
    """
    data = _split_trailer(data, source, verify)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestDecodeError(f"{source} is not valid YAML: {e}") from None
    doc = _parse_fast(text, source)
    if doc is None:
        doc = load_yaml(text, source)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise ManifestDecodeError(f"{source} is not a {FORMAT_NAME} manifest")
    version = doc.get("format_version")
    if type(version) is not int:
        raise ManifestDecodeError(f"{source}: format_version missing or not an integer")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{source} has format version {version}, newer than the {FORMAT_VERSION} this "
            "library reads; upgrade statesnap to read it"
        )
    if version < 1:
        raise ManifestDecodeError(f"{source}: invalid format_version {version}")
    world_size = _int(doc.get("world_size"), f"{source}: world_size", minimum=1)
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ManifestDecodeError(f"{source}: metadata must be a mapping")
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        raise ManifestDecodeError(f"{source}: entries missing or not a mapping")
    # Decoded in place. The tensor lines ``_parse_fast`` decoded are entries already (most of
    # them, found by passes in C); every other value is a mapping to decode.
    values = entries.values()
    for path in list(compress(entries, map(is_not, repeat(TensorEntry), map(type, values)))):
        if type(path) is not str:
            raise ManifestDecodeError(f"{source}: entry path {path!r} is not a string")
        try:
            entries[path] = entry_from_dict(entries[path], path)
        except ManifestDecodeError as e:
            raise type(e)(f"{source}: {e}") from None  # the class says unsafe or damaged
    return Manifest(
        format_version=version, world_size=world_size, entries=entries, metadata=metadata
    )
