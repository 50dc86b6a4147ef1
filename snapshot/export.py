"""Exporting a snapshot's tensors to files other tools load: safetensors (with a Hugging Face
index when split) or ``torch.save``. ``statesnap export`` is the same from the command line.

    from snapshot.export import export
    export("ckpt/step_1000", "hf_model", key="model", dtype="bf16", max_shard_size="5GB")

Streamed within the memory budget whatever the state's size: each tensor is written row-major
in tiles of whole leading-axis rows, each filled from the stored boxes it overlaps (a dense
tensor's chunks, a sharded tensor's shards, so sharded tensors are consolidated into full ones),
cast, written; each chunk's CRC-32 is checked as its bytes go by. Large outputs are split as
Hugging Face splits them. A forged manifest is refused by restore's own checks before anything
is allocated or written. The export appears whole or not at all: the files are written into a
staging folder inside the output folder and moved in once whole (``stage``); an earlier export
there is replaced only with ``overwrite``, and only the files its record lists.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import stat
import struct
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from manifest import Location, Manifest
from snapshot._engine.format.manifest_io import load_manifest, open_linked
from snapshot._engine.format.text import printable
from snapshot._engine.handlers import for_entry
from snapshot._engine.restore import checks as claims
from snapshot._engine.runtime import naming_snapshot, run
from snapshot._engine.tools.inspection import BoxReader
from snapshot.errors import InvalidArgumentError, StorageError, UnsupportedValueError
from snapshot.options import Options, resolve
from snapshot.snapshot import Snapshot
from storage_plugins import StoragePlugin
from storage_plugins.fs import missing_folders

logger = logging.getLogger("snapshot")

# The names ``dtype`` accepts.
DTYPES = {
    **dict.fromkeys(("bf16", "bfloat16"), torch.bfloat16),
    **dict.fromkeys(("fp16", "f16", "float16", "half"), torch.float16),
    **dict.fromkeys(("fp32", "f32", "float32", "float"), torch.float32),
    **dict.fromkeys(("fp64", "float64"), torch.float64),
    **dict.fromkeys(("fp8", "float8_e4m3fn"), torch.float8_e4m3fn),
    "float8_e5m2": torch.float8_e5m2,
}
FORMATS = ("safetensors", "torch")


def export(
    snapshot: Snapshot | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    format: str = "safetensors",
    key: str | None = None,
    strip_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int, int, int], None] | None = None,
) -> list[str]:
    """Writes the tensors of ``snapshot`` (rank 0's view) into the local folder ``out_dir``;
    returns the paths of the files written.

    Args:
        format: ``"safetensors"`` (``model.safetensors``, or ``model-0000i-of-0000N`` files and
            an index) or ``"torch"`` (``pytorch_model.bin`` likewise).
        key: only this app_state key's tensors, named as its module names them; without it,
            every key's, named ``model.layer.weight``.
        strip_prefix: removed from every name that starts with it (``module.``, ``_orig_mod.``).
        dtype: cast floating point tensors to this dtype (``"bf16"``, ``torch.float16``...).
        max_shard_size: the largest file (``"5GB"``, ``"500MiB"``, or bytes).
        options: the memory budget and checksums of the reads.
        overwrite: replace an earlier export in ``out_dir`` (once the new one is complete);
            without it, a folder holding an export is refused.
        progress: called as ``progress(files_done, files, bytes_done, bytes)`` as the tensors'
            bytes are written (the command line's progress bar).

    The files are staged inside ``out_dir`` and put in place only once all are complete; on
    failure ``out_dir`` is as it was. Other files there are never touched; values that are not
    tensors are skipped and logged. Raises ``InvalidArgumentError``,
    ``UnsupportedValueError`` (what safetensors cannot hold), ``CorruptSnapshotError`` or
    ``IncompatibleSnapshotError`` (before anything is read).
    """
    if format not in FORMATS:
        raise InvalidArgumentError(f"export: format must be one of {FORMATS}, got {format!r}")
    out_dtype = _dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    resolved = resolve(options)
    if isinstance(snapshot, Snapshot):
        path, manifest = snapshot.path, snapshot._manifest
        if storage_options is None:
            storage_options = snapshot.storage_options
    else:
        path = os.fspath(snapshot)
        manifest = load_manifest(path, storage_options, resolved)
    out = os.fspath(out_dir)
    if "://" in out:
        raise InvalidArgumentError(f"export: out_dir must be a local folder, got {out!r}")
    t = time.perf_counter()
    with naming_snapshot(path):
        sources, skipped = collect(
            manifest, key=key, strip_prefix=strip_prefix, dtype=out_dtype, where=path
        )
    if not sources:
        raise InvalidArgumentError(
            f"export: snapshot {path} has no tensors under {key or 'any key'}"
        )
    files: list[list[Source]] = []  # in order, files of at most max_bytes (or one tensor)
    size = 0
    for s in sources:
        if not files or size + s.out_bytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(s)
        size += s.out_bytes
    if format == "safetensors":  # every header built now, refusing what the format cannot hold
        for group in files:
            safetensors_header(group)
    earlier_export(out, overwrite)  # refused now, before an hour of writing
    # A tile, a box's piece of it, the cast copy and the plugin's read buffer: a quarter of
    # the budget each at most.
    tile = max(1 << 20, resolved.budget() // 4)
    with open_linked(path, manifest, storage_options, resolved) as plugin:
        # Restore's check of the sizes the manifest claims for every blob read (no overlapping
        # ranges; each blob holds its ranges), before anything is read or allocated.
        jobs = resolved.max_concurrent_io
        assert jobs is not None
        with naming_snapshot(path):
            blobs, _ = claims.claimed_blobs(manifest.view(0), [s.path for s in sources], {})
            run(
                claims.check_blob_sizes(
                    plugin, blobs, manifest.blob_sizes, jobs, resolved, before=True
                )
            )
        written = stage(
            out,
            overwrite,
            lambda folder: write_files(plugin, files, folder, format, tile, resolved, progress),
        )
    skipped_note = f"; {len(skipped)} other values skipped" if skipped else ""
    logger.info(
        "exported %d tensors (%.1f MB) of %s to %d file(s) in %s in %.3f s%s",
        len(sources),
        sum(s.out_bytes for s in sources) / 1e6,
        path,
        len(written),
        out,
        time.perf_counter() - t,
        skipped_note,
    )
    return written


def _dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return DTYPES[str(value).lower()]
    except KeyError:
        raise InvalidArgumentError(
            f"export: dtype {value!r} is not one of {', '.join(sorted(DTYPES))}"
        ) from None


# torch dtype -> safetensors' name (the format's own list), for the dtypes this torch has.
_NAMES = (
    "float64:F64 float32:F32 float16:F16 bfloat16:BF16 int64:I64 int32:I32 int16:I16 int8:I8 "
    "uint8:U8 uint16:U16 uint32:U32 uint64:U64 bool:BOOL complex64:C64 float8_e4m3fn:F8_E4M3 "
    "float8_e5m2:F8_E5M2 float8_e4m3fnuz:F8_E4M3FNUZ float8_e5m2fnuz:F8_E5M2FNUZ"
)
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    getattr(torch, attr): name
    for attr, _, name in (pair.partition(":") for pair in _NAMES.split())
    if hasattr(torch, attr)
}

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(i?)B?\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5 * 10**9 (decimal, as Hugging Face's), ``"512MiB"`` -> binary; an int is
    bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    elif m := _SIZE.fullmatch(str(text)):
        power = ("", "K", "M", "G", "T").index(m.group(2).upper())
        size = int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)
    else:
        raise InvalidArgumentError(f"max_shard_size: {text!r} is not a size such as 5GB or 500MiB")
    if size < 1:
        raise InvalidArgumentError(f"max_shard_size must be positive, got {text!r}")
    return size


@dataclass
class Source:
    """One tensor to export: output ``name``, manifest ``path``, stored dtype, global shape,
    boxes (one for a dense tensor: ``TensorLayout.boxes``) and output dtype."""

    name: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], tuple[Location, ...]]]
    out_dtype: torch.dtype

    @property
    def out_bytes(self) -> int:
        return math.prod(self.shape) * self.out_dtype.itemsize


def collect(
    manifest: Manifest,
    *,
    key: str | None,
    strip_prefix: str | None,
    dtype: torch.dtype | None,
    where: str,
) -> tuple[list[Source], list[str]]:
    """The tensors to export from rank 0's view (under the app_state ``key`` when given), in
    the snapshot's order, and the paths of the other leaves, skipped."""
    entries = manifest.view(0)
    prefix = "0/" if key is None else f"0/{key.strip('/')}/"
    if key is not None and not any(p.startswith(prefix) for p in entries):
        keys = sorted({p.split("/")[1] for p in entries if p.startswith("0/") and "/" in p})
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
            if entry.locations or entry.tag == "primitive":
                skipped.append(path)
            continue
        t_dtype = layout.dtype
        # Each component unescaped (``flatten.escape_key``), joined by dots: ``layer.weight``.
        parts = path[len(prefix) :].split("/")
        name = ".".join(p.replace("%2F", "/").replace("%25", "%") for p in parts)
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix) :]
        if name in names:
            raise InvalidArgumentError(
                f"two entries become the name {name!r}: {names[name]} and {path}"
            )
        names[name] = path
        out_dtype = dtype if dtype is not None and t_dtype.is_floating_point else t_dtype
        sources.append(Source(name, path, t_dtype, tuple(layout.shape), layout.boxes, out_dtype))
    return sources, skipped


