"""Exporting a snapshot's tensors to safetensors (or ``torch.save``) files, streamed.

Every tensor is written in row-major order, whatever pieces it was stored in: a dense tensor's
chunks, or the boxes of a sharded one (statesnap's ``ShardedTensor``, a DTensor, torch's
``ShardedTensor``) consolidated into the full tensor. The output is produced in tiles of whole
leading-axis rows: for each tile, every stored box it overlaps gives the rows it has, read as
one byte range of that box (a box's rows are contiguous in its bytes) and copied into the tile,
which is then cast (``dtype``) and written at its place in the file. A tile and one box's
piece of it are all the memory the export holds, so it stays within its budget however large
the state. Each stored chunk's CRC-32 is computed as its bytes go by (tiles read every box's
rows in order) and compared when the chunk ends.

A safetensors file's header (names, dtypes, shapes, offsets) is known from the manifest
before any byte is read, so each file is written front to back. Outputs larger than
``max_shard_bytes`` are split into ``model-00001-of-0000N.safetensors`` files with a
``model.safetensors.index.json`` mapping each name to its file, as Hugging Face writes them.

Before anything is allocated or written, the manifest's claims get restore's own checks: each
entry's kind gives it as one tensor once checked (``Kind.tensor_layout``: a dense entry's
chunks hold its shape's bytes, a sharded one's shards cover its shape exactly once), no two
ranges of an entry overlap and every blob holds the ranges claimed in it
(``claims.claimed_blobs``, ``claims.check_claims``). What an export then reads and allocates
is bounded by the bytes present. Names the safetensors header cannot carry (``__metadata__``,
text that is not UTF-8) and headers past the format's limit are refused too.

The files are written into a staging folder and put in place whole, never mixed with an
earlier export (``snapshot._engine.tools.export_folder``).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from manifest import Location, Manifest
from snapshot._engine.format.checksum import crc32
from snapshot._engine.format.text import printable
from snapshot._engine.handlers import for_entry
from snapshot._engine.io.io_loop import run
from snapshot._engine.io.storage_calls import call
from snapshot._engine.restore import claims
from snapshot._engine.tools.export_folder import write_file
from snapshot.errors import (
    ChecksumError,
    InvalidArgumentError,
    UnsupportedValueError,
)
from snapshot.options import Options
from storage_plugins import StoragePlugin

logger = logging.getLogger("snapshot")

# torch dtype -> safetensors' name (the format's own list).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
for _name, _attr in (("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[getattr(torch, _attr)] = _name

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?i?B?)\s*", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5,000,000,000 (decimal units, as Hugging Face's ``max_shard_size``);
    ``"512MiB"`` -> binary units; an int is bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise InvalidArgumentError(f"max_shard_size must be positive, got {text}")
        return text
    m = _SIZE.fullmatch(str(text))
    if not m:
        raise InvalidArgumentError(f"max_shard_size: {text!r} is not a size such as 5GB or 500MiB")
    unit = m.group(2).upper()
    base = unit[:1] if unit[:1] in "KMGT" else ""
    factor = 1024 ** ("KMGT".index(base) + 1) if base and "I" in unit else _UNITS[base]
    size = int(float(m.group(1)) * factor)
    if size < 1:
        raise InvalidArgumentError(f"max_shard_size must be positive, got {text!r}")
    return size


@dataclass
class Box:
    """Stored bytes of a region of a tensor: the box ``offsets .. offsets + sizes`` in
    row-major order across ``chunks``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    chunks: tuple[Location, ...]


@dataclass
class Source:
    """One tensor to export: its output ``name``, stored dtype and global shape, its boxes
    (one covering it all for a dense tensor), and the manifest path it comes from."""

    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    boxes: list[Box]
    out_dtype: torch.dtype = field(default=torch.float32)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def out_bytes(self) -> int:
        return self.numel * self.out_dtype.itemsize


def output_name(logical: str, prefix: str) -> str:
    """``0/model/layer.weight`` under ``prefix`` ``0/model/`` -> ``layer.weight``: each path
    component unescaped (``flatten.escape_key``), joined by dots as module names are."""
    parts = logical[len(prefix) :].split("/")
    return ".".join(p.replace("%2F", "/").replace("%25", "%") for p in parts)


