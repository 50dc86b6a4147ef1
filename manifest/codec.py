"""The manifest file: YAML via the safe (C when present) loader and dumper, decoded strictly."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from typing import Any

import yaml

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
    TensorEntry,
    TupleEntry,
)

# libyaml's C implementation is about 10x faster on large manifests; the pure-Python classes
# behave identically and are the fallback where PyYAML was built without it.
_Loader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper: type = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

FORMAT_NAME = "statesnap"


class ManifestDecodeError(ValueError):
    """The bytes are not a manifest this version of the library can read."""


class UnsupportedFormatError(ManifestDecodeError):
    """The manifest was written in a newer format version."""


class _Flow(dict):
    """A mapping the dumper writes on one line."""


class _FlowList(list):
    """A list the dumper writes on one line."""


class _ManifestDumper(_Dumper):  # type: ignore[misc, valid-type]
    pass


_ManifestDumper.add_representer(
    _Flow, lambda d, data: d.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True)
)
_ManifestDumper.add_representer(
    _FlowList, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)


def _location_to_yaml(loc: Location) -> list[Any]:
    return _FlowList((loc.blob, loc.offset, loc.nbytes))


def entry_to_dict(entry: Entry) -> dict[str, Any]:
    """The plain-data form of an entry, as written in the manifest file."""
    out: dict[str, Any] = _Flow(type=entry.type)
    if isinstance(entry, TensorEntry):
        out["dtype"] = entry.dtype
        out["shape"] = _FlowList(entry.shape)
        out["chunks"] = _FlowList(_location_to_yaml(c) for c in entry.chunks)
    elif isinstance(entry, ObjectEntry):
        out["serializer"] = entry.serializer
        out["obj_type"] = entry.obj_type
        out["location"] = _location_to_yaml(entry.location)
    elif isinstance(entry, PrimitiveEntry):
        value = entry.value
        out["value_type"] = entry.value_type
        out["value"] = (
            base64.b64encode(value).decode("ascii") if isinstance(value, bytes) else value
        )
    elif isinstance(entry, DictEntry):
        out["keys"] = _FlowList(entry.keys)
        if entry.ordered:
            out["ordered"] = True
    elif isinstance(entry, (ListEntry, TupleEntry)):
        out["length"] = entry.length
    else:  # pragma: no cover - every entry type is listed above
        raise TypeError(f"unknown entry class {type(entry).__name__}")
    if entry.replicated:
        out["replicated"] = True
    return out


def dumps(manifest: Manifest) -> bytes:
    """Serializes a manifest to YAML bytes (UTF-8)."""
    doc = {
        "format": FORMAT_NAME,
        "format_version": manifest.format_version,
        "world_size": manifest.world_size,
        "metadata": dict(manifest.metadata),
        "entries": {path: entry_to_dict(e) for path, e in manifest.entries.items()},
    }
    text = yaml.dump(
        doc,
        Dumper=_ManifestDumper,
        sort_keys=False,
        allow_unicode=True,
        width=1 << 30,
        default_flow_style=False,
    )
    return text.encode("utf-8")


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


def check_blob_path(blob: str, where: str = "blob") -> str:
    """Refuses blob paths that could escape the snapshot's root."""
    if (
        not blob
        or blob.startswith("/")
        or "\\" in blob
        or "\x00" in blob
        or ":" in blob
        or any(part in ("", ".", "..") for part in blob.split("/"))
    ):
        raise _fail(where, f"unsafe blob path {blob!r}: must be relative, without '..'")
    return blob


def _location(value: Any, where: str) -> Location:
    if not isinstance(value, list) or len(value) != 3:
        raise _fail(where, f"expected [blob, offset, nbytes], got {value!r}")
    blob, offset, nbytes = value
    return Location(
        blob=check_blob_path(_str(blob, where), where),
        offset=_int(offset, where),
        nbytes=_int(nbytes, where),
    )


def _decode_tensor(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    shape = d["shape"]
    if not isinstance(shape, list):
        raise _fail(where, f"shape must be a list, got {shape!r}")
    chunks = d["chunks"]
    if not isinstance(chunks, list):
        raise _fail(where, f"chunks must be a list, got {chunks!r}")
    return {
        "dtype": _str(d["dtype"], where),
        "shape": tuple(_int(s, where) for s in shape),
        "chunks": tuple(_location(c, where) for c in chunks),
    }


def _decode_object(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {
        "serializer": _str(d["serializer"], where),
        "obj_type": _str(d["obj_type"], where),
        "location": _location(d["location"], where),
    }


_PRIMITIVE_TYPES: dict[str, type] = {
    "int": int,
    "float": float,
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
    expected = _PRIMITIVE_TYPES.get(value_type)
    if expected is None:
        raise _fail(where, f"unknown primitive type {value_type!r}")
    if expected is float and type(value) is int:
        value = float(value)  # a hand-edited "1" for a float field
    if type(value) is not expected:
        raise _fail(where, f"value {value!r} is not of type {value_type}")
    return {"value": value}


def _decode_dict(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    keys = d["keys"]
    if not isinstance(keys, list):
        raise _fail(where, f"keys must be a list, got {keys!r}")
    for k in keys:
        if k is not None and type(k) not in (str, int, float, bool):
            raise _fail(where, f"unsupported dict key {k!r}")
    if len(set(keys)) != len(keys):
        raise _fail(where, "duplicate dict keys")
    return {"keys": tuple(keys), "ordered": _bool(d.get("ordered", False), where)}


def _decode_sequence(d: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {"length": _int(d["length"], where)}


_DECODERS: dict[
    type[Entry], tuple[Callable[[Mapping[str, Any], str], dict[str, Any]], set[str]]
] = {
    TensorEntry: (_decode_tensor, {"dtype", "shape", "chunks"}),
    ObjectEntry: (_decode_object, {"serializer", "obj_type", "location"}),
    PrimitiveEntry: (_decode_primitive, {"value_type", "value"}),
    DictEntry: (_decode_dict, {"keys", "ordered"}),
    ListEntry: (_decode_sequence, {"length"}),
    TupleEntry: (_decode_sequence, {"length"}),
}
_OPTIONAL_FIELDS = {"ordered", "replicated"}


def entry_from_dict(d: Any, where: str) -> Entry:
    """Decodes one entry, checking every field."""
    if not isinstance(d, dict):
        raise _fail(where, f"expected a mapping, got {d!r}")
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


def loads(data: bytes, source: str = "manifest") -> Manifest:
    """Parses manifest bytes; ``source`` names the file in error messages.

    Raises:
        ManifestDecodeError: the bytes are not valid UTF-8 YAML of a manifest, or any field is
            missing, of the wrong type, unsafe (a blob path leaving the root) or unknown.
        UnsupportedFormatError: the manifest's format version is newer than this library's.
    """
    try:
        doc = yaml.load(data, Loader=_Loader)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ManifestDecodeError(f"{source} is not valid YAML: {e}") from None
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
    raw_entries = doc.get("entries")
    if not isinstance(raw_entries, dict):
        raise ManifestDecodeError(f"{source}: entries missing or not a mapping")
    entries: dict[str, Entry] = {}
    for path, raw in raw_entries.items():
        if type(path) is not str:
            raise ManifestDecodeError(f"{source}: entry path {path!r} is not a string")
        try:
            entries[path] = entry_from_dict(raw, path)
        except ManifestDecodeError as e:
            raise ManifestDecodeError(f"{source}: {e}") from None
    return Manifest(
        format_version=version, world_size=world_size, entries=entries, metadata=metadata
    )
