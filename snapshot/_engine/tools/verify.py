"""``statesnap verify`` and ``statesnap diff``, the commands that read a snapshot's blobs; each
returns a report and prints nothing (``cli_commands`` formats it).

``verify``: every blob read once, in pieces, a few blobs at a time, and checked against the
manifest: its length, and each byte range's CRC-32, combined from the pieces that cover it.
Pickles without a CRC-32 (torchsnapshot's) are decoded by the safe loader instead; those with
one have their archive's directory checked as a restore checks it (``objects.check_archive``),
from their first bytes and last ``ARCHIVE_TAIL`` bytes, kept as they are read.

``diff``: how two snapshots differ, entry by entry: kinds, dtypes, shapes, container keys and
primitive values from the manifests, bytes through the recorded CRC-32s; only entries whose
CRC-32s were not recorded are read, from both snapshots, piece by piece.
"""

from __future__ import annotations

import asyncio
import functools
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from manifest import (
    DictEntry,
    Entry,
    ListEntry,
    Location,
    Manifest,
    ObjectEntry,
    PrimitiveEntry,
    ShardedObjectEntry,
    ShardedTensorEntry,
    TensorEntry,
    TupleEntry,
    reference_of,
)
from snapshot._engine.format.manifest_io import load_manifest, open_linked
from snapshot._engine.format.serialization import ArchiveEnds, MissingBytes, combine, crc32
from snapshot._engine.handlers import for_entry
from snapshot._engine.handlers.objects import check_archive
from snapshot._engine.io.storage_calls import call
from snapshot._engine.restore.reads import resolve_view
from snapshot._engine.restore.restore import read_object
from snapshot._engine.tools.inspection import (
    JOBS,
    PIECE_BYTES,
    BoxReader,
    Progress,
    each,
    format_shape,
)
from snapshot.errors import SnapshotError, UnsafeObjectError
from snapshot.options import Options, resolve
from storage_plugins import StoragePlugin, UnsafeBlobError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a snapshot's blobs: the bytes ``[start, end)`` of ``blob`` holding
    the entries ``paths`` (none when the problem is the blob's own, such as its length)."""

    blob: str
    start: int
    end: int
    paths: tuple[str, ...]
    what: str


@dataclass
class VerifyReport:
    """What ``verify`` found. ``problems`` are sorted by blob and offset."""

    entries: int
    blobs: int
    bytes_read: int = 0
    ranges: int = 0  # distinct byte ranges the manifest records
    checksums_checked: int = 0
    checksums_missing: int = 0  # ranges without a recorded CRC-32 (taken with checksums off)
    sizes_unknown: list[str] = field(default_factory=list)  # blobs whose size the store hides
    problems: list[Problem] = field(default_factory=list)
    # The writer, when the snapshot is another library's ("torchsnapshot 0.1.0": no checksums).
    foreign: str | None = None
    decoded: int = 0  # pickles without a checksum, checked by decoding them
    # Pickles without a checksum that need a type the safe loader does not allow: not checked.
    not_decoded: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(slots=True)
class _Range:
    """A distinct byte range of a blob and every logical path stored in it."""

    offset: int
    nbytes: int
    crc32: int | None
    paths: list[str]
    value: int = 0  # the CRC-32 of the bytes read so far
    # A torch.save archive (checked as a restore checks it once its CRC-32 matched): its first
    # bytes and its last ``ARCHIVE_TAIL`` (where the zip directory is), kept while it is read.
    archive: bool = False
    head: bytes = b""
    tail: bytearray = field(default_factory=bytearray)
    # A compressed range (read as stored): the check of its bytes once decompressed.
    inflated: Any = None

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _ranges_by_blob(manifest: Manifest) -> dict[str, list[_Range]]:
    """blob -> its distinct ranges (a location shared by several paths is one range), by
    offset."""
    found: dict[str, dict[tuple[int, int, int | None], _Range]] = {}
    for path, entry in manifest.entries.items():
        for loc in entry.locations:
            ranges = found.setdefault(loc.blob, {})
            at = loc if loc.stored is None else loc.stored  # a compressed range: as stored
            key = (at.offset, at.nbytes, at.crc32)
            r = ranges.get(key)
            if r is None:
                archive = loc.crc32 is not None and _is_archive(entry) and at is loc
                ranges[key] = _Range(at.offset, at.nbytes, at.crc32, [path], archive=archive)
                if at is not loc:
                    from snapshot._engine.io.compression import InflatedCheck

                    ranges[key].inflated = InflatedCheck(loc.nbytes, loc.crc32)
            elif r.paths[-1] != path:
                r.paths.append(path)
    return {
        blob: sorted(ranges.values(), key=lambda r: (r.offset, r.nbytes))
        for blob, ranges in sorted(found.items())
    }


def _is_archive(entry: Any) -> bool:
    """Whether ``entry``'s ranges hold ``torch.save`` archives (its kind says)."""
    kind = for_entry(entry)
    return kind is not None and kind.archived(entry)


# How much of an archive's end verify keeps to find its zip directory: a torch.save archive's
# directory is a few dozen bytes per member; one that does not fit is not checked here.
ARCHIVE_TAIL = 1 << 20


def _keep_archive(r: _Range, data: memoryview, lo: int, hi: int) -> str | None:
    """Keeps what ``r``'s archive check needs of its bytes ``[lo, hi)`` (``data``); once the
    last of them is read and its CRC-32 matched, returns what the check finds wrong."""
    if lo == r.offset:
        r.head = bytes(data[:4])
    keep_from = max(lo, r.end - ARCHIVE_TAIL)
    if keep_from < hi:
        r.tail += data[keep_from - lo :]
    if hi < r.end:
        return None
    head, tail = r.head, bytes(r.tail)
    r.head, r.tail = b"", bytearray()
    if r.value != r.crc32:
        return None  # reported as a checksum mismatch
    try:
        check_archive(io.BufferedReader(ArchiveEnds(r.nbytes, head, tail)), r.paths[0])
    except MissingBytes:
        pass  # a directory larger than the tail kept: a restore still checks it
    except SnapshotError as e:
        return str(e)
    return None


class _StoreError(Exception):
    """A plugin call failed; its error is the ``__cause__``."""


async def _check_blob(
    plugin: StoragePlugin,
    report: VerifyReport,
    options: Options,
    item: tuple[str, int, list[_Range]],
    buffer: memoryview,
    tick: Callable[[int], None],
) -> None:
    """Reads the blob of ``item`` (its name, the size the manifest records and its ranges) in
    pieces of ``buffer``'s length and checks its size and every range's CRC-32, adding what is
    wrong to ``report``."""
    blob, expected, ranges = item
    label = ranges[0].paths[0] if ranges else blob

    def problem(start: int, end: int, paths: Sequence[str], what: str) -> None:
        report.problems.append(Problem(blob, start, end, tuple(paths), what))

    async def read(op: Callable[[], Any]) -> Any:
        # Transient errors are retried; the plugin's own error comes out at the end, as the
        # cause of a ``_StoreError`` (an error of the checks below is a bug: it propagates).
        try:
            return await call(plugin, "read", blob, label, op, options=options, convert=False)
        except Exception as e:
            raise _StoreError from e

    failure, pos = "", -1  # -1: not even the blob's size is known
    try:
        size = await read(lambda: plugin.size(blob))
        if size is None and expected == 0 and not await read(lambda: plugin.exists(blob)):
            raise _StoreError from FileNotFoundError(blob)
        limit = expected
        if size is None:
            report.sizes_unknown.append(blob)
        elif size > expected and reference_of(blob) is None:
            # (A sibling snapshot's blob holds more than the ranges this snapshot reuses.)
            problem(
                expected,
                size,
                (),
                f"the blob is {size:,} bytes, {size - expected:,} more than the manifest "
                f"records ({expected:,}): bytes were added after the take, or the blob was "
                "replaced",
            )
        elif size < expected:
            problem(
                size,
                expected,
                (),
                f"the blob is {size:,} bytes, {expected - size:,} fewer than the manifest "
                f"records ({expected:,}): it was cut short",
            )
            limit = size
            failure = f"cut off: the blob ends at byte {size:,}"
        first = pos = 0  # ranges before ``first`` end before the current piece
        while pos < limit:
            n = min(len(buffer), limit - pos)
            end, piece = pos + n, buffer[:n]
            await read(functools.partial(plugin.read_into, blob, pos, piece))
            # Each range the piece holds part of gets that part's CRC added to its own.
            while first < len(ranges) and ranges[first].end <= pos:
                first += 1
            for r in ranges[first:]:
                if r.offset >= end:
                    break
                if r.end <= pos:
                    continue
                lo, hi = max(r.offset, pos), min(r.end, end)
                data = piece[lo - pos : hi - pos]
                if r.nbytes and r.crc32 is not None:
                    r.value = crc32(data, r.value)
                    bad = _keep_archive(r, data, lo, hi) if r.archive else None
                    if bad:
                        problem(r.offset, r.end, r.paths, bad)
                if r.inflated is not None:
                    bad = r.inflated.add(data, hi == r.end and r.value in (r.crc32, None))
                    if bad:
                        problem(r.offset, r.end, r.paths, bad)
            pos = end
            report.bytes_read += n
            tick(n)
    except _StoreError as failed:
        e = failed.__cause__
        if isinstance(e, FileNotFoundError):
            failure = "the blob is missing"
        elif isinstance(e, EOFError):
            failure = f"the blob ends before this range does ({e})"
        elif pos >= 0:
            failure = f"cannot read: {type(e).__name__}: {e}"
        elif isinstance(e, UnsafeBlobError):
            failure = f"refused, not read: {e}"
        else:
            failure = f"cannot get the blob's size: {type(e).__name__}: {e}"
    for r in ranges:
        if r.end > pos:
            problem(r.offset, r.end, r.paths, failure or "not read")
        elif r.crc32 is None:
            report.checksums_missing += 1
        else:
            report.checksums_checked += 1
            if r.value != r.crc32:
                problem(
                    r.offset,
                    r.end,
                    r.paths,
                    f"checksum mismatch: the manifest records crc32 {r.crc32:#010x}, the "
                    f"bytes read have {r.value:#010x}",
                )


def verify(
    path: str,
    storage_options: dict[str, Any] | None,
    *,
    jobs: int = JOBS,
    piece_bytes: int = PIECE_BYTES,
    progress: Progress | None = None,
    options: Options | None = None,
) -> VerifyReport:
    """Reads every blob of the snapshot at ``path`` and checks it against the manifest: each
    blob's length (when the store can tell it), each byte range's CRC-32 (when recorded); a
    pickle without one is decoded by the safe loader. Finds every problem, not just the first.
    At most ``jobs`` blobs are read at once, in pieces of at most ``piece_bytes``.

    Raises:
        SnapshotNotFoundError: no snapshot at ``path``.
        CorruptSnapshotError: the manifest itself is damaged (``ChecksumError``) or undecodable.
    """
    options = resolve(options)
    manifest = load_manifest(path, storage_options, options)
    by_blob = _ranges_by_blob(manifest)
    sizes = manifest.blob_sizes
    n_ranges = sum(len(r) for r in by_blob.values())
    report = VerifyReport(len(manifest.entries), len(by_blob), ranges=n_ranges)
    size = max(1, min(piece_bytes, max(sizes.values(), default=0)))
    items = [(blob, sizes[blob], ranges) for blob, ranges in by_blob.items()]
    # (As stored: a compressed range is checked before and after decompression, ``_Range``.)
    with open_linked(path, manifest, storage_options, options, inflate=False) as plugin:
        check = functools.partial(_check_blob, plugin, report, options)
        each(items, jobs, size, sum(sizes.values()), progress, check)
    if manifest.metadata.get("format") == "torchsnapshot":
        report.foreign = str(manifest.metadata.get("library", "torchsnapshot"))
    # A pickle without a recorded CRC-32 whose blob showed no problem is decoded by the safe
    # loader (then the only check), once per byte range; one needing a type the loader does not
    # allow is named in ``not_decoded``, not counted as damage. A tensor recorded as a view of
    # another's storage is refused where a read would refuse it (``reads.resolve_view``).
    damaged = {p for problem in report.problems for p in problem.paths}
    decoded: set[tuple[tuple[str, int, int], ...]] = set()
    for key, entry in manifest.entries.items():
        locations, what = entry.locations, ""
        stored = tuple((loc.blob, loc.offset, loc.nbytes) for loc in locations)
        if type(entry) is TensorEntry and entry.view is not None:
            try:
                resolve_view(manifest.entries, key, entry)
            except SnapshotError as e:
                what = f"a view that a read refuses: {e}"
        elif (
            _is_archive(entry)
            and key not in damaged
            and all(loc.crc32 is None for loc in locations)
            and stored not in decoded
        ):
            decoded.add(stored)
            try:
                read_object(
                    manifest,
                    key,
                    None,
                    None,
                    path=path,
                    storage_options=storage_options,
                    options=options,
                )
            except UnsafeObjectError:
                report.not_decoded.append(key)
            except SnapshotError as e:
                what = f"cannot be decoded: {e}"
            else:
                report.decoded += 1
        if what:  # placed at the entry's first stored range
            first = locations[0] if locations else Location(blob="", offset=0, nbytes=0)
            end = first.offset + first.nbytes
            report.problems.append(Problem(first.blob, first.offset, end, (key,), what))
    # Per blob: its own problems (length) first, then its entries' by offset.
    report.problems.sort(key=lambda p: (p.blob, bool(p.paths), p.start, p.end, p.paths))
    report.sizes_unknown.sort()
    return report


@dataclass(frozen=True)
class Difference:
    """One way two snapshots differ at logical path ``path``.

    ``what``: ``"only in A"``, ``"only in B"``, ``"kind"``, ``"dtype"``, ``"shape"``,
    ``"dtype, shape"``, ``"type"`` (an object's, or whether a tensor was an ``nn.Parameter``
    or required grad), ``"bytes"``, ``"value"`` (a primitive's),
    ``"keys"`` (a dict's), ``"length"`` (a list's or tuple's). ``detail`` says how, for people.
    """

    path: str
    what: str
    detail: str


@dataclass
class DiffReport:
    """What ``diff`` found: differences in the order of A's manifest, then B's new paths."""

    path_a: str
    path_b: str
    entries_a: int
    entries_b: int
    differences: list[Difference]
    compared_by_reading: int = 0  # entries whose bytes had to be read and compared

    @property
    def identical(self) -> bool:
        return not self.differences


def _content_crc(locations: Sequence[Location]) -> int | None:
    """The CRC-32 of an entry's bytes (its locations' concatenation), from the recorded CRCs;
    None when any is missing. Independent of how the bytes were split into chunks."""
    total = 0
    for loc in locations:
        if loc.crc32 is None:
            return None
        total = combine(total, loc.crc32, loc.nbytes)
    return total


def _primitive_text(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _tensor_type(entry: TensorEntry) -> str:
    """What a tensor entry was beyond its values: a ``Tensor`` or a ``Parameter``, and whether
    it required grad."""
    name = "Parameter" if entry.parameter else "Tensor"
    return f"{name} (requires_grad)" if entry.requires_grad else name


def _compare(path: str, a: Entry, other: Entry) -> Difference | bool:
    """A difference seen in the manifests, else whether the bytes must be read to tell
    (False: the entries are the same)."""
    if type(a) is not type(other):
        return Difference(path, "kind", f"{a.tag} -> {other.tag}")
    b: Any = other  # of ``a``'s type
    if isinstance(a, TensorEntry):
        what = []
        if a.dtype != b.dtype:
            what.append(("dtype", f"{a.dtype} -> {b.dtype}"))
        if a.shape != b.shape:
            what.append(("shape", f"{format_shape(a.shape)} -> {format_shape(b.shape)}"))
        # What torch.load would give beyond the values; a view's sharing of another entry's
        # storage is not compared (its values are its own bytes, compared below).
        if (a.parameter, a.requires_grad) != (b.parameter, b.requires_grad):
            what.append(("type", f"{_tensor_type(a)} -> {_tensor_type(b)}"))
        if what:
            return Difference(path, ", ".join(w for w, _ in what), "; ".join(d for _, d in what))
    elif isinstance(a, ShardedTensorEntry):
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return Difference(
                path,
                "dtype, shape",
                f"{a.dtype}{format_shape(a.shape)} -> {b.dtype}{format_shape(b.shape)}",
            )
        boxes_a = [(s.offsets, s.sizes) for s in a.shards]
        if boxes_a != [(s.offsets, s.sizes) for s in b.shards]:
            # The same values cut differently: their bytes cannot be compared range by range.
            return Difference(
                path,
                "sharding",
                f"stored as {len(a.shards)} shards -> {len(b.shards)} shards (contents not "
                "compared)",
            )
    elif isinstance(a, (ObjectEntry, ShardedObjectEntry)):
        if (a.obj_type, a.serializer) != (b.obj_type, b.serializer):
            return Difference(path, "type", f"{a.obj_type} -> {b.obj_type}")
    elif isinstance(a, PrimitiveEntry):
        # repr tells 1 from True and 1.0, -0.0 from 0.0, and finds nan equal to nan.
        if (a.value_type, repr(a.value)) != (b.value_type, repr(b.value)):
            return Difference(
                path, "value", f"{_primitive_text(a.value)} -> {_primitive_text(b.value)}"
            )
        return False
    elif isinstance(a, DictEntry):
        if a.keys != b.keys or a.ordered != b.ordered:
            # Sets: asking a tuple of keys for each key is quadratic in a dict's size.
            kept_a, kept_b = set(a.keys), set(b.keys)
            gone = [k for k in a.keys if k not in kept_b]
            new = [k for k in b.keys if k not in kept_a]
            if gone or new:
                detail = f"removed {gone}, added {new}"
            elif a.keys != b.keys:
                detail = "same keys, another order"
            else:
                detail = "dict -> OrderedDict" if b.ordered else "OrderedDict -> dict"
            return Difference(path, "keys", detail)
        return False
    elif isinstance(a, (ListEntry, TupleEntry)):
        if a.length != b.length:
            return Difference(path, "length", f"{a.length} -> {b.length}")
        return False
    if a.nbytes != b.nbytes:
        return Difference(path, "bytes", f"{a.nbytes:,} bytes -> {b.nbytes:,} bytes")
    crc_a, crc_b = _content_crc(a.locations), _content_crc(b.locations)
    if crc_a is not None and crc_b is not None:
        if crc_a != crc_b:
            return Difference(
                path, "bytes", f"contents differ (crc32 {crc_a:#010x} -> {crc_b:#010x})"
            )
        return False
    return True


def diff(
    path_a: str,
    path_b: str,
    storage_options: dict[str, Any] | None,
    *,
    jobs: int = JOBS,
    progress: Progress | None = None,
) -> DiffReport:
    """How the snapshots at ``path_a`` and ``path_b`` differ, entry by entry.

    Kinds, dtypes, shapes, container keys and primitive values come from the manifests; bytes
    are compared through the entries' recorded CRC-32s (combined over chunks, so chunking does
    not matter). Only entries whose CRC-32s are missing on either side are read, from both
    snapshots, :data:`PIECE_BYTES` at a time, ``jobs`` entries at once.

    Raises:
        SnapshotNotFoundError: no snapshot at either path.
        CorruptSnapshotError: a manifest is damaged, or a blob read for the comparison is
            missing or short.
    """
    options = resolve(None)
    ma = load_manifest(path_a, storage_options, options)
    mb = load_manifest(path_b, storage_options, options)
    a_entries, b_entries = ma.entries, mb.entries
    found: list[tuple[int, Difference]] = []
    to_read: list[tuple[int, str, Entry, Entry]] = []
    for i, (path, a) in enumerate(a_entries.items()):
        b = b_entries.get(path)
        if b is None:
            found.append((i, Difference(path, "only in A", a.tag)))
            continue
        outcome = _compare(path, a, b)
        if isinstance(outcome, Difference):
            found.append((i, outcome))
        elif outcome:
            to_read.append((i, path, a, b))
    n = len(a_entries)
    for j, (path, b) in enumerate(b_entries.items()):
        if path not in a_entries:
            found.append((n + j, Difference(path, "only in B", b.tag)))
    report = DiffReport(path_a, path_b, len(a_entries), len(b_entries), [])
    if to_read:  # the bytes of each ``(index, path, a, b)``, entries of the same size
        size = max(1, min(PIECE_BYTES, max(a.nbytes for _, _, a, _ in to_read)))
        with (
            open_linked(path_a, ma, storage_options, options) as pa,
            open_linked(path_b, mb, storage_options, options) as pb,
        ):

            async def compare(
                item: tuple[int, str, Entry, Entry],
                buffer: memoryview,
                tick: Callable[[int], None],
            ) -> None:
                index, path, a, b = item
                view_a, view_b = buffer[:size], buffer[size:]
                # The bytes as stored: a CRC-32 either side recorded is not checked here.
                read_a = BoxReader(pa, a.locations, path, options, verify=False)
                read_b = BoxReader(pb, b.locations, path, options, verify=False)
                for pos in range(0, a.nbytes, size):
                    n = min(size, a.nbytes - pos)
                    await asyncio.gather(read_a.read(view_a[:n]), read_b.read(view_b[:n]))
                    tick(n)
                    ta, tb = (torch.frombuffer(v[:n], dtype=torch.uint8) for v in (view_a, view_b))
                    if not torch.equal(ta, tb):
                        at = pos + int(torch.ne(ta, tb).nonzero()[0, 0])
                        what = f"contents differ from byte {at:,}"
                        found.append((index, Difference(path, "bytes", what)))
                        tick(a.nbytes - pos - n)
                        break
                report.compared_by_reading += 1

            total = sum(a.nbytes for _, _, a, _ in to_read)
            each(to_read, jobs, 2 * size, total, progress, compare)
    report.differences = [d for _, d in sorted(found, key=lambda x: x[0])]
    return report
