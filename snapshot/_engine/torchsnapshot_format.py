"""Snapshots of other formats at a snapshot's path.

torchsnapshot 0.1.0: its manifest (``.snapshot_metadata``) is translated into this library's
``Manifest`` when the snapshot is opened, so the one loader reads it (restore, ``read_object``,
``statesnap ls / show / verify``); nothing is ever written there. Its entries map as follows:

- ``Tensor`` with serializer ``buffer_protocol``: a ``TensorEntry`` of one range (the whole file,
  or ``byte_range`` of a shared "batched" file); with ``torch_save``: a ``PickledTensorEntry``
  whose one piece is the file.
- ``ChunkedTensor``: its chunks are row blocks (cut along dimension 0), so a ``TensorEntry``
  whose chunks are their ranges in order; chunks cut otherwise make a ``ShardedTensorEntry``;
  chunks stored with ``torch_save`` make a ``PickledTensorEntry`` of several pieces.
- ``ShardedTensor``: every rank's shards of the same logical path merged (each rank's entry
  lists its own) into one ``ShardedTensorEntry`` (a ``PickledTensorEntry`` when pickled), put
  under every rank that had the path.
- ``object`` (always ``torch_save``): an ``ObjectEntry``, decoded by the same safe loader as
  this library's objects.
- ``int`` / ``float`` / ``str`` / ``bool`` / ``bytes``: a ``PrimitiveEntry``.
- ``dict`` / ``OrderedDict`` / ``list``: ``DictEntry`` / ``DictEntry(ordered=True)`` /
  ``ListEntry``, whose length (torchsnapshot records none) is counted from its children.
- A replicated entry is stored once, under rank 0 only: it is copied under every other rank
  of the recorded ``world_size`` that lacks it, so each rank of that world finds its state
  under its own prefix.

torchsnapshot records no checksums (every location's ``crc32`` is None) and no length for a
file holding a pickle: those lengths are asked of the store when the snapshot is opened.

Every byte of the manifest is untrusted: each field is checked for type and range, blob paths
go through the manifest codec's check (relative, no ``..``), sizes must agree with dtypes and
shapes, and pickles are only ever decoded by the safe loader.

A torch.distributed.checkpoint directory, or a single ``torch.save`` file, given as a snapshot's
path is recognized too, and refused with what to load it with instead.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import os
import re
import struct
from collections.abc import Callable, Iterable
from typing import Any

import manifest as mf
from manifest import (
    DictEntry,
    Entry,
    ListEntry,
    Location,
    Manifest,
    ObjectEntry,
    PickledTensorEntry,
    PrimitiveEntry,
    Shard,
    ShardedTensorEntry,
    TensorEntry,
)
from snapshot import knobs
from snapshot._engine.flatten import escape_key
from snapshot._engine.scheduler import call, open_plugin, read_unrecorded, refused, run
from snapshot._engine.text import printable_message
from snapshot.errors import (
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    SnapshotError,
    StorageError,
    UnsafeSnapshotError,
)
from storage_plugins import StoragePlugin, UnsafeBlobError

logger = logging.getLogger("snapshot")

METADATA_NAME = ".snapshot_metadata"
"""torchsnapshot's manifest, at the root of its snapshot."""

DCP_METADATA_NAME = ".metadata"
"""torch.distributed.checkpoint's metadata file, at the root of its checkpoint."""

FOREIGN_MARKERS = {
    METADATA_NAME: "a torchsnapshot snapshot",
    DCP_METADATA_NAME: "a torch.distributed.checkpoint (DCP) checkpoint",
}
"""Files that say a path holds another library's checkpoint, which a take must not write into."""

# The translated manifest holds at most this many entries (a replicated entry is copied under
# every rank: a damaged world_size must not make the translation build billions of them).
_MAX_ENTRIES = 10_000_000
# The largest number of elements a tensor may claim (a damaged shape must not overflow sizes).
_MAX_NUMEL = 1 << 62