def tiles(source: Source, tile_bytes: int) -> Iterator[tuple[int, int]]:
    """Row ranges ``[a, b)`` of the leading axis, each at most ``tile_bytes`` (of the larger of
    the stored and output dtypes), at least one row; a 0-d tensor is one row."""
    rows, *inner = source.shape or (1,)
    per_row = max(1, math.prod(inner)) * max(source.dtype.itemsize, source.out_dtype.itemsize)
    step = max(1, tile_bytes // per_row)
    for a in range(0, rows, step):
        yield (a, min(rows, a + step))


def stream_tensor(
    plugin: StoragePlugin,
    source: Source,
    tile_bytes: int,
    write: Callable[[memoryview], object],
    options: Options,
) -> None:
    """Writes ``source``'s bytes (cast to its output dtype) through ``write``, tile by tile."""
    verify = bool(options.checksums)
    readers = [BoxReader(plugin, c, source.path, options, verify) for _, _, c in source.boxes]
    shape = source.shape or (1,)  # a 0-d tensor as one row
    for a, b in tiles(source, tile_bytes):
        tile = torch.empty((b - a, *shape[1:]), dtype=source.dtype)
        # The boxes were checked to cover the tensor exactly once (``collect``).
        for (offsets, sizes, _), reader in zip(source.boxes, readers, strict=True):
            offsets, sizes = offsets or (0,), sizes or (1,)
            lo, hi = max(a, offsets[0]), min(b, offsets[0] + sizes[0])
            if lo >= hi:
                continue
            if tuple(sizes[1:]) == tuple(shape[1:]):
                # Whole rows (a dense tensor, a shard along the leading axis): read in place.
                run(reader.read(_bytes_of(tile[lo - a : hi - a])))
                continue
            piece = torch.empty((hi - lo, *sizes[1:]), dtype=source.dtype)
            run(reader.read(_bytes_of(piece)))
            inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:], strict=True))
            tile[(slice(lo - a, hi - a), *inner)].copy_(piece)
        write(_bytes_of(tile if source.out_dtype == source.dtype else tile.to(source.out_dtype)))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype), without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def _read_whole(
    plugin: StoragePlugin, s: Source, tile_bytes: int, options: Options
) -> torch.Tensor:
    """``s`` streamed into a new tensor of its output dtype."""
    t = torch.empty(s.shape, dtype=s.out_dtype)
    view, pos = _bytes_of(t), 0

    def put(data: memoryview) -> None:
        nonlocal pos
        view[pos : pos + len(data)] = data
        pos += len(data)

    stream_tensor(plugin, s, tile_bytes, put, options)
    return t