def collect(
    manifest: Manifest,
    *,
    key: str | None,
    strip_prefix: str | None,
    dtype: torch.dtype | None,
    where: str,
) -> tuple[list[Source], list[str]]:
    """The tensors to export from rank 0's view of ``manifest`` (under ``key``, an app_state
    key, when given), in the snapshot's order, and the paths of the other leaves skipped."""
    entries = manifest.view(0)
    prefix = "0/" if key is None else f"0/{key.strip('/')}/"
    if key is not None and not any(p.startswith(prefix) for p in entries):
        keys = sorted(
            {p.split("/")[1] for p in entries if p.startswith("0/") and p.count("/") >= 1}
        )
        raise InvalidArgumentError(
            f"snapshot {where} has no key {key!r} on rank 0; its keys: {', '.join(keys) or 'none'}"
        )
    sources: list[Source] = []
    skipped: list[str] = []
    names: dict[str, str] = {}
    for path, entry in entries.items():
        if not path.startswith(prefix):
            continue
        # The entry as one tensor, by its kind, after restore's checks of an entry read into
        # new memory (a dense one's chunks hold its shape's bytes in whole elements; a sharded
        # one's shards cover its shape exactly once).
        kind = for_entry(entry)
        layout = kind.tensor_layout(path, entry) if kind is not None else None
        if layout is None:
            if entry.locations or entry.type == "primitive":
                skipped.append(path)
            continue
        t_dtype = layout.dtype
        boxes = [Box(offsets, sizes, chunks) for offsets, sizes, chunks in layout.boxes]
        name = output_name(path, prefix)
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix) :]
        if name in names:
            raise InvalidArgumentError(
                f"two entries become the name {name!r}: {names[name]} and {path}"
            )
        names[name] = path
        out_dtype = dtype if dtype is not None and t_dtype.is_floating_point else t_dtype
        sources.append(Source(name, path, t_dtype, tuple(layout.shape), boxes, out_dtype))
    return sources, skipped


def check_claims(
    plugin: StoragePlugin, manifest: Manifest, sources: Sequence[Source], options: Options
) -> None:
    """Restore's check of the sizes a manifest claims, for every blob the export reads: no two
    ranges of one entry overlap, and the store says each blob holds the ranges claimed in it
    (``CorruptSnapshotError`` before anything is read or allocated). Unlike a restore's small
    reads, an export asks whatever it claims: one size call per blob, next to reading them all."""
    blobs, _ = claims.claimed_blobs(manifest.view(0), [s.path for s in sources], {})
    jobs = options.max_concurrent_io
    assert jobs is not None
    run(claims.check_claims(plugin, blobs, manifest.blob_sizes, jobs, options))


def plan_files(sources: Sequence[Source], max_bytes: int) -> list[list[Source]]:
    """Tensors grouped into files of at most ``max_bytes`` each, in order (a tensor larger than
    that gets a file of its own)."""
    files: list[list[Source]] = []
    size = 0
    for s in sources:
        if not files or (size + s.out_bytes > max_bytes and files[-1]):
            files.append([])
            size = 0
        files[-1].append(s)
        size += s.out_bytes
    return files or [[]]


class BoxReader:
    """Reads a box's bytes front to back in ranges (``read(start, out)``, ``start`` never going
    back), checking each chunk's CRC-32 once all of its bytes went by."""

    def __init__(
        self, plugin: StoragePlugin, box: Box, label: str, verify: bool, options: Options
    ) -> None:
        self.plugin = plugin
        self.box = box
        self.label = label
        self.verify = verify
        self.options = options
        self.pos = 0  # bytes of the box read so far (ranges must start here or later)
        self.chunk = 0  # the chunk holding ``pos``
        self.chunk_start = 0  # where that chunk begins in the box's bytes
        self.crc = 0
        self.crc_upto = 0  # bytes of the current chunk digested

    def read(self, start: int, out: memoryview) -> None:
        if start < self.pos:
            raise AssertionError(f"{self.label}: box read backwards")
        end = start + len(out)
        filled = 0
        at = start
        chunks = self.box.chunks
        while at < end:
            while self.chunk_start + chunks[self.chunk].nbytes <= at:
                self._finish_chunk()
            loc = chunks[self.chunk]
            inner = at - self.chunk_start
            n = min(end - at, loc.nbytes - inner)
            piece = out[filled : filled + n]
            # Through restore's ``call``: its retries, deadline and errors (a blob missing or
            # cut short is corrupt, a link unsafe).
            read = functools.partial(self.plugin.read_into, loc.blob, loc.offset + inner, piece)
            run(call(self.plugin, "read", loc.blob, self.label, read, options=self.options))
            if self.verify and loc.crc32 is not None:
                if inner == self.crc_upto:
                    self.crc = crc32(piece, self.crc)
                    self.crc_upto += n
                else:  # a gap (a skipped part): this chunk can no longer be checked whole
                    self.crc_upto = -1
            filled += n
            at += n
        self.pos = end
        while self.chunk < len(chunks) and self.chunk_start + chunks[self.chunk].nbytes <= self.pos:
            self._finish_chunk()

    def _finish_chunk(self) -> None:
        loc = self.box.chunks[self.chunk]
        whole = self.verify and loc.crc32 is not None and self.crc_upto == loc.nbytes
        if whole and self.crc != loc.crc32:
            raise ChecksumError(
                f"{self.label}: blob {self.plugin.describe(loc.blob)} bytes "
                f"{loc.offset:,}..{loc.offset + loc.nbytes:,} have CRC-32 {self.crc:#010x}, "
                f"the snapshot recorded {loc.crc32:#010x}"
            )
        self.chunk_start += loc.nbytes
        self.chunk += 1
        self.crc = 0
        self.crc_upto = 0