# torchsnapshot 0.1.0's dtype names ("torch.float32") and their sizes in bytes.
_DTYPES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "qint32": 4,
    "qint8": 1,
    "quint8": 1,
}
_QUANTIZED = {"qint32", "qint8", "quint8"}
_PRIMITIVES = {"int", "float", "str", "bool", "bytes"}
_INT_TEXT = re.compile(r"[-+]?[0-9]{1,4000}")
_RANK = re.compile(r"0|[1-9][0-9]{0,8}")

SizeOf = Callable[[str], int]

# What a list entry stands as until every entry is known (then its length is counted).
_LIST = ListEntry(length=0)


# ---------------------------------------------------------------------------------------------
# Opening a path that holds no manifest of ours.


def open_foreign(
    plugin: StoragePlugin, where: str, url: str, storage_options: dict[str, Any] | None
) -> Manifest | None:
    """What ``url`` (opened as ``plugin``, described as ``where``) holds when it has no
    ``manifest.yaml``: a torchsnapshot snapshot's manifest, translated; None when nothing is
    recognized there.

    Raises:
        IncompatibleSnapshotError: ``url`` holds a DCP checkpoint or is a ``torch.save`` file
            (the message says how to load it), or a torchsnapshot snapshot of a layout this
            translator does not know.
        CorruptSnapshotError: the torchsnapshot manifest is damaged.
    """
    try:
        data = run(_read_if_present(plugin, where, METADATA_NAME))
        if data is not None:
            return translate(data, where, _SizeCache(plugin, where))
        dcp = run(_exists(plugin, where, DCP_METADATA_NAME))
    except SnapshotError:
        raise
    except UnsafeBlobError as e:  # DCP's marker, or a link on the way to it
        raise refused(where, e) from e
    except Exception as e:
        raise StorageError(f"cannot read the torchsnapshot manifest of {where}: {e}") from e
    if dcp:
        raise IncompatibleSnapshotError(
            f"{where} holds a torch.distributed.checkpoint (DCP) checkpoint ({DCP_METADATA_NAME}"
            "), not a statesnap snapshot: load it with torch.distributed.checkpoint.load("
            f"state_dict, checkpoint_id={url!r}), or convert it to one torch.save file with "
            "torch.distributed.checkpoint.format_utils.dcp_to_torch_save"
            f"({url!r}, 'checkpoint.pt')"
        )
    kind = _single_file(url, storage_options)
    if kind is not None:
        raise IncompatibleSnapshotError(
            f"{where} is {kind}, not a statesnap snapshot (a directory): load it with "
            f"torch.load({url!r}, weights_only=True) and give each object its part "
            "(model.load_state_dict(...))"
        )
    return None


async def _read_if_present(plugin: StoragePlugin, where: str, name: str) -> bytes | None:
    try:
        return await read_unrecorded(plugin, name, where)
    except (FileNotFoundError, NotADirectoryError):
        return None


async def _exists(plugin: StoragePlugin, where: str, name: str) -> bool:
    try:
        return await call(plugin, "check", name, where, lambda: plugin.exists(name), convert=False)
    except (FileNotFoundError, NotADirectoryError):
        return False


def _single_file(url: str, storage_options: dict[str, Any] | None) -> str | None:
    """What the local file at ``url`` is, when ``torch.save`` wrote it: a snapshot's path names
    a directory, so the file is looked for in its parent. None when it is not such a file, or
    ``url`` is not a local path (best effort: only the message differs; on an object store the
    look would cost a second client and a request for every path without a snapshot)."""
    if "://" in url and not url.startswith("file://"):
        return None
    # The path the user named may be a link (their choice, so it is followed, once); the
    # plugin then opens the file without following anything.
    parent, name = os.path.split(os.path.realpath(os.path.expanduser(url.removeprefix("file://"))))
    if not name:
        return None
    try:
        plugin = open_plugin(parent, storage_options)
    except SnapshotError:
        return None
    try:
        head = run(_head(plugin, name, 512))
    except Exception:
        logger.debug("could not look at %s as a file", url, exc_info=True)
        return None
    finally:
        run(plugin.close())
    return _torch_save_kind(head) if head is not None else None