RESERVED_NAME = "__metadata__"  # the header's key for the file's metadata
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's ``MAX_HEADER_SIZE``


def safetensors_header(sources: Sequence[Source]) -> bytes:
    """A safetensors file's header for ``sources``: its 8-byte length and the JSON, padded with
    spaces to a multiple of 8 bytes. Refuses names it cannot carry, and a header larger than the
    format's readers accept."""
    header: dict[str, Any] = {RESERVED_NAME: {"format": "pt"}}
    offset = 0
    for s in sources:
        if s.name == RESERVED_NAME:
            raise UnsupportedValueError(
                f"{printable(s.path)}: a tensor named {RESERVED_NAME!r} cannot be written to "
                "safetensors, whose header keeps that key for the file's metadata (export it "
                "with --format torch, or rename it)"
            )
        try:
            s.name.encode("utf-8")
        except UnicodeEncodeError:
            raise UnsupportedValueError(
                f"{printable(s.path)}: the name '{printable(s.name)}' is not valid UTF-8 text, "
                "which a safetensors header needs (export it with --format torch)"
            ) from None
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
    if len(text) > MAX_HEADER_BYTES:
        raise UnsupportedValueError(
            f"the safetensors header of the {len(sources):,} tensors of one file would be "
            f"{len(text):,} bytes, over the {MAX_HEADER_BYTES:,} the format's readers accept; "
            "pass a smaller max_shard_size (--max-shard-size) to split them"
        )
    return struct.pack("<Q", len(text)) + text


