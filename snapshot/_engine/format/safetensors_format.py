"""Hugging Face safetensors folders, opened read-only.

A folder holding ``model.safetensors``, or ``model.safetensors.index.json`` and the shards its
``weight_map`` names (``model-00001-of-00003.safetensors``...). Each file is an 8-byte
little-endian header length, a JSON header (``{name: {"dtype", "shape", "data_offsets"}}``,
``__metadata__``), and the tensors' raw bytes. ``translate_safetensors`` makes a ``Manifest``
(world size 1) of one dict, ``0/model``, whose keys are the tensor names in file order, each a
``TensorEntry`` of its range: ``restore({"model": model})`` loads them into a model built from
the same config, and ``read_object("0/model/<name>")`` reads one.

Every byte is untrusted: a header longer than ``MAX_HEADER`` or than its file, ranges outside
the file's data or overlapping, sizes that do not match dtype and shape, unknown dtypes, an
index naming a file outside the folder or a tensor two files hold are refused, each at a cost
bounded by the bytes read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from manifest import DictEntry, Entry, Location, Manifest, TensorEntry
from snapshot._engine.format.serialization import DTYPES
from snapshot._engine.format.text import printable_message
from snapshot._engine.state_dicts import escape_key
from snapshot.errors import CorruptSnapshotError, IncompatibleSnapshotError, UnsafeSnapshotError

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
KEY = "model"
"""The app_state key the folder's tensors appear under."""

MAX_HEADER = 100_000_000  # the safetensors format's own limit on a header's length
_MAX_DIMS = 64
_MAX_NUMEL = 1 << 62
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}

# (blob, offset, nbytes) -> those bytes, read at once for a list.
Reader = Callable[[list[tuple[str, int, int]]], list[bytes]]


def _error(kind: type[Exception], text: str) -> Exception:
    return kind(printable_message(text))


def translate_safetensors(
    index: bytes | None, where: str, sizes_of: Callable[[list[str]], dict[str, int]], read: Reader
) -> Manifest:
    """The ``Manifest`` of the safetensors folder ``where``: sharded when ``index`` (the bytes
    of ``model.safetensors.index.json``) is given, else the one file ``model.safetensors``.
    ``sizes_of`` gives files' lengths, ``read`` byte ranges of them.

    Raises:
        UnsafeSnapshotError: the index names a file outside the folder.
        CorruptSnapshotError: a header or the index is not what the format says.
        IncompatibleSnapshotError: a dtype this library does not read.
    """
    files = [SINGLE_NAME]
    weight_map: dict[str, str] | None = None
    if index is not None:
        weight_map = _weight_map(index, f"{where}/{INDEX_NAME}")
        files = list(dict.fromkeys(weight_map.values()))
    sizes = sizes_of(files)
    heads = read([(f, 0, 8) if sizes[f] >= 8 else (f, 0, 0) for f in files])
    lengths = []
    for f, head in zip(files, heads, strict=True):
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > MAX_HEADER or 8 + n > sizes[f]:
            raise _error(
                CorruptSnapshotError,
                f"{where}/{f}: header of {n} bytes in a file of {sizes[f]} (at most "
                f"{MAX_HEADER:,}, within the file)",
            )
        lengths.append(n)
    headers = read([(f, 8, n) for f, n in zip(files, lengths, strict=True)])
    tensors: dict[str, Entry] = {}
    for f, n, header in zip(files, lengths, headers, strict=True):
        for name, entry in _entries(header, f, 8 + n, sizes[f], f"{where}/{f}"):
            if name in tensors:
                raise _error(CorruptSnapshotError, f"{where}: tensor {name!r:.200} is in two files")
            if weight_map is not None and weight_map.get(name) != f:
                raise _error(
                    CorruptSnapshotError,
                    f"{where}/{f} holds {name!r:.200}, which the index places in "
                    f"{weight_map.get(name)!r:.200}",
                )
            tensors[name] = entry
    if weight_map is not None and len(weight_map) != len(tensors):
        missing = sorted(set(weight_map) - set(tensors))[:5]
        raise _error(
            CorruptSnapshotError, f"{where}: the index names tensors no file holds: {missing}"
        )
    root = f"0/{KEY}"
    entries: dict[str, Entry] = {root: DictEntry(keys=tuple(tensors))}
    entries.update((f"{root}/{escape_key(k)}", e) for k, e in tensors.items())
    manifest = Manifest(
        format_version=1,
        world_size=1,
        entries=entries,
        metadata={"library": "safetensors", "format": "safetensors"},
    )
    return manifest.with_blob_sizes(sizes)


def _weight_map(data: bytes, source: str) -> dict[str, str]:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise _error(CorruptSnapshotError, f"{source} is not JSON: {e}") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise _error(CorruptSnapshotError, f"{source}: no weight_map of tensor names to files")
    for name, f in wm.items():
        if (
            type(f) is not str
            or not f.endswith(".safetensors")
            or "/" in f
            or "\\" in f
            or f.startswith(".")
            or "\0" in f
        ):
            raise _error(
                UnsafeSnapshotError,
                f"{source}: {name!r:.200} is placed in {f!r:.200}: the index names only "
                "'.safetensors' files inside the folder",
            )
    return wm


def _entries(
    header: bytes, blob: str, start: int, size: int, source: str
) -> list[tuple[str, TensorEntry]]:
    """The tensors of one file, by their data offsets; ``start``: where its data begins."""
    try:
        doc = json.loads(header)
    except (ValueError, RecursionError) as e:
        raise _error(CorruptSnapshotError, f"{source}: its header is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise _error(CorruptSnapshotError, f"{source}: its header is not a JSON object")
    data_size = size - start
    found = []
    for name, info in doc.items():
        if name == "__metadata__":
            continue
        where = f"{source}: {name!r:.200}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _error(CorruptSnapshotError, f"{where}: expected dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _DTYPES or _DTYPES[dtype] not in DTYPES:
            raise _error(IncompatibleSnapshotError, f"{where}: unknown dtype {dtype!r:.40}")
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_DIMS
            or not all(type(x) is int and 0 <= x <= _MAX_NUMEL for x in shape)
            or math.prod(shape) > _MAX_NUMEL
        ):
            raise _error(CorruptSnapshotError, f"{where}: shape {shape!r:.200}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(x) is int for x in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size
        ):
            raise _error(
                CorruptSnapshotError,
                f"{where}: data_offsets {offsets!r:.80} outside the file's {data_size} data bytes",
            )
        name_of = _DTYPES[dtype]
        nbytes = math.prod(shape) * DTYPES[name_of].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise _error(
                CorruptSnapshotError,
                f"{where}: {offsets[1] - offsets[0]} bytes; a {dtype}{shape} tensor needs {nbytes}",
            )
        loc = Location(blob, start + offsets[0], nbytes)
        found.append((offsets[0], offsets[1], name, TensorEntry(name_of, tuple(shape), (loc,))))
    found.sort(key=lambda t: (t[0], t[1]))
    end = 0
    for begin, stop, name, _ in found:
        if begin < end:
            raise _error(CorruptSnapshotError, f"{source}: {name!r:.200} overlaps another tensor")
        end = max(end, stop)
    return [(name, entry) for _, _, name, entry in found]