async def _head(plugin: StoragePlugin, name: str, limit: int) -> bytes | None:
    """The first ``limit`` bytes (or fewer, if it is shorter) of blob ``name``; None when there
    is no such blob."""
    if not await plugin.exists(name):
        return None
    size = await plugin.size(name)
    if size is None:
        out = memoryview(bytearray(limit))
        try:
            await plugin.read_into(name, 0, out)
            return bytes(out)
        except EOFError:
            return await plugin.read(name)  # shorter than ``limit``
    out = memoryview(bytearray(min(size, limit)))
    await plugin.read_into(name, 0, out)
    return bytes(out)


# torch.save's legacy format starts with the pickle (protocol 2) of its magic number.
_LEGACY_TORCH_SAVE = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


def _torch_save_kind(head: bytes) -> str | None:
    """Whether bytes starting with ``head`` are a ``torch.save`` file, and which format."""
    if head.startswith(b"PK\x03\x04") and len(head) >= 30:
        # A zip archive whose first member is "<archive name>/data.pkl": torch.save's.
        name_len = int.from_bytes(head[26:28], "little")
        name = head[30 : 30 + name_len]
        if name == b"data.pkl" or name.endswith(b"/data.pkl"):
            return "a torch.save file (zip format)"
    if head.startswith(_LEGACY_TORCH_SAVE):
        return "a torch.save file (legacy format)"
    return None


class _SizeCache:
    """The lengths of whole-file blobs (torchsnapshot records none for a pickle's file), asked
    of the store together, a few at a time; a missing blob counts as empty, so reading it
    later fails naming it and ``verify`` reports it missing."""

    def __init__(self, plugin: StoragePlugin, where: str) -> None:
        self.plugin = plugin
        self.where = where
        self.sizes: dict[str, int] = {}

    def fetch(self, blobs: Iterable[str]) -> None:
        wanted = sorted(set(blobs) - set(self.sizes))
        if wanted:
            run(self._fetch_all(wanted))

    async def _fetch_all(self, blobs: list[str]) -> None:
        plugin, where = self.plugin, self.where
        limit = asyncio.Semaphore(knobs.max_concurrent_io())

        async def one(blob: str) -> None:
            async with limit:
                try:
                    size = await call(
                        plugin, "check", blob, where, lambda: plugin.size(blob), convert=False
                    )
                    if size is None:  # the store cannot tell: the pickle is read to learn it
                        data = await call(
                            plugin, "read", blob, where, lambda: plugin.read(blob), convert=False
                        )
                        size = len(data)
                except (FileNotFoundError, NotADirectoryError):
                    size = 0
                self.sizes[blob] = size

        await asyncio.gather(*(one(b) for b in blobs))

    def __call__(self, blob: str) -> int:
        return self.sizes[blob]


# ---------------------------------------------------------------------------------------------
# Translation.


def translate(data: bytes, where: str, sizes: _SizeCache) -> Manifest:
    """The ``Manifest`` of a torchsnapshot snapshot whose ``.snapshot_metadata`` holds
    ``data``. ``sizes`` gives the length of a whole-file blob (``sizes(blob)``) after
    ``sizes.fetch(blobs)`` was called with every blob it will be asked about.

    Raises:
        CorruptSnapshotError: the manifest is not valid, or a field is missing, of the wrong
            type or out of range (a blob path leaving the root, a size that does not fit the
            dtype and shape).
        IncompatibleSnapshotError: an entry type, serializer or dtype this translator does not
            know.
    """
    source = f"{where}/{METADATA_NAME}"
    doc = _parse(data, source)
    version, world_size, raw = _header(doc, source)
    # Two passes: the first checks everything and learns which blobs hold pickles (whose
    # lengths the store must give), the second builds the entries with those lengths.
    wanted: set[str] = set()

    def record(blob: str) -> int:
        wanted.add(blob)
        return 0

    _Translator(source, version, world_size, raw, record).run()
    sizes.fetch(wanted)
    entries = _Translator(source, version, world_size, raw, sizes).run()
    sharded = any(type(e) is ShardedTensorEntry for e in entries.values())
    return Manifest(
        format_version=2 if sharded else 1,
        world_size=world_size,
        entries=entries,
        metadata={"library": f"torchsnapshot {version}", "format": "torchsnapshot"},
    )