def tiles(source: Source, tile_bytes: int) -> Iterator[tuple[int, int]]:
    """Row ranges ``[a, b)`` of the leading axis, each at most ``tile_bytes`` of the stored
    dtype or of the output's (whichever is larger), at least one row; made one at a time."""
    if not source.shape:
        yield (0, 1)
        return
    rows = source.shape[0]
    per_row = max(1, math.prod(source.shape[1:])) * max(
        source.dtype.itemsize, source.out_dtype.itemsize
    )
    step = max(1, tile_bytes // per_row)
    for a in range(0, rows, step):
        yield (a, min(rows, a + step))


def stream_tensor(
    plugin: StoragePlugin,
    source: Source,
    tile_bytes: int,
    verify: bool,
    write: Callable[[memoryview], object],
    options: Options,
) -> None:
    """Writes ``source``'s bytes (cast to its output dtype) through ``write``, tile by tile.
    ``options``: each read's retries and deadline."""
    if source.numel == 0:
        return
    readers = [BoxReader(plugin, b, source.path, verify, options) for b in source.boxes]
    shape = source.shape
    itemsize = source.dtype.itemsize
    for a, b in tiles(source, tile_bytes):
        tile_shape = (b - a, *shape[1:]) if shape else ()
        tile = torch.empty(tile_shape, dtype=source.dtype)
        covered = 0
        for box, reader in zip(source.boxes, readers, strict=True):
            if not shape:
                rows = (0, 1)
            else:
                lo, hi = box.offsets[0], box.offsets[0] + box.sizes[0]
                rows = (max(a, lo), min(b, hi))
                if rows[0] >= rows[1]:
                    continue
            row_elems = math.prod(box.sizes[1:]) if shape else 1
            start_row = rows[0] - (box.offsets[0] if shape else 0)
            n_rows = rows[1] - rows[0]
            if not shape or tuple(box.sizes[1:]) == tuple(shape[1:]):
                # The box spans whole rows (a dense tensor, a shard along the leading axis):
                # its rows are contiguous in the tile too, read straight into it.
                target = tile if not shape else tile[rows[0] - a : rows[1] - a]
                if target.numel():
                    reader.read(start_row * row_elems * itemsize, _bytes_of(target))
                covered += target.numel()
                continue
            piece = torch.empty((n_rows, *box.sizes[1:]), dtype=source.dtype)
            if piece.numel():
                reader.read(start_row * row_elems * itemsize, _bytes_of(piece))
            covered += piece.numel()
            inner = tuple(
                slice(o, o + n) for o, n in zip(box.offsets[1:], box.sizes[1:], strict=True)
            )
            region = tile[(slice(rows[0] - a, rows[1] - a), *inner)]
            region.copy_(piece)
            del piece
        if covered != tile.numel():  # the shards were checked to cover it exactly once
            raise AssertionError(
                f"{source.path}: the stored pieces cover {covered:,} of the {tile.numel():,} "
                f"elements of rows {a}..{b}"
            )
        out = tile if source.out_dtype == source.dtype else tile.to(source.out_dtype)
        write(_bytes_of(out))
        del tile, out


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype)."""
    from snapshot._engine.format.serialization import tensor_memoryview

    return tensor_memoryview(t)


# The key of a safetensors header that holds the file's metadata: no tensor may have that name.
RESERVED_NAME = "__metadata__"
# The largest header the safetensors library reads (its ``MAX_HEADER_SIZE``).
MAX_HEADER_BYTES = 100_000_000


def check_name(source: Source) -> None:
    """Refuses a name a safetensors header cannot carry: the metadata's key, or text that is
    not UTF-8 (a lone surrogate, which the format's JSON parser rejects)."""
    if source.name == RESERVED_NAME:
        raise UnsupportedValueError(
            f"{printable(source.path)}: a tensor named {RESERVED_NAME!r} cannot be written to "
            "safetensors, whose header keeps that key for the file's metadata (export it with "
            "--format torch, or rename it)"
        )
    try:
        source.name.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedValueError(
            f"{printable(source.path)}: the name '{printable(source.name)}' is not valid UTF-8 "
            "text, which a safetensors header needs (export it with --format torch)"
        ) from None


def check_safetensors(files: Sequence[Sequence[Source]]) -> None:
    """Every planned file's header, built and checked before anything is written: names the
    format reserves or cannot carry, and headers larger than its readers accept."""
    for group in files:
        size = len(safetensors_header(group, {"format": "pt"})) - 8
        if size > MAX_HEADER_BYTES:
            raise UnsupportedValueError(
                f"the safetensors header of the {len(group):,} tensors of one file would be "
                f"{size:,} bytes, over the {MAX_HEADER_BYTES:,} the format's readers accept; "
                "pass a smaller max_shard_size (--max-shard-size) to split them"
            )


def safetensors_header(sources: Sequence[Source], metadata: dict[str, str]) -> bytes:
    """The header of a safetensors file holding ``sources`` in order: its 8-byte length and
    the JSON, padded with spaces to a multiple of 8 bytes (as the format's writer pads)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for s in sources:
        check_name(s)
        try:
            name = SAFETENSORS_DTYPES[s.out_dtype]
        except KeyError:
            raise UnsupportedValueError(
                f"{s.path}: dtype {s.out_dtype} has no safetensors name (export it with "
                "--dtype, or as --format torch)"
            ) from None
        header[s.name] = {
            "dtype": name,
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.out_bytes],
        }
        offset += s.out_bytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text


@dataclass
class Written:
    """What an export wrote."""

    files: list[str]
    tensors: int
    nbytes: int
    skipped: list[str]
    seconds: float


def write_safetensors(
    plugin: StoragePlugin,
    files: list[list[Source]],
    folder: str,
    tile_bytes: int,
    verify: bool,
    options: Options,
) -> list[str]:
    """Writes the planned files (and, for several, the index) into ``folder``; returns their
    names, the index last."""
    n = len(files)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    for name, group in zip(names, files, strict=True):

        def fill(f: BinaryIO, group: list[Source] = group) -> None:
            f.write(safetensors_header(group, {"format": "pt"}))
            for s in group:
                stream_tensor(plugin, s, tile_bytes, verify, f.write, options)

        write_file(os.path.join(folder, name), fill)
    if n > 1:
        return [*names, write_index(folder, "model.safetensors.index.json", names, files)]
    return names


def write_torch(
    plugin: StoragePlugin,
    files: list[list[Source]],
    folder: str,
    tile_bytes: int,
    verify: bool,
    options: Options,
) -> list[str]:
    """``torch.save`` files of the planned groups (``pytorch_model.bin``, or
    ``pytorch_model-0000i-of-0000N.bin`` with ``pytorch_model.bin.index.json``) in ``folder``;
    returns their names. Unlike safetensors, a torch file is made whole in memory: one file's
    tensors at a time."""
    n = len(files)
    names = (
        ["pytorch_model.bin"]
        if n == 1
        else [f"pytorch_model-{i + 1:05d}-of-{n:05d}.bin" for i in range(n)]
    )
    for name, group in zip(names, files, strict=True):
        tensors = {}
        for s in group:
            t = torch.empty(s.shape, dtype=s.out_dtype)
            view = _bytes_of(t)
            pos = 0

            def put(data: memoryview, view: memoryview = view) -> None:
                nonlocal pos
                view[pos : pos + len(data)] = data
                pos += len(data)

            stream_tensor(plugin, s, tile_bytes, verify, put, options)
            tensors[s.name] = t
        write_file(os.path.join(folder, name), functools.partial(_save_into, tensors))
        del tensors
    if n > 1:
        return [*names, write_index(folder, "pytorch_model.bin.index.json", names, files)]
    return names


def _save_into(tensors: dict[str, torch.Tensor], f: BinaryIO) -> None:
    torch.save(tensors, f)


def write_index(
    folder: str, index_name: str, names: Sequence[str], files: Sequence[Sequence[Source]]
) -> str:
    """The index of a split export, as Hugging Face writes it: the total size, and which file
    holds each tensor. Returns its name."""
    index = {
        "metadata": {"total_size": sum(s.out_bytes for g in files for s in g)},
        "weight_map": {s.name: name for name, g in zip(names, files, strict=True) for s in g},
    }
    data = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
    write_file(os.path.join(folder, index_name), lambda f: f.write(data))
    return index_name


def log_done(where: str, out_dir: str, result: Written) -> None:
    logger.info(
        "exported %d tensors (%.1f MB) of %s to %d file(s) in %s in %.3f s%s",
        result.tensors,
        result.nbytes / 1e6,
        where,
        len(result.files),
        out_dir,
        result.seconds,
        f"; {len(result.skipped)} other values skipped" if result.skipped else "",
    )


def now() -> float:
    return time.perf_counter()
