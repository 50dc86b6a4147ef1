"""torch.distributed.checkpoint (DCP) directories, opened read-only.

A DCP directory written by ``dcp.save`` with its default ``FileSystemWriter`` holds
``.metadata`` (a pickle of ``torch.distributed.checkpoint.metadata.Metadata``) and the
``__<rank>_<n>.distcp`` files it points into. ``translate_dcp`` turns it into this library's
``Manifest`` (world size 1, every entry under ``0/``), so the one loader reads it:

- the pickle is decoded by a restricted unpickler that knows only the classes that file holds
  (``_ALLOWED``) and refuses any other global, naming it; its size is bounded as a manifest's
  (``Options.max_manifest_bytes``), and every field is checked for type and range;
- each tensor is a ``ShardedTensorEntry`` of its chunks, so a restore at any world size reads
  it resharded, in place into DTensor targets. DCP writes each chunk with ``torch.save`` (a
  stored, uncompressed zip) at a byte range of a ``.distcp`` file: the first bytes of each
  range are read when the directory is opened, the archive's one storage record found, and
  its pickle checked to hold a contiguous tensor of the chunk's dtype and size starting at
  element 0; the chunk's location is then that record's raw bytes;
- each bytes item (``BytesStorageMetadata``: DCP's ``torch.save`` of a non-tensor value) is an
  ``ObjectEntry`` read by the restricted object loader.

Keys: DCP flattens the state dict it saves (``flatten_state_dict``) and records in
``planner_data`` each flat key's path of keys (``("app", "model", "0.weight")``; an int is a
list index). Each path becomes the logical path ``0/app/model/0.weight``, with a dict (a list
for int keys) at each level above, so ``restore({"app": app})`` asks for the same values that
``dcp.load({"app": app})`` matches. A key without a recorded path is a top-level key of its own
(its flat name).
"""

from __future__ import annotations

import io
import math
import pathlib
import pickle
import warnings
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from manifest import (
    DictEntry,
    Entry,
    ListEntry,
    Location,
    Manifest,
    ObjectEntry,
    PickledTensorEntry,
    Shard,
    ShardedTensorEntry,
    check_blob_path,
    reference_of,
)
from manifest import UnsafeManifestError as _UnsafePath
from snapshot._engine.format.serialization import DTYPES, ArchiveEnds, dtype_name
from snapshot._engine.format.text import printable_message
from snapshot._engine.format.torchsnapshot_format import DCP_METADATA_NAME
from snapshot._engine.state_dicts import escape_key
from snapshot.errors import CorruptSnapshotError, IncompatibleSnapshotError, UnsafeSnapshotError

# Bytes read at the start of each chunk's range to find its storage record: torch.save's
# archive puts data.pkl (a few hundred bytes for a tensor) and three small records first.
HEAD_BYTES = 4096
# The most bytes one coalesced read of chunk heads spans (``_read_coalesced``).
SPAN_BYTES = 16 << 20
_MAX_DIMS = 64
_MAX_NUMEL = 1 << 62
_MAX_PATH = 100  # levels of a key's path