def _parse(data: bytes, source: str) -> Any:
    """The document: torchsnapshot 0.1.0 writes JSON (which is YAML) and reads it as YAML; the
    JSON decoder reads it exactly, the YAML safe loader anything else."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptSnapshotError(f"{source} is not UTF-8 text: {e}") from None
    # Text nesting deeper than the codec's limit (or not balanced) goes to the YAML reader,
    # which refuses it without recursing; so does any YAML feature torchsnapshot never wrote
    # (its aliases would make the translation walk shared values once per reference).
    if mf.nests_within(text, mf.MAX_DEPTH):
        try:
            return json.loads(text)
        except ValueError:
            pass
    try:
        return mf.load_yaml(text, source)
    except mf.UnsafeManifestError as e:
        raise UnsafeSnapshotError(printable_message(str(e))) from None
    except mf.ManifestDecodeError as e:
        raise CorruptSnapshotError(
            printable_message(f"{source} is neither JSON nor YAML: {e}")
        ) from None


def _header(doc: Any, source: str) -> tuple[str, int, dict[str, Any]]:
    if not isinstance(doc, dict) or set(doc) != {"version", "world_size", "manifest"}:
        keys = sorted(map(str, doc)) if isinstance(doc, dict) else type(doc).__name__
        raise CorruptSnapshotError(
            f"{source}: expected a mapping of version, world_size and manifest, got {keys}"
        )
    version, world_size, raw = doc["version"], doc["world_size"], doc["manifest"]
    if type(version) is not str or len(version) > 100:
        raise CorruptSnapshotError(f"{source}: version must be a short string, got {version!r}")
    if type(world_size) is not int or world_size < 1:
        raise CorruptSnapshotError(f"{source}: world_size must be >= 1, got {world_size!r}")
    if not isinstance(raw, dict):
        raise CorruptSnapshotError(f"{source}: manifest must be a mapping")
    return version, world_size, raw


class _Translator:
    """One pass over a torchsnapshot manifest: its entries, checked, as this library's."""

    def __init__(
        self, source: str, version: str, world_size: int, raw: dict[Any, Any], size_of: SizeOf
    ) -> None:
        self.source = source
        self.version = version
        self.world_size = world_size
        self.raw = raw
        self.size_of = size_of

    # -- errors -----------------------------------------------------------------------------

    # The path, the version and what is wrong all quote the manifest being translated:
    # escaped, so that a message carries none of its control characters.

    def corrupt(self, path: str, what: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(printable_message(f"{self.source}: {path}: {what}"))

    def unknown(self, path: str, what: str) -> IncompatibleSnapshotError:
        return IncompatibleSnapshotError(
            printable_message(
                f"{self.source}: {path}: {what}; the snapshot was written by torchsnapshot "
                f"{self.version}, and statesnap reads the layout of torchsnapshot 0.1.0"
            )
        )

    # -- the whole manifest -----------------------------------------------------------------

    def run(self) -> dict[str, Entry]:
        # Per rank, its (logical path, entry) in order; None for a sharded tensor's place.
        by_rank: dict[int, list[tuple[str, Entry | None]]] = {}
        sharded: dict[str, list[tuple[int, dict[str, Any]]]] = {}  # logical path -> shards
        for path, raw in self.raw.items():
            if type(path) is not str:
                raise CorruptSnapshotError(f"{self.source}: entry path {path!r} is not a string")
            rank_text, sep, logical = path.partition("/")
            if not sep or not logical or not _RANK.fullmatch(rank_text):
                raise self.corrupt(path, "a path must start with a rank: '<rank>/<key>...'")
            rank = int(rank_text)
            if rank >= self.world_size:
                raise self.corrupt(path, f"rank {rank} of a world of {self.world_size}")
            if not isinstance(raw, dict):
                raise self.corrupt(path, f"expected a mapping, got {type(raw).__name__}")
            if raw.get("type") == "ShardedTensor":
                self.fields(path, raw, {"type", "shards"})
                shards = raw["shards"]
                if not isinstance(shards, list) or not shards:
                    raise self.corrupt(path, "shards must be a non-empty list")
                sharded.setdefault(logical, []).extend((rank, s) for s in shards)
                entry: Entry | None = None  # made once every rank's shards are known
            else:
                entry = self.entry(path, logical, raw)
            by_rank.setdefault(rank, []).append((logical, entry))
        merged = {logical: self.sharded(logical, shards) for logical, shards in sharded.items()}
        return self.expand(by_rank, merged)

    def expand(
        self, by_rank: dict[int, list[tuple[str, Entry | None]]], merged: dict[str, Entry]
    ) -> dict[str, Entry]:
        """Every rank's entries, rank by rank; a replicated leaf of rank 0 copied under every
        other rank that lacks it; list lengths counted from the children."""
        replicated = [
            (logical, e)
            for logical, e in by_rank.get(0, [])
            if e is not None and e.replicated and not mf.is_container(e)
        ]
        total = sum(map(len, by_rank.values()))
        if replicated and total + len(replicated) * (self.world_size - 1) > _MAX_ENTRIES:
            raise CorruptSnapshotError(
                f"{self.source}: {len(replicated)} replicated entries copied under each of "
                f"{self.world_size} ranks would make more than {_MAX_ENTRIES:,} entries"
            )
        entries: dict[str, Entry] = {}
        ranks = range(self.world_size) if replicated else sorted(by_rank)
        for rank in ranks:
            prefix = f"{rank}/"
            for logical, entry in by_rank.get(rank, []):
                entries[prefix + logical] = entry if entry is not None else merged[logical]
            if rank:
                for logical, entry in replicated:
                    entries.setdefault(prefix + logical, entry)
        return self.count_lists(entries)

    def count_lists(self, entries: dict[str, Entry]) -> dict[str, Entry]:
        """torchsnapshot's list entries record no length: each is the number of its children
        (``<list>/0``, ``<list>/1``, ...), which must be numbered from 0 without a gap."""
        children: dict[str, set[str]] = {p: set() for p, e in entries.items() if e is _LIST}
        for path in entries:
            parent, _, name = path.rpartition("/")
            if parent in children:
                children[parent].add(name)
        for path, names in children.items():
            length = len(names)
            if names != {str(i) for i in range(length)}:
                raise self.corrupt(
                    path, f"a list's children must be numbered 0 to {length - 1}, got {names}"
                )
            entries[path] = ListEntry(length=length)
        return entries

    # -- one entry --------------------------------------------------------------------------

    def fields(
        self, path: str, raw: dict[str, Any], required: set[str], optional: Iterable[str] = ()
    ) -> None:
        keys = set(raw)
        missing = required - keys
        unknown = keys - required - set(optional)
        if missing or unknown:
            raise self.corrupt(
                path,
                f"{raw.get('type')} entry: missing fields {sorted(missing)}, unknown "
                f"{sorted(map(str, unknown))}",
            )

    def replicated(self, path: str, raw: dict[str, Any]) -> bool:
        value = raw["replicated"]
        if type(value) is not bool:
            raise self.corrupt(path, f"replicated must be true or false, got {value!r}")
        return value

    def entry(self, path: str, logical: str, raw: dict[str, Any]) -> Entry:
        """The entry of one path; ``_LIST`` for a list (its length is counted once every entry
        is known)."""
        kind = raw.get("type")
        if kind == "list":
            self.fields(path, raw, {"type"})
            return _LIST
        if kind in ("dict", "OrderedDict"):
            self.fields(path, raw, {"type", "keys"})
            return DictEntry(keys=self.keys(path, raw["keys"]), ordered=kind == "OrderedDict")
        if kind in _PRIMITIVES:
            self.fields(path, raw, {"type", "serialized_value", "replicated"}, {"readable"})
            return PrimitiveEntry(
                value=self.primitive(path, kind, raw["serialized_value"]),
                replicated=self.replicated(path, raw),
            )
        if kind == "Tensor":
            box = self.tensor(path, raw)
            return self.stored_whole(path, logical, box, self.replicated(path, raw))
        if kind == "ChunkedTensor":
            self.fields(path, raw, {"type", "dtype", "shape", "chunks", "replicated"})
            return self.chunked(path, logical, raw)
        if kind == "object":
            self.fields(path, raw, {"type", "location", "serializer", "obj_type", "replicated"})
            if raw["serializer"] != "torch_save":
                raise self.unknown(path, f"object serializer {raw['serializer']!r}")
            obj_type = raw["obj_type"]
            if type(obj_type) is not str:
                raise self.corrupt(path, f"obj_type must be a string, got {obj_type!r}")
            blob = self.blob(path, raw["location"])
            return ObjectEntry(
                serializer="torch_save",
                obj_type=obj_type.removeprefix("builtins."),
                location=Location(blob=blob, offset=0, nbytes=self.size_of(blob)),
                replicated=self.replicated(path, raw),
            )
        raise self.unknown(path, f"unknown entry type {kind!r}")

    def keys(self, path: str, keys: Any) -> tuple[Any, ...]:
        if not isinstance(keys, list):
            raise self.corrupt(path, f"keys must be a list, got {keys!r}")
        names = set()
        for k in keys:
            if type(k) not in (str, int, bool):
                raise self.corrupt(path, f"unsupported dict key {k!r}")
            names.add(escape_key(k))
        if len(names) != len(keys):
            raise self.corrupt(path, "two keys name the same child")
        return tuple(keys)

    def primitive(self, path: str, kind: str, text: Any) -> Any:
        if type(text) is not str:
            raise self.corrupt(path, f"serialized_value must be a string, got {text!r}")
        if kind == "str":
            return text
        if kind == "int":
            if not _INT_TEXT.fullmatch(text):
                raise self.corrupt(path, f"{text[:40]!r} is not an integer")
            return int(text)
        if kind == "bool":
            if text not in ("True", "False"):
                raise self.corrupt(path, f"{text[:40]!r} is not True or False")
            return text == "True"
        try:
            raw = base64.b64decode(text, validate=True)
        except binascii.Error as e:
            raise self.corrupt(path, f"{kind} value is not valid base64: {e}") from None
        if kind == "bytes":
            return raw
        if len(raw) != 8:  # a float: a C double, in the byte order of the writer (as tensors)
            raise self.corrupt(path, f"a float is 8 bytes, got {len(raw)}")
        return struct.unpack("d", raw)[0]

    def blob(self, path: str, location: Any) -> str:
        if type(location) is not str:
            raise self.corrupt(path, f"location must be a string, got {location!r}")
        try:
            return mf.check_blob_path(location, "location")
        except mf.UnsafeManifestError as e:  # a path leaving the root: never followed
            raise UnsafeSnapshotError(printable_message(f"{self.source}: {path}: {e}")) from None

    def dims(self, path: str, value: Any, what: str) -> tuple[int, ...]:
        if not isinstance(value, list) or len(value) > 64:
            raise self.corrupt(path, f"{what} must be a list of at most 64 sizes, got {value!r}")
        if not all(type(x) is int and 0 <= x <= _MAX_NUMEL for x in value):
            raise self.corrupt(path, f"{what} must hold sizes >= 0, got {value!r}")
        if math.prod(value) > _MAX_NUMEL:
            raise self.corrupt(path, f"{what} {value} holds too many elements")
        return tuple(value)

    def dtype(self, path: str, value: Any) -> str:
        if type(value) is not str or not value.startswith("torch."):
            raise self.corrupt(path, f"dtype must be a string 'torch.<name>', got {value!r}")
        name = value.removeprefix("torch.")
        if name not in _DTYPES:
            raise self.unknown(path, f"dtype {value!r}")
        return name

    def tensor(self, path: str, raw: Any) -> tuple[str, tuple[int, ...], bool, Location]:
        """A stored ``Tensor`` entry (alone, or a chunk's or shard's): dtype, shape, whether it
        is pickled, and where its bytes are."""
        if not isinstance(raw, dict) or raw.get("type") != "Tensor":
            raise self.corrupt(path, f"expected a Tensor entry, got {raw!r:.200}")
        self.fields(
            path,
            raw,
            {"type", "location", "serializer", "dtype", "shape", "replicated"},
            {"byte_range"},
        )
        self.replicated(path, raw)
        dtype = self.dtype(path, raw["dtype"])
        shape = self.dims(path, raw["shape"], "shape")
        blob = self.blob(path, raw["location"])
        serializer = raw["serializer"]
        byte_range = raw.get("byte_range")
        if byte_range is not None and (
            not isinstance(byte_range, list)
            or len(byte_range) != 2
            or not all(type(x) is int for x in byte_range)
            or not 0 <= byte_range[0] <= byte_range[1]
        ):
            raise self.corrupt(path, f"byte_range must be [start, end], got {byte_range!r}")
        if serializer == "buffer_protocol":
            if dtype in _QUANTIZED:
                raise self.corrupt(path, f"a {dtype} tensor has no raw layout")
            nbytes = math.prod(shape) * _DTYPES[dtype]
            offset = 0
            if byte_range is not None:
                offset = byte_range[0]
                if byte_range[1] - offset != nbytes:
                    raise self.corrupt(
                        path,
                        f"byte_range {byte_range} holds {byte_range[1] - offset} bytes; a "
                        f"{dtype}{list(shape)} tensor needs {nbytes}",
                    )
            return dtype, shape, False, Location(blob=blob, offset=offset, nbytes=nbytes)
        if serializer == "torch_save":
            if byte_range is None:
                loc = Location(blob=blob, offset=0, nbytes=self.size_of(blob))
            else:
                start, end = byte_range
                loc = Location(blob=blob, offset=start, nbytes=end - start)
            return dtype, shape, True, loc
        raise self.unknown(path, f"tensor serializer {serializer!r}")

    def stored_whole(
        self,
        path: str,
        logical: str,
        box: tuple[str, tuple[int, ...], bool, Location],
        replicated: bool,
    ) -> Entry:
        dtype, shape, pickled, loc = box
        if pickled:
            piece = Shard(offsets=(0,) * len(shape), sizes=shape, chunks=(loc,))
            return PickledTensorEntry(
                dtype=dtype, shape=shape, pieces=(piece,), replicated=replicated
            )
        return TensorEntry(dtype=dtype, shape=shape, chunks=(loc,), replicated=replicated)

    def boxes(
        self, path: str, dtype: str, shape: tuple[int, ...], raw_list: list[Any], what: str
    ) -> tuple[list[Shard], bool]:
        """The pieces of a chunked or sharded tensor, by offset, and whether they are pickled."""
        pieces = []
        pickled_kinds = set()
        for raw in raw_list:
            if not isinstance(raw, dict) or set(raw) != {"offsets", "sizes", "tensor"}:
                raise self.corrupt(path, f"expected a {what} {{offsets, sizes, tensor}}")
            offsets = self.dims(path, raw["offsets"], f"a {what}'s offsets")
            sizes = self.dims(path, raw["sizes"], f"a {what}'s sizes")
            t_dtype, t_shape, pickled, loc = self.tensor(path, raw["tensor"])
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise self.corrupt(path, f"a {what} at {list(offsets)} of a {len(shape)}-d tensor")
            if any(o + n > s for o, n, s in zip(offsets, sizes, shape, strict=True)):
                raise self.corrupt(
                    path, f"a {what} at {list(offsets)} of size {list(sizes)} exceeds {list(shape)}"
                )
            if t_dtype != dtype or t_shape != sizes:
                raise self.corrupt(
                    path,
                    f"a {what} of size {list(sizes)} holds a {t_dtype}{list(t_shape)} tensor; "
                    f"the entry is {dtype}",
                )
            pickled_kinds.add(pickled)
            pieces.append(Shard(offsets=offsets, sizes=sizes, chunks=(loc,)))
        if len(pickled_kinds) > 1:
            raise self.unknown(path, f"some {what}s pickled and others raw")
        pieces.sort(key=lambda p: p.offsets)
        return pieces, pickled_kinds == {True}

    def chunked(self, path: str, logical: str, raw: dict[str, Any]) -> Entry:
        dtype = self.dtype(path, raw["dtype"])
        shape = self.dims(path, raw["shape"], "shape")
        replicated = self.replicated(path, raw)
        chunks = raw["chunks"]
        if not isinstance(chunks, list) or not chunks:
            raise self.corrupt(path, "chunks must be a non-empty list")
        # torchsnapshot cuts a 0-d tensor as its 1-element view: one chunk of it.
        view = shape if shape else (1,)
        pieces, pickled = self.boxes(path, dtype, view, chunks, "chunk")
        if not shape:
            if len(pieces) != 1 or pickled:
                raise self.unknown(path, "a 0-d tensor cut into chunks")
            chunk = pieces[0].chunks
            return TensorEntry(dtype=dtype, shape=shape, chunks=chunk, replicated=replicated)
        if pickled:
            return PickledTensorEntry(
                dtype=dtype, shape=shape, pieces=tuple(pieces), replicated=replicated
            )
        if _row_blocks(shape, pieces):
            # Row blocks, in order: their bytes, one after another, are the tensor's.
            locs = tuple(p.chunks[0] for p in pieces)
            return TensorEntry(dtype=dtype, shape=shape, chunks=locs, replicated=replicated)
        return ShardedTensorEntry(
            key=logical, dtype=dtype, shape=shape, shards=tuple(pieces), replicated=replicated
        )

    def sharded(self, logical: str, shards: list[tuple[int, Any]]) -> Entry:
        """One entry for every rank's shards of the sharded tensor at ``logical``."""
        path = f"{shards[0][0]}/{logical}"
        raws = [s for _, s in shards]
        first = raws[0].get("tensor") if isinstance(raws[0], dict) else None
        if not isinstance(first, dict) or not isinstance(raws[0].get("sizes"), list):
            raise self.corrupt(path, "expected a shard {offsets, sizes, tensor}")
        dtype = self.dtype(path, first.get("dtype"))
        ndim = len(raws[0]["sizes"])
        # The global shape: the far corner of the shards (torchsnapshot records no shape).
        shape = [0] * ndim
        for raw in raws:
            if not isinstance(raw, dict):
                raise self.corrupt(path, "expected a shard {offsets, sizes, tensor}")
            offsets = self.dims(path, raw.get("offsets"), "a shard's offsets")
            sizes = self.dims(path, raw.get("sizes"), "a shard's sizes")
            if len(offsets) != ndim or len(sizes) != ndim:
                raise self.corrupt(path, "shards of different dimensions")
            shape = [max(g, o + n) for g, o, n in zip(shape, offsets, sizes, strict=True)]
        dims = self.dims(path, shape, "the global shape")
        pieces, pickled = self.boxes(path, dtype, dims, raws, "shard")
        if pickled:
            return PickledTensorEntry(dtype=dtype, shape=dims, pieces=tuple(pieces))
        return ShardedTensorEntry(key=logical, dtype=dtype, shape=dims, shards=tuple(pieces))


def _row_blocks(shape: tuple[int, ...], pieces: list[Shard]) -> bool:
    """Whether ``pieces`` (by offset) are whole rows ``[a, b)``, ``[b, c)``, ... covering
    ``shape``'s first axis."""
    row = 0
    for p in pieces:
        if p.offsets[0] != row or p.offsets[1:] != (0,) * (len(shape) - 1):
            return False
        if p.sizes[1:] != shape[1:]:
            return False
        row += p.sizes[0]
    return row == shape[0]