def write_files(
    plugin: StoragePlugin,
    files: list[list[Source]],
    folder: str,
    format: str,
    tile_bytes: int,
    options: Options,
    progress: Callable[[int, int, int, int], None] | None = None,
) -> list[str]:
    """Writes the planned files into ``folder``: safetensors ones (``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors``) streamed tile by tile, or ``torch.save`` ones
    (``pytorch_model.bin``...) each made whole in memory, one file at a time; for several, the
    index as Hugging Face writes it. Returns their names, the index last. ``progress`` hears
    of the files and tensor bytes written."""
    stem, ext = ("model", ".safetensors") if format == "safetensors" else ("pytorch_model", ".bin")
    n = len(files)
    names = (
        [f"{stem}{ext}"] if n == 1 else [f"{stem}-{i + 1:05d}-of-{n:05d}{ext}" for i in range(n)]
    )
    total = sum(s.out_bytes for g in files for s in g)
    done = [0, 0]  # files, bytes

    def tick(nbytes: int, finished: int = 0) -> None:
        done[0] += finished
        done[1] += nbytes
        if progress is not None:
            progress(done[0], n, done[1], total)

    tick(0)
    for name, group in zip(names, files, strict=True):

        def fill(f: BinaryIO, group: list[Source] = group) -> None:
            if format == "torch":
                whole = {}
                for s in group:
                    whole[s.name] = _read_whole(plugin, s, tile_bytes, options)
                    tick(s.out_bytes)
                torch.save(whole, f)
                return
            f.write(safetensors_header(group))

            def counted(data: memoryview) -> None:
                f.write(data)
                tick(data.nbytes)

            write: Callable[[memoryview], object] = f.write if progress is None else counted
            for s in group:
                stream_tensor(plugin, s, tile_bytes, write, options)

        write_file(os.path.join(folder, name), fill)
        tick(0, 1)
    if n == 1:
        return names
    index = {
        "metadata": {"total_size": sum(s.out_bytes for g in files for s in g)},
        "weight_map": {s.name: name for name, g in zip(names, files, strict=True) for s in g},
    }
    data = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
    write_file(os.path.join(folder, f"{stem}{ext}.index.json"), lambda f: f.write(data))
    return [*names, f"{stem}{ext}.index.json"]


# The files an export put in a folder: all that a later export with ``overwrite`` replaces.
RECORD = ".statesnap-export.json"
# The staging folder is inside the output folder: a rename does not cross file systems.
STAGING_PREFIX = ".statesnap-export-"
# The names an export (of either format) writes; files of these names are an earlier export.
EXPORT_NAME = re.compile(
    r"model(-\d{5,}-of-\d{5,})?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model(-\d{5,}-of-\d{5,})?\.bin|pytorch_model\.bin\.index\.json"
)
_MAX_RECORD_BYTES = 1 << 20  # larger is not a record an export wrote


def write_file(path: str, fill: Callable[[BinaryIO], object]) -> None:
    """Creates the file ``path`` (never one that exists), has ``fill`` write it, and syncs it."""
    with open(path, "xb") as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())