_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED_NAMES = {
    (_MD, "Metadata"),
    (_MD, "MetadataIndex"),
    (_MD, "TensorStorageMetadata"),
    (_MD, "ChunkStorageMetadata"),
    (_MD, "BytesStorageMetadata"),
    (_MD, "TensorProperties"),
    (_MD, "StorageMeta"),
    (_MD, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """The classes of a DCP ``.metadata`` file, torch's dtypes and layouts; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_NAMES:
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise UnsafeSnapshotError(
            printable_message(
                f"global {module}.{name}: a DCP .metadata file holds only torch's checkpoint "
                "metadata classes, dtypes and sizes; nothing was run"
            )
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeSnapshotError("a persistent id: a DCP .metadata file holds none")


class _ChunkPickle(pickle.Unpickler):
    """A chunk's data.pkl: ``_rebuild_tensor_v2`` of one storage, read as the tuple of its
    arguments (nothing is built)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_args
        if (module, name) == ("collections", "OrderedDict"):
            return _empty_hooks
        if module == "torch" and name.endswith("Storage"):
            return name
        raise UnsafeSnapshotError(printable_message(f"global {module}.{name} in a chunk's pickle"))

    def persistent_load(self, pid: Any) -> Any:
        return ("persistent", pid)


def _rebuild_args(*args: Any) -> tuple[Any, ...]:
    return ("tensor", *args)


def _empty_hooks(*args: Any) -> None:
    if args:
        raise UnsafeSnapshotError("backward hooks in a chunk's pickle")


def translate_dcp(
    data: bytes,
    where: str,
    sizes_of: Callable[[list[str]], dict[str, int]],
    read_ranges: Callable[[list[tuple[str, int, int]]], list[bytes]],
) -> Manifest:
    """The ``Manifest`` of the DCP checkpoint whose ``.metadata`` holds ``data``;
    ``sizes_of`` gives files' lengths, ``read_ranges([(blob, offset, nbytes), ...])`` those
    bytes of the directory's files.

    Raises:
        UnsafeSnapshotError: the pickle names a global outside ``_ALLOWED_NAMES``, or a file
            outside the directory.
        CorruptSnapshotError: a field is missing, of the wrong type or out of range; a chunk's
            bytes are not the archive its metadata says.
        IncompatibleSnapshotError: chunks written through a storage extension (compressed).
    """
    source = f"{where}/{DCP_METADATA_NAME}"

    def corrupt(what: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(printable_message(f"{source}: {what}"))

    try:
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeSnapshotError as e:
        raise UnsafeSnapshotError(f"{source}: {e}") from None
    except Exception as e:  # anything a damaged pickle raises while decoding
        raise corrupt(f"not a readable pickle: {type(e).__name__}: {e}"[:500]) from None
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    if type(meta) is not Metadata:
        raise corrupt(f"expected a Metadata, got {type(meta).__name__}")
    items = getattr(meta, "state_dict_metadata", None)
    storage = getattr(meta, "storage_data", None)
    paths = getattr(meta, "planner_data", None)
    if type(items) is not dict or type(storage) is not dict:
        raise corrupt("state_dict_metadata and storage_data must be dicts")
    if paths is not None and type(paths) is not dict:
        paths = None
    # Where each (key, chunk offsets) lies.
    infos: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            raise corrupt("storage_data must map MetadataIndex to _StorageInfo")
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        if type(fqn) is not str or (offset is not None and not _dims(offset)):
            raise corrupt(f"a storage key of fqn {fqn!r:.80} and offset {offset!r:.80}")
        if getattr(info, "transform_descriptors", None):
            raise IncompatibleSnapshotError(
                printable_message(
                    f"{source}: {fqn} was written through DCP storage extensions "
                    f"{info.transform_descriptors!r:.200} (compression): statesnap reads chunks "
                    "stored plainly; load this checkpoint with torch.distributed.checkpoint.load"
                )
            )
        rel, start, length = (getattr(info, n, None) for n in ("relative_path", "offset", "length"))
        if type(rel) is not str or type(start) is not int or type(length) is not int:
            raise corrupt(f"{fqn}: a storage record needs relative_path, offset and length")
        if start < 0 or length < 0 or start + length > _MAX_NUMEL:
            raise corrupt(f"{fqn}: byte range [{start}, {start + length}) out of range")
        infos[(fqn, None if offset is None else tuple(offset))] = (
            _blob(source, rel),
            start,
            length,
        )

    files = sizes_of(sorted({blob for blob, _, _ in infos.values()}))
    for (fqn, _), (blob, start, length) in infos.items():
        if start + length > files[blob]:
            raise corrupt(
                f"{fqn}: bytes [{start}, {start + length}) of {blob}, which holds {files[blob]}"
            )
    tree = _Tree(source, budget=64 * len(data) + (1 << 20))
    tensors: list[tuple[str, str, torch.dtype, tuple[int, ...], list[tuple[Any, ...]]]] = []
    for fqn, item in items.items():
        if type(fqn) is not str:
            raise corrupt(f"a key that is not a string: {type(fqn).__name__}")
        logical = tree.add(fqn, paths.get(fqn) if paths is not None else None)
        if type(item) is BytesStorageMetadata:
            loc = infos.pop((fqn, None), None) or infos.pop((fqn, ()), None)
            if loc is None:
                raise corrupt(f"{fqn}: no storage record for this bytes item")
            tree.entries[logical] = ObjectEntry(
                serializer="torch_save", obj_type="object", location=Location(*loc)
            )
        elif type(item) is TensorStorageMetadata:
            dtype = getattr(getattr(item, "properties", None), "dtype", None)
            shape: Any = getattr(item, "size", None)
            chunks: Any = getattr(item, "chunks", None)
            if not isinstance(dtype, torch.dtype) or dtype not in _DTYPE_SET:
                raise IncompatibleSnapshotError(f"{source}: {fqn}: dtype {dtype!r:.80}")
            if not _dims(shape) or type(chunks) is not list or not chunks:
                raise corrupt(f"{fqn}: a tensor needs a size and a non-empty list of chunks")
            pieces = []
            for chunk in chunks:
                offsets: Any = getattr(chunk, "offsets", None)
                sizes: Any = getattr(chunk, "sizes", None)
                if (
                    not _dims(offsets)
                    or not _dims(sizes)
                    or not len(offsets) == len(sizes) == len(shape)
                ):
                    raise corrupt(f"{fqn}: a chunk's offsets and sizes must fit its tensor")
                if any(o + n > s for o, n, s in zip(offsets, sizes, shape, strict=True)):
                    raise corrupt(f"{fqn}: a chunk at {list(offsets)} exceeds {list(shape)}")
                loc = infos.pop((fqn, tuple(offsets)), None)
                if loc is None:  # (each record serves one chunk: the work stays within the bytes)
                    raise corrupt(
                        f"{fqn}: no storage record, or one used twice, for the chunk at "
                        f"{list(offsets)}"
                    )
                pieces.append((tuple(offsets), tuple(sizes), *loc))
            tensors.append((logical, fqn, dtype, tuple(shape), pieces))
        else:
            raise corrupt(f"{fqn}: unknown item type {type(item).__name__}")
    # The head of every chunk's range, read at once; each chunk's storage record found in it.
    # The first and last bytes of every chunk's range (the archive's first records, and its
    # directory), read at once.
    ranges = []
    for *_, ps in tensors:
        for *_, blob, start, length in ps:
            n = min(length, HEAD_BYTES)
            ranges += [(blob, start, n), (blob, start + length - n, n)]
    heads = iter(_read_coalesced(ranges, read_ranges))
    for logical, fqn, dtype, shape, ps in tensors:
        raw, pickled = [], []
        for offsets, sizes, blob, start, length in ps:
            nbytes = math.prod(sizes) * dtype.itemsize
            head, tail = next(heads), next(heads)
            at = _record(head, tail, length, nbytes, dtype, sizes, f"{source}: {fqn}")
            if at is not None:
                raw.append(
                    Shard(
                        offsets=offsets, sizes=sizes, chunks=(Location(blob, start + at, nbytes),)
                    )
                )
            pickled.append(
                Shard(offsets=offsets, sizes=sizes, chunks=(Location(blob, start, length),))
            )
        name = dtype_name(dtype)
        if len(raw) == len(ps):
            raw.sort(key=lambda s: s.offsets)
            key = logical.partition("/")[2]
            tree.entries[logical] = ShardedTensorEntry(
                key=key, dtype=name, shape=shape, shards=tuple(raw)
            )
        else:  # a chunk DCP saved as a view: each archive decoded whole, by the safe loader
            pickled.sort(key=lambda s: s.offsets)
            tree.entries[logical] = PickledTensorEntry(
                dtype=name, shape=shape, pieces=tuple(pickled)
            )
    manifest = Manifest(
        format_version=2,
        world_size=1,
        entries=tree.finish(),
        metadata={"library": f"torch.distributed.checkpoint {meta.version!s:.40}", "format": "dcp"},
    )
    return manifest.with_blob_sizes(files)


_DTYPE_SET = frozenset(DTYPES.values())


def _read_coalesced(
    ranges: list[tuple[str, int, int]],
    read_ranges: Callable[[list[tuple[str, int, int]]], list[bytes]],
) -> list[bytes]:
    """The bytes of each range, read as fewer spans: ranges of one file less than
    ``HEAD_BYTES`` apart (small chunks written one after another) are read together, so the
    bytes read stay within a few times those asked for, at most ``SPAN_BYTES`` at once."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][:2])
    spans: list[list[Any]] = []  # [blob, start, end, [range indexes]]
    for i in order:
        blob, start, n = ranges[i]
        last = spans[-1] if spans else None
        if (
            last is not None
            and last[0] == blob
            and start <= last[2] + HEAD_BYTES
            and start + n - last[1] <= SPAN_BYTES
        ):
            last[2] = max(last[2], start + n)
            last[3].append(i)
        else:
            spans.append([blob, start, start + n, [i]])
    got = read_ranges([(blob, start, end - start) for blob, start, end, _ in spans])
    out: list[bytes] = [b""] * len(ranges)
    for (_, start, _, members), data in zip(spans, got, strict=True):
        view = memoryview(data)
        for i in members:
            at = ranges[i][1] - start
            out[i] = bytes(view[at : at + ranges[i][2]])
    return out


def _dims(value: Any) -> bool:
    return (
        isinstance(value, tuple | list)  # torch.Size is a tuple
        and len(value) <= _MAX_DIMS
        and all(type(x) is int and 0 <= x <= _MAX_NUMEL for x in value)
        and math.prod(value) <= _MAX_NUMEL
    )


def _blob(source: str, rel: str) -> str:
    """A chunk file's name: a plain path inside the directory, else refused."""
    try:
        blob = check_blob_path(rel, "relative_path")
    except _UnsafePath as e:
        raise UnsafeSnapshotError(printable_message(f"{source}: {e}")) from None
    if reference_of(blob) is not None:
        raise UnsafeSnapshotError(printable_message(f"{source}: {rel!r} leaves the directory"))
    return blob


def _record(
    head: bytes,
    tail: bytes,
    length: int,
    nbytes: int,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
    what: str,
) -> int | None:
    """Where, in a chunk's range of ``length`` bytes (``head`` its first, ``tail`` its last),
    its tensor's ``nbytes`` raw bytes start: the archive's one storage record, stored
    uncompressed, once its pickle is checked to describe that tensor. None when the pickle
    describes a tensor of the chunk's dtype and size that is not those bytes in order (a view
    DCP saved with its larger storage, or strided)."""

    def bad(why: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(printable_message(f"{what}: chunk at {list(sizes)}: {why}"))

    try:
        with zipfile.ZipFile(ArchiveEnds(length, head, tail)) as archive:
            infos = archive.infolist()
            if len(infos) > 64:
                raise bad(f"an archive of {len(infos)} records")
            pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
            data = [i for i in infos if "/data/" in i.filename]
            if len(pkl) != 1 or len(data) != 1:
                raise bad("not a torch.save archive of one tensor")
            if pkl[0].file_size > HEAD_BYTES:
                raise bad(f"a pickle of {pkl[0].file_size} bytes")
            pickled = archive.read(pkl[0])
            record = data[0]
    except CorruptSnapshotError:
        raise
    except Exception as e:  # zipfile's errors, and a read outside the bytes read
        raise bad(f"not a readable torch.save archive: {type(e).__name__}: {e}"[:300]) from None
    if record.compress_type != zipfile.ZIP_STORED:
        raise bad("its storage record is compressed; DCP stores them plainly")
    try:
        got = _ChunkPickle(io.BytesIO(pickled)).load()
    except UnsafeSnapshotError:
        raise
    except Exception as e:
        raise bad(f"its pickle is not readable: {type(e).__name__}") from None
    if (
        type(got) is not tuple
        or len(got) < 5
        or got[0] != "tensor"
        or not (type(got[1]) is tuple and got[1][0] == "persistent")
        or type(got[3]) is not tuple
        or tuple(got[3]) != sizes
    ):
        raise bad("its pickle is not one tensor of the chunk's size")
    pid = got[1][1]
    storage = pid[1] if type(pid) is tuple and len(pid) == 5 else None
    try:
        with warnings.catch_warnings():  # (typed storages are deprecated)
            warnings.simplefilter("ignore")
            stored = getattr(torch, storage).dtype if type(storage) is str else None
    except Exception:
        stored = None
    if stored is not None and stored != dtype:
        raise bad(f"its storage is {storage}, the chunk's dtype {dtype}")
    contiguous = tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes)))
    if (
        record.file_size != nbytes
        or got[2] != 0
        or (math.prod(sizes) > 1 and tuple(got[4]) != contiguous)
    ):
        return None  # a view of a larger storage, or strided: read through torch.load
    at = record.header_offset
    local = head[at : at + 30]
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise bad("its storage record's header is not in the first bytes read")
    body = at + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
    if body + nbytes > length:
        raise bad(f"its storage record ends past the chunk's {length} bytes")
    return body


class _Tree:
    """Logical paths under ``0/`` and the containers above them, built from key paths."""

    def __init__(self, source: str, budget: int) -> None:
        self.source = source
        self.budget = budget  # characters of logical paths left to build
        self.entries: dict[str, Entry] = {}
        self.children: dict[str, list[Any]] = {"0": []}
        self.lists: set[str] = set()
        self.leaves: set[str] = set()

    def add(self, fqn: str, path: Any) -> str:
        if path is None:
            path = (fqn,)
        if type(path) not in (tuple, list) or not 0 < len(path) <= _MAX_PATH:
            raise CorruptSnapshotError(
                printable_message(f"{self.source}: {fqn}: path {path!r:.200}")
            )
        parent = "0"
        self.budget -= sum(len(k) for k in path if type(k) is str)
        if self.budget < 0:  # keys shared by reference in the pickle, used over and over
            raise CorruptSnapshotError(
                f"{self.source}: its keys' paths are far longer than the file: refused"
            )
        for i, key in enumerate(path):
            if type(key) not in (str, int):
                raise CorruptSnapshotError(
                    printable_message(f"{self.source}: {fqn}: key {key!r:.80}")
                )
            if parent in self.leaves:
                raise CorruptSnapshotError(
                    printable_message(f"{self.source}: {fqn} lies inside another value")
                )
            is_list = type(key) is int
            if parent != "0" and (parent in self.lists) != is_list and self.children[parent]:
                raise CorruptSnapshotError(printable_message(f"{self.source}: {fqn}: mixed keys"))
            if is_list and parent != "0":
                self.lists.add(parent)
            child = f"{parent}/{escape_key(key)}"
            last = i == len(path) - 1
            if child in self.leaves or (last and child in self.children):
                raise CorruptSnapshotError(printable_message(f"{self.source}: {fqn} named twice"))
            if child not in self.children:
                self.children[parent].append(key)
                if last:
                    self.leaves.add(child)
                else:
                    self.children[child] = []
            parent = child
        return parent

    def finish(self) -> dict[str, Entry]:
        out: dict[str, Entry] = {}
        for path, keys in self.children.items():
            if path == "0":
                continue
            if path in self.lists:
                if sorted(keys) != list(range(len(keys))):
                    raise CorruptSnapshotError(
                        printable_message(f"{self.source}: list {path[2:]} has items {keys[:20]}")
                    )
                out[path] = ListEntry(length=len(keys))
            else:
                out[path] = DictEntry(keys=tuple(keys))
        for key in self.children["0"]:
            if type(key) is not str:
                raise CorruptSnapshotError(f"{self.source}: a top-level key must be a string")
        out.update(self.entries)
        return out
