"""Snapshots of other formats at a snapshot's path.

torchsnapshot 0.1.0: its manifest (``.snapshot_metadata``) is translated into this library's
``Manifest`` when the snapshot is opened, so the one loader reads it. torchsnapshot records no
checksums, nor the lengths of pickles' files (``translate`` asks for them). Its entries map so:

- ``Tensor``: a ``TensorEntry`` of one range (the file, or ``byte_range`` of a batched file);
  with serializer ``torch_save``, a ``PickledTensorEntry`` whose one piece is the file.
- ``ChunkedTensor``: row blocks make a ``TensorEntry`` of their ranges in order; chunks cut
  otherwise a ``ShardedTensorEntry``; pickled chunks a ``PickledTensorEntry`` of several pieces.
- ``ShardedTensor``: every rank's shards of one logical path merged into one
  ``ShardedTensorEntry`` (``PickledTensorEntry`` when pickled), under every rank that had it.
- ``object`` (``torch_save``): an ``ObjectEntry``; ``int`` / ``float`` / ``str`` / ``bool`` /
  ``bytes``: a ``PrimitiveEntry``; ``dict`` / ``OrderedDict`` / ``list``: ``DictEntry`` /
  ``DictEntry(ordered=True)`` / ``ListEntry`` (its length counted from its children).
- A replicated entry, stored under rank 0 only, is copied under every other rank the manifest
  lists that lacks it.

Every byte of it is untrusted: each field is checked for type and range, blob paths by the
manifest's check, and sizes against dtypes and shapes.

A torch.distributed.checkpoint directory is recognized by its marker (``FOREIGN_MARKERS``)
and translated by :mod:`.dcp_format`; a take never writes into it.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

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
from snapshot._engine.format.text import printable_message
from snapshot._engine.state_dicts import escape_key
from snapshot.errors import (
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    UnsafeSnapshotError,
)

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
# every listed rank: ranks times replicated leaves grows as the square of the manifest's size).
_MAX_ENTRIES = 10_000_000
# The largest number of elements a tensor may claim (a damaged shape must not overflow sizes).
_MAX_NUMEL = 1 << 62

# torchsnapshot 0.1.0's dtype names ("torch.float32") and their sizes in bytes.
_QUANTIZED = {"qint32", "qint8", "quint8"}
_RAW = "float64 float32 float16 bfloat16 complex128 complex64 int64 int32 int16 int8 uint8 bool"
_DTYPES = {name: getattr(torch, name).itemsize for name in [*_RAW.split(), *_QUANTIZED]}
_PRIMITIVES = {"int", "float", "str", "bool", "bytes"}
_REPLICABLE = {"type", "replicated"}
# Each entry type's fields: the required ones, and the optional ones.
_FIELDS: dict[str, tuple[set[str], set[str]]] = {
    "list": ({"type"}, set()),
    "dict": ({"type", "keys"}, set()),
    "OrderedDict": ({"type", "keys"}, set()),
    "ShardedTensor": ({"type", "shards"}, set()),
    "Tensor": ({*_REPLICABLE, "location", "serializer", "dtype", "shape"}, {"byte_range"}),
    "ChunkedTensor": ({*_REPLICABLE, "dtype", "shape", "chunks"}, set()),
    "object": ({*_REPLICABLE, "location", "serializer", "obj_type"}, set()),
    **dict.fromkeys(_PRIMITIVES, ({*_REPLICABLE, "serialized_value"}, {"readable"})),
}
_INT_TEXT = re.compile(r"[-+]?[0-9]{1,4000}")
_RANK = re.compile(r"0|[1-9][0-9]{0,8}")

# A stored tensor (alone, or a chunk's or shard's): dtype, shape, whether pickled, its bytes.
Stored = tuple[str, tuple[int, ...], bool, Location]

# What a list entry stands as until every entry is known (then its length is counted).
_LIST = ListEntry(length=0)


def translate(
    data: bytes, where: str, sizes_of: Callable[[Iterable[str]], dict[str, int]]
) -> Manifest:
    """The ``Manifest`` of a torchsnapshot snapshot whose ``.snapshot_metadata`` holds
    ``data``; ``sizes_of(blobs)`` gives the lengths of whole-file blobs.

    Raises:
        CorruptSnapshotError: the manifest is not valid, or a field is missing, of the wrong
            type or out of range (a blob path leaving the root, a size that does not fit the
            dtype and shape).
        IncompatibleSnapshotError: an entry type, serializer or dtype this translator does not
            know.
    """
    source = f"{where}/{METADATA_NAME}"
    doc = _parse(data, source)
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
    translator = _Translator(source, version, world_size)
    entries = translator.entries(raw)
    # Every entry checked, the lengths of the pickles' files are asked once for all.
    whole = translator.whole_files
    sizes = sizes_of({loc.blob for loc in whole}) if whole else {}
    for loc in whole:
        loc.nbytes = sizes[loc.blob]
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


@dataclass
class _Translator:
    """Checks a torchsnapshot manifest's entries and translates them into this library's.
    ``whole_files`` are the locations of whole-file pickles: their lengths are filled in once
    every entry is checked (``translate``)."""

    source: str
    version: str
    world_size: int
    whole_files: list[Location] = field(default_factory=list)

    # Messages quote the manifest: escaped, so that they carry none of its control characters.

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

    def entries(self, raw: dict[Any, Any]) -> dict[str, Entry]:
        """Every rank's entries, rank by rank: the shards of a sharded tensor merged, a
        replicated leaf of rank 0 copied under every other rank the manifest lists (not every
        rank of ``world_size``, which a few bytes can make millions) that lacks it, at most
        ``_MAX_ENTRIES`` in all; list lengths counted."""
        # Per rank, its (logical path, entry) in order; None for a sharded tensor's place.
        by_rank: dict[int, list[tuple[str, Entry | None]]] = {}
        sharded: dict[str, list[tuple[int, Any]]] = {}  # logical path -> shards
        for path, value in raw.items():
            if type(path) is not str:
                raise CorruptSnapshotError(f"{self.source}: entry path {path!r} is not a string")
            rank_text, sep, logical = path.partition("/")
            if not sep or not logical or not _RANK.fullmatch(rank_text):
                raise self.corrupt(path, "a path must start with a rank: '<rank>/<key>...'")
            rank = int(rank_text)
            if rank >= self.world_size:
                raise self.corrupt(path, f"rank {rank} of a world of {self.world_size}")
            if not isinstance(value, dict):
                raise self.corrupt(path, f"expected a mapping, got {type(value).__name__}")
            if value.get("type") == "ShardedTensor":
                self.fields(path, value)
                shards = value["shards"]
                if not isinstance(shards, list) or not shards:
                    raise self.corrupt(path, "shards must be a non-empty list")
                sharded.setdefault(logical, []).extend((rank, s) for s in shards)
                entry: Entry | None = None  # made once every rank's shards are known
            else:
                entry = self.entry(path, logical, value)
            by_rank.setdefault(rank, []).append((logical, entry))
        merged = {logical: self.sharded(logical, shards) for logical, shards in sharded.items()}
        replicated = [
            (logical, e)
            for logical, e in by_rank.get(0, [])
            if e is not None and e.replicated and not mf.is_container(e)
        ]
        ranks = sorted(by_rank)
        total = sum(map(len, by_rank.values()))
        if replicated and total + len(replicated) * (len(ranks) - 1) > _MAX_ENTRIES:
            raise CorruptSnapshotError(
                f"{self.source}: {len(replicated)} replicated entries copied under each of "
                f"{len(ranks)} ranks would make more than {_MAX_ENTRIES:,} entries"
            )
        entries: dict[str, Entry] = {}
        for rank in ranks:
            prefix = f"{rank}/"
            for logical, entry in by_rank[rank]:
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

    def fields(self, path: str, raw: dict[str, Any]) -> bool:
        """Checks that ``raw`` holds the fields of its type (``_FIELDS``); whether it is
        replicated."""
        kind = raw.get("type")
        if kind not in _FIELDS:
            raise self.unknown(path, f"unknown entry type {kind!r}")
        required, optional = _FIELDS[kind]
        missing = required - raw.keys()
        unknown = raw.keys() - required - optional
        if missing or unknown:
            raise self.corrupt(
                path,
                f"{kind} entry: missing fields {sorted(missing)}, unknown "
                f"{sorted(map(str, unknown))}",
            )
        replicated = raw.get("replicated", False)
        if type(replicated) is not bool:
            raise self.corrupt(path, f"replicated must be true or false, got {replicated!r}")
        return replicated

    def entry(self, path: str, logical: str, raw: dict[str, Any]) -> Entry:
        """The entry of one path; ``_LIST`` for a list (its length is counted once every entry
        is known)."""
        kind = raw.get("type")
        replicated = self.fields(path, raw)
        if kind == "list":
            return _LIST
        if kind in ("dict", "OrderedDict"):
            return DictEntry(keys=self.keys(path, raw["keys"]), ordered=kind == "OrderedDict")
        if kind in _PRIMITIVES:
            value = self.primitive(path, kind, raw["serialized_value"])
            return PrimitiveEntry(value=value, replicated=replicated)
        if kind == "Tensor":
            dtype, shape, pickled, loc = self.tensor(path, raw)
            if pickled:
                piece = Shard(offsets=(0,) * len(shape), sizes=shape, chunks=(loc,))
                return PickledTensorEntry(
                    dtype=dtype, shape=shape, pieces=(piece,), replicated=replicated
                )
            return TensorEntry(dtype=dtype, shape=shape, chunks=(loc,), replicated=replicated)
        if kind == "ChunkedTensor":
            return self.chunked(path, logical, raw, replicated)
        if kind == "object":
            if raw["serializer"] != "torch_save":
                raise self.unknown(path, f"object serializer {raw['serializer']!r}")
            obj_type = raw["obj_type"]
            if type(obj_type) is not str:
                raise self.corrupt(path, f"obj_type must be a string, got {obj_type!r}")
            blob = self.blob(path, raw["location"])
            return ObjectEntry(
                serializer="torch_save",
                obj_type=obj_type.removeprefix("builtins."),
                location=self.whole_file(blob),
                replicated=replicated,
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
            blob = mf.check_blob_path(location, "location")
        except mf.UnsafeManifestError as e:  # a path leaving the root: never followed
            raise UnsafeSnapshotError(printable_message(f"{self.source}: {path}: {e}")) from None
        # The codec's check lets one leading ``../<name>/`` through (an incremental take's
        # reference to a sibling snapshot); torchsnapshot never wrote one, so a location here
        # is a plain path inside the snapshot, or refused.
        if mf.reference_of(blob) is not None:
            raise UnsafeSnapshotError(
                printable_message(
                    f"{self.source}: {path}: location {location!r} names a sibling snapshot; a "
                    "torchsnapshot manifest holds no references, only paths inside the snapshot"
                )
            )
        return blob

    def whole_file(self, blob: str) -> Location:
        """The location of all of ``blob``, whose length ``translate`` fills in."""
        loc = Location(blob=blob, offset=0, nbytes=0)
        self.whole_files.append(loc)
        return loc

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

    def tensor(self, path: str, raw: Any) -> Stored:
        """A stored ``Tensor`` entry (alone, or a chunk's or shard's): dtype, shape, whether it
        is pickled, and where its bytes are."""
        if not isinstance(raw, dict) or raw.get("type") != "Tensor":
            raise self.corrupt(path, f"expected a Tensor entry, got {raw!r:.200}")
        self.fields(path, raw)
        dtype = self.dtype(path, raw["dtype"])
        shape = self.dims(path, raw["shape"], "shape")
        blob = self.blob(path, raw["location"])
        serializer = raw["serializer"]
        byte_range = raw.get("byte_range")
        if byte_range is None:
            if serializer == "torch_save":
                return dtype, shape, True, self.whole_file(blob)
            byte_range = [0, math.prod(shape) * _DTYPES[dtype]]  # the file is the tensor
        elif (
            not isinstance(byte_range, list)
            or len(byte_range) != 2
            or not all(type(x) is int for x in byte_range)
            or not 0 <= byte_range[0] <= byte_range[1]
        ):
            raise self.corrupt(path, f"byte_range must be [start, end], got {byte_range!r}")
        start, end = byte_range
        loc = Location(blob=blob, offset=start, nbytes=end - start)
        if serializer == "torch_save":
            return dtype, shape, True, loc
        if serializer == "buffer_protocol":
            if dtype in _QUANTIZED:
                raise self.corrupt(path, f"a {dtype} tensor has no raw layout")
            nbytes = math.prod(shape) * _DTYPES[dtype]
            if end - start != nbytes:
                raise self.corrupt(
                    path,
                    f"byte_range {byte_range} holds {end - start} bytes; a "
                    f"{dtype}{list(shape)} tensor needs {nbytes}",
                )
            return dtype, shape, False, loc
        raise self.unknown(path, f"tensor serializer {serializer!r}")

    def boxes(
        self,
        path: str,
        raw_list: list[Any],
        what: str,
        dtype: str | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> tuple[str, tuple[int, ...], list[Shard], bool]:
        """The dtype, shape and pieces (by offset) of a chunked tensor of ``dtype`` and
        ``shape``, or of a sharded one (its first shard's dtype; the far corner of its shards as
        its shape, which torchsnapshot does not record); and whether the pieces are pickled."""
        parsed: list[tuple[tuple[int, ...], tuple[int, ...], Stored]] = []
        for raw in raw_list:
            if not isinstance(raw, dict) or set(raw) != {"offsets", "sizes", "tensor"}:
                raise self.corrupt(path, f"expected a {what} {{offsets, sizes, tensor}}")
            offsets = self.dims(path, raw["offsets"], f"a {what}'s offsets")
            sizes = self.dims(path, raw["sizes"], f"a {what}'s sizes")
            parsed.append((offsets, sizes, self.tensor(path, raw["tensor"])))
        if len({len(o) for o, _, _ in parsed} | {len(n) for _, n, _ in parsed}) != 1:
            raise self.corrupt(path, f"{what}s of different dimensions")
        dtype = dtype or parsed[0][2][0]
        if shape is None:
            corner = [max(o[i] + n[i] for o, n, _ in parsed) for i in range(len(parsed[0][0]))]
            shape = self.dims(path, corner, "the global shape")
        pieces = []
        pickled_kinds = set()
        for offsets, sizes, (t_dtype, t_shape, pickled, loc) in parsed:
            if len(offsets) != len(shape):
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
        return dtype, shape, pieces, pickled_kinds == {True}

    def chunked(self, path: str, logical: str, raw: dict[str, Any], replicated: bool) -> Entry:
        dtype = self.dtype(path, raw["dtype"])
        shape = self.dims(path, raw["shape"], "shape")
        chunks = raw["chunks"]
        if not isinstance(chunks, list) or not chunks:
            raise self.corrupt(path, "chunks must be a non-empty list")
        # torchsnapshot cuts a 0-d tensor as its 1-element view: one chunk of it.
        view = shape if shape else (1,)
        _, _, pieces, pickled = self.boxes(path, chunks, "chunk", dtype, view)
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
        dtype, shape, pieces, pickled = self.boxes(path, [s for _, s in shards], "shard")
        if pickled:
            return PickledTensorEntry(dtype=dtype, shape=shape, pieces=tuple(pieces))
        return ShardedTensorEntry(key=logical, dtype=dtype, shape=shape, shards=tuple(pieces))


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
