"""Decoding a manifest's entries: every field is checked; anything unexpected is a
``ManifestDecodeError`` naming the path (an ``UnsafeManifestError`` for a blob path that could
leave the snapshot's root). :mod:`manifest.codec` parses the file and calls
:func:`entry_from_dict` for each entry it did not decode on its fast path.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Mapping
from typing import Any

from manifest.entries import (
    ENTRY_TYPES,
    REFERENCE_PREFIX,
    DictEntry,
    Entry,
    ListEntry,
    Location,
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
    reference_of,
)
from manifest.errors import ManifestDecodeError, UnsafeManifestError


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


# The names the writer gives blobs ("0/17", "3/s2", and with a take's id "0/1f2e3d4c-s2",
# "1/1f2e3d4c-rs0"): safe without further checks (the codec's fast path matches them too).
PLAIN_BLOB = re.compile(r"[0-9]+/(?:[0-9a-f]{8}-)?[a-z]{0,2}[0-9]+")
MAX_CRC32 = 0xFFFFFFFF


# The name of a sibling snapshot a blob may lie in (``../<name>/<blob>``): one path component,
# of the characters a folder name needs, never ``.`` or ``..``.
SIBLING_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,254}")


def check_blob_path(blob: str, where: str = "blob") -> str:
    """Refuses blob paths that could escape the snapshot's root (``UnsafeManifestError``: the
    writer names blobs ``<rank>/<name>`` only), but for one leading ``../<name>/`` naming a
    sibling snapshot (an incremental take's base: ``reference_of``), which a reader follows
    only into a committed sibling and only within the ranges that sibling's manifest records."""
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
        or not (crc is None or (type(crc) is int and 0 <= crc <= MAX_CRC32))
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
        "digest": None if d.get("digest") is None else _digest(d["digest"], where),
    }


DIGEST = re.compile(r"xxh3_128:[0-9a-f]{32}")


def _digest(value: Any, where: str) -> str:
    """A tensor's ``digest``: the one form the writer records (``TensorEntry.digest``)."""
    if type(value) is not str or not DIGEST.fullmatch(value):
        raise _fail(where, f"digest must be 'xxh3_128:' and 32 hex digits, got {value!r}")
    return value


def _decode_view(value: Any, ndim: int, where: str) -> TensorView:
    """A tensor's ``view``: its fields' types and one stride per axis. Whether the base exists
    and holds the elements is the reader's check (``resolve_view`` of the engine's reads): it
    needs the other entries."""
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
        {"dtype", "shape", "chunks", "parameter", "requires_grad", "view", "digest"},
    ),
    ObjectEntry: (_decode_object, {"serializer", "obj_type", "location"}),
    PrimitiveEntry: (_decode_primitive, {"value_type", "value"}),
    DictEntry: (_decode_dict, {"keys", "ordered"}),
    ListEntry: (_decode_sequence, {"length"}),
    TupleEntry: (_decode_sequence, {"length"}),
    ShardedTensorEntry: (_decode_sharded_tensor, {"key", "dtype", "shape", "shards"}),
    ShardedObjectEntry: (_decode_sharded_object, {"key", "serializer", "obj_type", "location"}),
}
_OPTIONAL_FIELDS = {"ordered", "replicated", "parameter", "requires_grad", "view", "digest"}


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