def sync_folder(path: str) -> None:
    """Makes the entries of folder ``path`` (files created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def earlier_export(out_dir: str, overwrite: bool) -> list[str]:
    """The earlier export's files in ``out_dir`` that this one replaces (reads only); refuses
    any without ``overwrite``, and one the record does not list or that is not a regular file."""
    try:
        names = os.listdir(out_dir)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise InvalidArgumentError(f"export: {out_dir} is not a folder") from None
    except OSError as e:
        raise StorageError(f"export: cannot list the folder {out_dir}: {e}") from e
    found = sorted(n for n in names if EXPORT_NAME.fullmatch(n))
    for n in [RECORD, *found] if RECORD in names else found:
        if not stat.S_ISREG(os.lstat(os.path.join(out_dir, n)).st_mode):
            raise InvalidArgumentError(
                f"export: {os.path.join(out_dir, n)} is not a regular file (a link, or a "
                f"folder); an export replaces only files it wrote, and keeps its record in "
                f"{RECORD}: remove it yourself, or choose another folder"
            )
    if found and not overwrite:
        raise InvalidArgumentError(
            f"export: {out_dir} already holds an export ({', '.join(found)}); pass "
            "overwrite=True (statesnap export --overwrite) to replace it, or choose another "
            "folder"
        )
    # The export names the record lists (anyone can edit it: other names are ignored); none when
    # it is missing, a link, not a regular file, too large or not JSON.
    recorded: Any = None
    try:
        fd = os.open(os.path.join(out_dir, RECORD), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            data = f.read(_MAX_RECORD_BYTES + 1) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        recorded = json.loads(data) if 0 < len(data) <= _MAX_RECORD_BYTES else None
    except (OSError, ValueError):
        pass
    listed = recorded.get("files") if isinstance(recorded, dict) else None
    unrecorded = [n for n in found if not (isinstance(listed, list) and n in listed)]
    if unrecorded:
        raise InvalidArgumentError(
            f"export: {out_dir} holds {', '.join(unrecorded)}, which no statesnap export "
            f"recorded writing ({RECORD} does not list them); an export replaces only files it "
            "wrote: remove them yourself, or choose another folder"
        )
    return found


def put_in_place(out_dir: str, staging: str, names: Sequence[str], overwrite: bool) -> None:
    """Moves the complete export's ``names`` from ``staging`` into ``out_dir``, the earlier
    export's (checked again) first moved aside into ``staging/previous``: an index leaves first
    and enters last (never naming a file not there); a failed move undoes every move."""
    old = earlier_export(out_dir, overwrite)
    if os.path.lexists(os.path.join(out_dir, RECORD)):
        old.append(RECORD)
    previous = os.path.join(staging, "previous")
    os.mkdir(previous)
    leaving = sorted(old, key=lambda n: (n == RECORD, not n.endswith(".index.json"), n))
    entering = sorted(names, key=lambda n: (n == RECORD, n.endswith(".index.json"), n))
    moves = [(os.path.join(out_dir, n), os.path.join(previous, n)) for n in leaving]
    moves += [(os.path.join(staging, n), os.path.join(out_dir, n)) for n in entering]
    done: list[tuple[str, str]] = []
    try:
        for src, dst in moves:
            os.rename(src, dst)
            done.append((src, dst))
        sync_folder(out_dir)
    except BaseException:
        try:
            for src, dst in reversed(done):
                os.rename(dst, src)
            sync_folder(out_dir)
        except OSError as e:
            msg = "export: could not put back the earlier export in %s (%s); its files are in %s"
            logger.error(msg, out_dir, e, previous)
        raise


def stage(out_dir: str, overwrite: bool, write: Callable[[str], list[str]]) -> list[str]:
    """Runs ``write`` (it writes the files into the folder given, returning their names) in a
    new staging folder inside ``out_dir``, adds the record, puts the files in place and returns
    their paths. The staging folder (and ``out_dir``, when made here and the export failed) is
    removed whatever happens; a file system failure is a ``StorageError``."""
    try:
        made = missing_folders(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        staging = os.path.join(out_dir, f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}")
        os.mkdir(staging)
        try:
            names = write(staging)
            record = json.dumps({"written_by": "statesnap export", "files": names}, indent=2)
            write_file(os.path.join(staging, RECORD), lambda f: f.write(record.encode() + b"\n"))
            sync_folder(staging)
            put_in_place(out_dir, staging, [*names, RECORD], overwrite)
        except BaseException:
            previous = os.path.join(staging, "previous")
            if not (os.path.isdir(previous) and os.listdir(previous)):
                shutil.rmtree(staging, ignore_errors=True)
            for folder in made:
                try:
                    os.rmdir(folder)  # only when empty: nothing but what this export made
                except OSError:
                    break
            raise
    except OSError as e:
        raise StorageError(f"export: cannot write the export into {out_dir}: {e}") from e
    try:
        shutil.rmtree(staging)  # the new files moved out; the earlier export's files, if any
    except OSError as e:  # the export is in place: say what is left, and return it
        logger.warning("export: could not remove the staging folder %s: %s", staging, e)
    return [os.path.join(out_dir, n) for n in names]


__all__ = ["export"]
