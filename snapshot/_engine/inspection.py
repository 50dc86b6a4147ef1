"""Looking into a snapshot without restoring it: what the command line (``statesnap ls / show /
verify / du / diff``) computes.

Every function here returns data and prints nothing; :mod:`snapshot.cli` formats it. ``ls``,
``du`` and most of ``diff`` need only the manifest, which records every entry's kind, dtype,
shape, byte ranges and CRC-32s: they read no blob. ``verify`` reads every blob once, in pieces
of at most :data:`PIECE_BYTES`, a few blobs at a time, and checks each range's CRC-32 by
combining the CRCs of the pieces (no blob is held whole). ``diff`` reads bytes only for entries
whose CRC-32s were not recorded, comparing them piece by piece.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from manifest import (
    DictEntry,
    Entry,
    ListEntry,
    Location,
    Manifest,
    ObjectEntry,
    PickledTensorEntry,
    PrimitiveEntry,
    ShardedObjectEntry,
    ShardedTensorEntry,
    TensorEntry,
    TupleEntry,
    is_container,
)
from snapshot._engine import suggest
from snapshot._engine.checksum import combine
from snapshot._engine.context import gc_paused
from snapshot._engine.operations import load_manifest, read_object
from snapshot._engine.planner import resolve_view
from snapshot._engine.scheduler import call, call_digesting, open_storage, run
from snapshot._engine.serialization import dtype_name
from snapshot._engine.text import printable
from snapshot.errors import EntryNotFoundError, SnapshotError, UnsafeObjectError
from snapshot.metadata import SnapshotMetadata
from snapshot.snapshot import Snapshot
from storage_plugins import StoragePlugin, UnsafeBlobError

PIECE_BYTES = 16 << 20
"""The most bytes ``verify`` and ``diff`` read in one request (per blob being read)."""

JOBS = 4
"""Blobs (``verify``) or entries (``diff``) read at once by default."""

Progress = Callable[[int, int, int, int], None]
"""``progress(items_done, items_total, bytes_done, bytes_total)``: called on the I/O thread as
long operations advance (after each piece read and each item finished)."""

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def human_bytes(n: int) -> str:
    """``n`` bytes for people: ``"512 B"``, ``"10.0 KiB"``, ``"3.4 GiB"`` (powers of 1024)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _UNITS[1:]:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_shape(shape: Sequence[int]) -> str:
    """A tensor shape as the manifest writes it: ``[3, 4]``; ``[]`` for a 0-d tensor."""
    return "[" + ", ".join(map(str, shape)) + "]"


def _type_name(entry: Entry) -> str:
    """What the DTYPE column shows: a tensor's dtype, an object's type, a primitive's type."""
    if isinstance(entry, (TensorEntry, ShardedTensorEntry, PickledTensorEntry)):
        return entry.dtype
    if isinstance(entry, (ObjectEntry, ShardedObjectEntry)):
        return entry.obj_type
    if isinstance(entry, PrimitiveEntry):
        return entry.value_type
    return ""


def _split_path(path: str) -> tuple[str, str]:
    """``"0/model/layer.weight"`` -> ``("0", "model")``: the rank and the app_state key."""
    parts = path.split("/", 2)
    return parts[0], parts[1] if len(parts) > 1 else ""


def _shared(entry: Entry) -> bool:
    """Whether an entry is one value for every rank (replicated). A sharded tensor's entry is
    not, though manifests before format 3 marked it so: each rank keeps its own."""
    return entry.replicated and not isinstance(entry, ShardedTensorEntry)


def _stored_bytes(entries: Iterable[Entry]) -> int:
    """Bytes the blobs hold for ``entries``, each distinct range once (replicated entries of
    several ranks, and tensors stored under two paths, share their ranges)."""
    seen: set[tuple[str, int, int]] = set()
    total = 0
    for entry in entries:
        for loc in entry.locations:
            key = (loc.blob, loc.offset, loc.nbytes)
            if key not in seen:
                seen.add(key)
                total += loc.nbytes
    return total


# ---------------------------------------------------------------------------------------------
# ls


class ListRow(NamedTuple):
    """One entry of the manifest, as ``ls`` shows it."""

    path: str
    kind: str  # tensor / object / primitive / dict / list / tuple
    dtype: str  # a tensor's dtype, an object's or a primitive's type; "" for containers
    shape: tuple[int, ...] | None  # tensors only
    nbytes: int  # bytes in blobs (0 for primitives and containers, which live in the manifest)
    replicated: bool


@dataclass(frozen=True)
class Listing:
    """The rows of ``ls`` and their totals."""

    rows: list[ListRow]
    entries: int
    tensors: int
    nbytes: int  # the sum of the rows' nbytes
    stored_bytes: int  # what the blobs hold for them, shared ranges counted once
    world_size: int
    metadata: SnapshotMetadata  # what ``Snapshot.metadata`` gives (the whole snapshot's)

    @property
    def any_replicated(self) -> bool:
        return any(r.replicated for r in self.rows)


def list_entries(manifest: Manifest, prefix: str | None = None) -> Listing:
    """Every entry of ``manifest`` (or those at or below the logical path ``prefix``), in the
    order the snapshot was taken. Reads nothing but the manifest.

    Raises:
        EntryNotFoundError: ``prefix`` is given and no entry is at or below it.
    """
    with gc_paused():  # 100,000 rows of small objects: no collections while building them
        return _list_entries(manifest, prefix)


def _list_entries(manifest: Manifest, prefix: str | None) -> Listing:
    entries = manifest.entries
    if prefix:
        prefix = prefix.rstrip("/")
        below = prefix + "/"
        items = [(p, e) for p, e in entries.items() if p == prefix or p.startswith(below)]
        if not items:
            close = close_matches(entries, prefix)
            hint = f"; close matches: {', '.join(map(printable, close))}" if close else ""
            raise EntryNotFoundError(f"no entry at or below {prefix!r}{hint}")
    else:
        items = list(entries.items())
    rows = []
    tensors = total = 0
    for path, entry in items:
        # A sharded one: its global shape; a pickled one (torchsnapshot's): a tensor too.
        if isinstance(entry, (TensorEntry, ShardedTensorEntry, PickledTensorEntry)):
            tensors += 1
            shape: tuple[int, ...] | None = entry.shape
        else:
            shape = None
        nbytes = entry.nbytes
        total += nbytes
        rows.append(ListRow(path, entry.type, _type_name(entry), shape, nbytes, _shared(entry)))
    return Listing(
        rows=rows,
        entries=len(rows),
        tensors=tensors,
        nbytes=total,
        stored_bytes=_stored_bytes(e for _, e in items),
        world_size=manifest.world_size,
        metadata=SnapshotMetadata.from_manifest(manifest),
    )


# ---------------------------------------------------------------------------------------------
# du


@dataclass(frozen=True)
class UsageRow:
    """The bytes of one app_state key on one rank."""

    rank: str
    key: str
    entries: int
    nbytes: int  # what restoring this key on this rank reads
    replicated_bytes: int  # of which in replicated entries (stored once for all ranks)


@dataclass(frozen=True)
class Usage:
    """``du``: bytes per (rank, key), largest first, and the totals."""

    rows: list[UsageRow]
    entries: int  # as the ranks read them: a leaf listed once for every rank counts per rank
    nbytes: int  # the sum of those entries' nbytes (= the sum of the rows' nbytes)
    replicated_bytes: int
    stored_bytes: int  # what the blobs hold: replicated and shared ranges counted once
    rank_bytes: dict[str, int]  # rank -> the sum of its rows' nbytes
    world_size: int


def disk_usage(manifest: Manifest) -> Usage:
    """Bytes per top-level key per rank, from the manifest alone.

    A replicated entry is one value for every rank that took it, its bytes stored once (by
    whichever rank wrote them): each rank's row counts them (restoring that key on that rank
    reads them), whether the manifest lists the entry under every rank (before format 3) or
    once, under rank 0 (``Manifest.view``), and says how many of its bytes are replicated;
    ``stored_bytes`` counts every distinct byte range once.
    """
    with gc_paused():
        return _disk_usage(manifest)


def _disk_usage(manifest: Manifest) -> Usage:
    counts: dict[tuple[str, str], list[int]] = {}
    ranks: dict[str, int] = {}
    total = replicated = count = 0
    for path, entry in _as_every_rank_reads(manifest):
        count += 1
        rank_key = _split_path(path)
        slot = counts.get(rank_key)
        if slot is None:
            slot = counts[rank_key] = [0, 0, 0]
        nbytes = entry.nbytes
        slot[0] += 1
        slot[1] += nbytes
        total += nbytes
        if _shared(entry):
            slot[2] += nbytes
            replicated += nbytes
        ranks[rank_key[0]] = ranks.get(rank_key[0], 0) + nbytes
    rows = [UsageRow(r, k, n, b, rb) for (r, k), (n, b, rb) in counts.items()]
    rows.sort(key=lambda row: (-row.nbytes, _rank_order(row.rank), row.key))
    return Usage(
        rows=rows,
        entries=count,
        nbytes=total,
        replicated_bytes=replicated,
        stored_bytes=_stored_bytes(manifest.entries.values()),
        rank_bytes=dict(sorted(ranks.items(), key=lambda kv: _rank_order(kv[0]))),
        world_size=manifest.world_size,
    )


def _as_every_rank_reads(manifest: Manifest) -> Iterator[tuple[str, Entry]]:
    """Every entry, then each replicated leaf listed once, under rank 0, again under every
    other rank of the take that does not list it itself (what ``Manifest.view`` adds for that
    rank), without building each rank's view."""
    entries = manifest.entries
    yield from entries.items()
    if manifest.world_size == 1:
        return
    once = [
        (p[2:], e)
        for p, e in entries.items()
        if p.startswith("0/") and _shared(e) and not is_container(e)
    ]
    if not once:
        return
    # The ranks that list entries of their own (each rank of a take lists its containers), not
    # every number below ``world_size``: that is a claim of the manifest, which may be any
    # number, where the ranks listed are bounded by its lines.
    listed = {p.partition("/")[0] for p in entries}
    ranks = sorted(
        int(r) for r in listed if r.isdigit() and len(r) < 19 and 0 < int(r) < manifest.world_size
    )
    for rank in ranks:
        prefix = f"{rank}/"
        for rest, e in once:
            if prefix + rest not in entries:
                yield prefix + rest, e


def _rank_order(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 62, rank)


# ---------------------------------------------------------------------------------------------
# show


def close_matches(entries: Sequence[str] | dict[str, Any], key: str, n: int = 5) -> list[str]:
    """Logical paths resembling ``key``: the same path under rank 0 (``model/w`` ->
    ``0/model/w``) first, then difflib's closest (``suggest.close_matches``: bounded)."""
    paths = list(entries)
    found = [f"0/{key}"] if f"0/{key}" in entries else []
    for p in suggest.close_matches(key, paths, n=n, cutoff=0.6):
        if p not in found:
            found.append(p)
    return found[:n]


def read_entry(path: str, key: str, storage_options: dict[str, Any] | None) -> tuple[Entry, Any]:
    """The manifest entry at logical path ``key`` and its value, read with
    ``Snapshot.read_object`` (a container's value is the whole rebuilt container).

    Raises:
        EntryNotFoundError: no entry ``key``; the message lists close matches.
    """
    snap = Snapshot(path, storage_options=storage_options)
    entries = snap.get_manifest()
    entry = entries.get(key)
    if entry is None:
        close = close_matches(entries, key)
        hint = (
            f"; close matches: {', '.join(map(printable, close))}"
            if close
            else f"; `statesnap ls {path}` lists its {len(entries)} entries"
        )
        raise EntryNotFoundError(f"snapshot {path} has no entry {key!r}{hint}")
    return entry, snap.read_object(key)


@dataclass(frozen=True)
class TensorSummary:
    """What ``show`` says about a tensor. A statistic the dtype does not allow (the mean of a
    bool tensor, the min of a complex one, anything of a sub-byte or quantized dtype) is None.
    For floating dtypes, min/max/mean are over the finite values, and ``nonfinite`` counts the
    others (NaN, +-inf)."""

    dtype: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    min: Any
    max: Any
    mean: Any
    nonfinite: int | None
    values: list[Any] | None  # the first few elements in row-major order (None: not readable)


def _try(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when torch cannot do it for this dtype (each dtype supports its own
    set of operations, and says so with any of several exceptions)."""
    try:
        return fn()
    except Exception:
        return None


def _as_float64(flat: torch.Tensor) -> torch.Tensor | None:
    """``flat`` in float64, through float32 for dtypes that convert to nothing else."""
    t = _try(lambda: flat.to(torch.float64))
    if t is None:
        t = _try(lambda: flat.to(torch.float32).to(torch.float64))
    return t


def _stats(flat: torch.Tensor) -> tuple[Any, Any, Any, int | None]:
    """(min, max, mean, non-finite count) of a non-empty flat tensor, each None where its dtype
    does not allow it: bool has no mean, complex numbers no order, floating point values are
    summarized over their finite values."""
    dtype = flat.dtype
    if dtype == torch.bool:
        return bool(flat.all()), bool(flat.any()), None, None
    if dtype.is_complex:
        return None, None, _try(lambda: complex(flat.to(torch.complex128).mean().item())), None
    f = _as_float64(flat)
    if dtype.is_floating_point:
        if f is None:
            return None, None, None, None
        finite = f[torch.isfinite(f)]
        if not finite.numel():
            return None, None, None, f.numel()
        return (
            finite.min().item(),
            finite.max().item(),
            finite.mean().item(),
            f.numel() - finite.numel(),
        )
    lo, hi = _try(lambda: flat.min().item()), _try(lambda: flat.max().item())
    if (lo is None or hi is None) and flat.element_size() < 8:
        # Unsigned dtypes without min/max kernels (uint16, uint32) fit in int64; uint64 not.
        wide = _try(lambda: flat.to(torch.int64))
        if wide is not None:
            lo, hi = wide.min().item(), wide.max().item()
    return lo, hi, (f.mean().item() if f is not None else None), None


def summarize_tensor(t: torch.Tensor, values: int = 8) -> TensorSummary:
    """Dtype, shape, size, min / max / mean where ``t``'s dtype allows them, and the first
    ``values`` elements; never raises for an unusual dtype (the statistic is None instead)."""
    t = t.detach()
    numel = t.numel()
    # A quantized tensor is summarized by the values it stands for.
    data = _try(t.dequantize) if _try(lambda: t.is_quantized) else t
    flat = _try(lambda: data.reshape(-1)) if data is not None else None
    stats = None
    if flat is not None and numel > 0:
        stats = _try(lambda: _stats(flat))
    lo, hi, mean, nonfinite = stats or (None, None, None, None)
    first = None
    if flat is not None:
        first = _try(lambda: flat[:values].tolist())
        if first is None:
            first = _try(lambda: flat[:values].to(torch.float32).tolist())
    return TensorSummary(
        dtype=dtype_name(t.dtype),
        shape=tuple(t.shape),
        numel=numel,
        nbytes=_try(lambda: numel * t.element_size()) or 0,
        min=lo,
        max=hi,
        mean=mean,
        nonfinite=nonfinite,
        values=first,
    )


@dataclass(frozen=True)
class ValueSummary:
    """What ``show`` says about a value that is not a tensor: its type, length (containers,
    str, bytes) and repr, cut at ``max_chars``."""

    type_name: str
    length: int | None
    text: str
    omitted_chars: int  # how much of the repr was cut (0: none)


def summarize_value(value: Any, max_chars: int = 2000) -> ValueSummary:
    """``value``'s type and repr, the repr cut after ``max_chars`` characters."""
    text = repr(value)
    omitted = max(0, len(text) - max_chars)
    if omitted:
        text = text[:max_chars]
    length = len(value) if isinstance(value, (dict, list, tuple, set, str, bytes)) else None
    cls = type(value)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"
    return ValueSummary(type_name=name, length=length, text=text, omitted_chars=omitted)


# ---------------------------------------------------------------------------------------------
# verify


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

    where: str
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
            key = (loc.offset, loc.nbytes, loc.crc32)
            r = ranges.get(key)
            if r is None:
                ranges[key] = _Range(loc.offset, loc.nbytes, loc.crc32, [path])
            elif r.paths[-1] != path:
                r.paths.append(path)
    return {
        blob: sorted(ranges.values(), key=lambda r: (r.offset, r.nbytes))
        for blob, ranges in sorted(found.items())
    }


class _BlobCheck:
    """Reads one blob in pieces and checks its size and every range's CRC-32."""

    def __init__(
        self,
        plugin: StoragePlugin,
        blob: str,
        expected: int,
        ranges: list[_Range],
        report: VerifyReport,
        tick: Callable[[int], None],
    ) -> None:
        self.plugin = plugin
        self.blob = blob
        self.expected = expected
        self.ranges = ranges
        self.report = report
        self.tick = tick
        self.label = ranges[0].paths[0] if ranges else blob
        self.read_failure = ""  # why the read stopped short, when it did

    def _problem(self, start: int, end: int, paths: Sequence[str], what: str) -> None:
        self.report.problems.append(Problem(self.blob, start, end, tuple(paths), what))

    async def _call(self, op: Callable[[], Any]) -> Any:
        # Transient errors are retried; the plugin's own error comes out at the end.
        return await call(self.plugin, "read", self.blob, self.label, op, convert=False)

    async def run(self, buffer: memoryview, piece_bytes: int) -> None:
        blob, expected, plugin = self.blob, self.expected, self.plugin
        failure: str | None = None
        limit = expected
        try:
            size = await self._call(lambda: plugin.size(blob))
            if size is None and expected == 0 and not await self._call(lambda: plugin.exists(blob)):
                raise FileNotFoundError(blob)
        except FileNotFoundError:
            self._fail_all("the blob is missing")
            return
        except UnsafeBlobError as e:
            self._fail_all(f"refused, not read: {e}")
            return
        except Exception as e:
            self._fail_all(f"cannot get the blob's size: {type(e).__name__}: {e}")
            return
        if size is None:
            self.report.sizes_unknown.append(blob)
        elif size > expected:
            self._problem(
                expected,
                size,
                (),
                f"the blob is {size:,} bytes, {size - expected:,} more than the manifest "
                f"records ({expected:,}): bytes were added after the take, or the blob was "
                "replaced",
            )
        elif size < expected:
            self._problem(
                size,
                expected,
                (),
                f"the blob is {size:,} bytes, {expected - size:,} fewer than the manifest "
                f"records ({expected:,}): it was cut short",
            )
            limit = size
            failure = f"cut off: the blob ends at byte {size:,}"
        pos = await self._read(buffer, piece_bytes, limit)
        if pos < limit:
            failure = self.read_failure
        self._finish(pos, failure)

    async def _read(self, buffer: memoryview, piece_bytes: int, limit: int) -> int:
        """Reads ``[0, limit)`` piece by piece, adding to each range's CRC; returns how far it
        got (short of ``limit`` on an error, described then in ``read_failure``)."""
        ranges = self.ranges
        first = 0  # ranges before this one end before the current piece
        pos = 0
        while pos < limit:
            n = min(piece_bytes, limit - pos)
            end = pos + n
            while first < len(ranges) and ranges[first].end <= pos:
                first += 1
            touched: list[_Range] = []
            for r in ranges[first:]:
                if r.offset >= end:
                    break
                if r.end > pos and r.nbytes:
                    touched.append(r)
            try:
                await self._read_piece(pos, buffer[:n], touched)
            except FileNotFoundError:
                self.read_failure = "the blob is missing"
                return pos
            except EOFError as e:
                self.read_failure = f"the blob ends before this range does ({e})"
                return pos
            except Exception as e:
                self.read_failure = f"cannot read: {type(e).__name__}: {e}"
                return pos
            pos = end
            self.report.bytes_read += n
            self.tick(n)
        return pos

    async def _read_piece(self, start: int, out: memoryview, touched: list[_Range]) -> None:
        """Reads one piece into ``out``, adding the CRC of each touched range's part of it to
        the range's (when the range has a CRC to check)."""
        blob, plugin = self.blob, self.plugin
        if not any(r.crc32 is not None for r in touched):
            await self._call(lambda: plugin.read_into(blob, start, out))
            return
        end = start + len(out)
        parts = [(max(r.offset, start), min(r.end, end)) for r in touched]
        values = await call_digesting(
            plugin,
            "read",
            blob,
            self.label,
            [(lo - start, hi - lo) for lo, hi in parts],
            lambda digest: plugin.readv_observed(blob, start, [out], digest),
            convert=False,  # the plugin's own errors: _read tells them apart
        )
        for r, (lo, hi), value in zip(touched, parts, values, strict=True):
            r.value = combine(r.value, value, hi - lo)

    def _fail_all(self, what: str) -> None:
        """Every range of the blob is bad, for reason ``what``."""
        for r in self.ranges:
            self._problem(r.offset, r.end, r.paths, what)

    def _finish(self, pos: int, failure: str | None) -> None:
        report = self.report
        for r in self.ranges:
            if r.end > pos:
                self._problem(r.offset, r.end, r.paths, failure or "not read")
                continue
            if r.crc32 is None:
                report.checksums_missing += 1
                continue
            report.checksums_checked += 1
            if r.value != r.crc32:
                self._problem(
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
) -> VerifyReport:
    """Reads every blob of the snapshot at ``path`` and checks it against the manifest: each
    blob's length (when the store can tell it) and each byte range's CRC-32 (when the snapshot
    recorded one); a pickle without a CRC-32 (a torchsnapshot snapshot records none) is read
    again and decoded by the safe loader. Finds every problem, not just the first.

    At most ``jobs`` blobs are read at once, each in pieces of at most ``piece_bytes``, so
    memory stays within ``jobs * piece_bytes`` whatever the blob sizes.

    Raises:
        SnapshotNotFoundError: no snapshot at ``path``.
        CorruptSnapshotError: the manifest itself is damaged (``ChecksumError``) or undecodable.
    """
    if jobs < 1 or piece_bytes < 1:
        raise ValueError(f"jobs and piece_bytes must be positive, got {jobs}, {piece_bytes}")
    manifest = load_manifest(path, storage_options)
    with gc_paused():
        by_blob = _ranges_by_blob(manifest)
    sizes = manifest.blob_sizes
    report = VerifyReport(where=path, entries=len(manifest.entries), blobs=len(by_blob))
    report.ranges = sum(len(r) for r in by_blob.values())
    total_bytes = sum(sizes.values())
    done = [0, 0]  # blobs, bytes

    def tick(nbytes: int, blobs: int = 0) -> None:
        done[0] += blobs
        done[1] += nbytes
        if progress is not None:
            progress(done[0], len(by_blob), done[1], total_bytes)

    async def check_all(plugin: StoragePlugin) -> None:
        work = iter(by_blob.items())
        largest = max(sizes.values(), default=0)

        async def worker() -> None:
            buffer = memoryview(bytearray(max(1, min(piece_bytes, largest))))
            for blob, ranges in work:
                check = _BlobCheck(plugin, blob, sizes[blob], ranges, report, tick)
                await check.run(buffer, piece_bytes)
                tick(0, 1)

        await asyncio.gather(*(worker() for _ in range(min(jobs, len(by_blob)))))

    if progress is not None:
        progress(0, len(by_blob), 0, total_bytes)
    with open_storage(path, storage_options) as plugin:
        run(check_all(plugin))
    if manifest.metadata.get("format") == "torchsnapshot":
        report.foreign = str(manifest.metadata.get("library", "torchsnapshot"))
    _decode_unchecked(manifest, path, storage_options, report)
    _check_views(manifest, report)
    # Per blob: its own problems (length) first, then its entries' by offset.
    report.problems.sort(key=lambda p: (p.blob, bool(p.paths), p.start, p.end, p.paths))
    report.sizes_unknown.sort()
    return report


def _check_views(manifest: Manifest, report: VerifyReport) -> None:
    """Reports each tensor entry recorded as a view of another's storage whose base a read
    would refuse (``planner.resolve_view``): its bytes may be sound, but a read that builds new
    tensors fails on it. Each is checked under the rank it is listed under (one look-up per
    view: a view listed once for every rank is checked as rank 0 reads it)."""
    entries = manifest.entries
    for key, entry in entries.items():
        if type(entry) is not TensorEntry or entry.view is None:
            continue
        try:
            resolve_view(entries, key, entry)
        except SnapshotError as e:
            report.problems.append(
                _entry_problem(key, entry.chunks, f"a view that a read refuses: {e}")
            )


def _entry_problem(key: str, locations: Sequence[Location], what: str) -> Problem:
    """A problem of entry ``key`` as a whole, placed at its first stored range."""
    first = locations[0] if locations else Location(blob="", offset=0, nbytes=0)
    return Problem(first.blob, first.offset, first.offset + first.nbytes, (key,), what)


def _decode_unchecked(
    manifest: Manifest, path: str, storage_options: dict[str, Any] | None, report: VerifyReport
) -> None:
    """Decodes, with the safe loader, each pickle that has no recorded CRC-32 (every one of a
    torchsnapshot snapshot, or of one taken with checksums off) and whose blob showed no
    problem: without a checksum, decoding is the only check of those bytes. Each is read once
    (a replicated entry's copies under other ranks share its bytes); one that needs a type the
    loader does not allow is named in ``not_decoded``, not counted as damage."""
    damaged = {p for problem in report.problems for p in problem.paths}
    seen: set[tuple[tuple[str, int, int], ...]] = set()
    for key, entry in manifest.entries.items():
        pickled = isinstance(entry, PickledTensorEntry) or (
            isinstance(entry, (ObjectEntry, ShardedObjectEntry))
            and entry.serializer == "torch_save"
        )
        locations = entry.locations
        if not pickled or key in damaged or any(loc.crc32 is not None for loc in locations):
            continue
        ranges = tuple((loc.blob, loc.offset, loc.nbytes) for loc in locations)
        if ranges in seen:
            continue
        seen.add(ranges)
        try:
            read_object(manifest, key, None, None, path=path, storage_options=storage_options)
        except UnsafeObjectError:
            report.not_decoded.append(key)
        except SnapshotError as e:
            report.problems.append(_entry_problem(key, locations, f"cannot be decoded: {e}"))
        else:
            report.decoded += 1


# ---------------------------------------------------------------------------------------------
# diff


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
    compared_by_crc: int = 0  # entries whose bytes were compared through recorded CRC-32s
    compared_by_reading: int = 0  # entries whose bytes had to be read and compared
    bytes_read: int = 0  # per side

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


def _compare(path: str, a: Entry, b: Entry) -> Difference | bool:
    """A difference seen in the manifests, else whether the bytes must be read to tell
    (False: the entries are the same)."""
    if type(a) is not type(b):
        return Difference(path, "kind", f"{a.type} -> {b.type}")
    if isinstance(a, TensorEntry):
        assert isinstance(b, TensorEntry)
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
        assert isinstance(b, ShardedTensorEntry)
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
        assert isinstance(b, (ObjectEntry, ShardedObjectEntry))
        if (a.obj_type, a.serializer) != (b.obj_type, b.serializer):
            return Difference(path, "type", f"{a.obj_type} -> {b.obj_type}")
    elif isinstance(a, PrimitiveEntry):
        assert isinstance(b, PrimitiveEntry)
        # repr tells 1 from True and 1.0, -0.0 from 0.0, and finds nan equal to nan.
        if (a.value_type, repr(a.value)) != (b.value_type, repr(b.value)):
            return Difference(
                path, "value", f"{_primitive_text(a.value)} -> {_primitive_text(b.value)}"
            )
        return False
    elif isinstance(a, DictEntry):
        assert isinstance(b, DictEntry)
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
        assert isinstance(b, (ListEntry, TupleEntry))
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


def _first_difference(a: memoryview, b: memoryview) -> int:
    """The index of the first byte where the equally long ``a`` and ``b`` differ."""
    ta = torch.frombuffer(a, dtype=torch.uint8)
    tb = torch.frombuffer(b, dtype=torch.uint8)
    return int(torch.ne(ta, tb).nonzero()[0, 0])


async def _read_window(
    plugin: StoragePlugin, label: str, locations: Sequence[Location], pos: int, out: memoryview
) -> None:
    """Fills ``out`` with the bytes ``[pos, pos + len(out))`` of the concatenation of
    ``locations``."""
    base = 0
    filled = 0
    end = pos + len(out)
    for loc in locations:
        lo, hi = max(pos, base), min(end, base + loc.nbytes)
        if hi > lo:
            dest = out[filled : filled + hi - lo]
            offset = loc.offset + lo - base
            await call(
                plugin,
                "read",
                loc.blob,
                label,
                lambda b=loc.blob, o=offset, d=dest: plugin.read_into(b, o, d),
            )
            filled += hi - lo
        base += loc.nbytes
        if base >= end:
            break


def diff(
    path_a: str,
    path_b: str,
    storage_options: dict[str, Any] | None,
    *,
    jobs: int = JOBS,
    piece_bytes: int = PIECE_BYTES,
    progress: Progress | None = None,
) -> DiffReport:
    """How the snapshots at ``path_a`` and ``path_b`` differ, entry by entry.

    Kinds, dtypes, shapes, container keys and primitive values come from the manifests; bytes
    are compared through the entries' recorded CRC-32s (combined over chunks, so chunking does
    not matter). Only entries whose CRC-32s are missing on either side are read, from both
    snapshots, ``piece_bytes`` at a time, ``jobs`` entries at once.

    Raises:
        SnapshotNotFoundError: no snapshot at either path.
        CorruptSnapshotError: a manifest is damaged, or a blob read for the comparison is
            missing or short.
    """
    if jobs < 1 or piece_bytes < 1:
        raise ValueError(f"jobs and piece_bytes must be positive, got {jobs}, {piece_bytes}")
    ma = load_manifest(path_a, storage_options)
    mb = load_manifest(path_b, storage_options)
    a_entries, b_entries = ma.entries, mb.entries
    found: list[tuple[int, Difference]] = []
    to_read: list[tuple[int, str, Entry, Entry]] = []
    by_crc = 0
    for i, (path, a) in enumerate(a_entries.items()):
        b = b_entries.get(path)
        if b is None:
            found.append((i, Difference(path, "only in A", a.type)))
            continue
        outcome = _compare(path, a, b)
        if isinstance(outcome, Difference):
            found.append((i, outcome))
        elif outcome:
            to_read.append((i, path, a, b))
        elif a.locations:
            by_crc += 1
    n = len(a_entries)
    for j, (path, b) in enumerate(b_entries.items()):
        if path not in a_entries:
            found.append((n + j, Difference(path, "only in B", b.type)))
    report = DiffReport(path_a, path_b, len(a_entries), len(b_entries), [], by_crc)
    if to_read:
        found.extend(_compare_bytes(report, to_read, storage_options, jobs, piece_bytes, progress))
    report.differences = [d for _, d in sorted(found, key=lambda x: x[0])]
    return report


def _compare_bytes(
    report: DiffReport,
    to_read: list[tuple[int, str, Entry, Entry]],
    storage_options: dict[str, Any] | None,
    jobs: int,
    piece_bytes: int,
    progress: Progress | None,
) -> list[tuple[int, Difference]]:
    """Reads and compares the bytes of each ``(index, path, a, b)``, entries of the same size."""
    total_bytes = sum(a.nbytes for _, _, a, _ in to_read)
    largest = max(a.nbytes for _, _, a, _ in to_read)
    done = [0, 0]
    found: list[tuple[int, Difference]] = []

    def tick(nbytes: int, items: int = 0) -> None:
        done[0] += items
        done[1] += nbytes
        if progress is not None:
            progress(done[0], len(to_read), done[1], total_bytes)

    async def compare_all(pa: StoragePlugin, pb: StoragePlugin) -> None:
        work = iter(to_read)

        async def worker() -> None:
            size = max(1, min(piece_bytes, largest))
            buf_a, buf_b = bytearray(size), bytearray(size)
            view_a, view_b = memoryview(buf_a), memoryview(buf_b)
            for index, path, a, b in work:
                pos = 0
                while pos < a.nbytes:
                    n = min(size, a.nbytes - pos)
                    await asyncio.gather(
                        _read_window(pa, path, a.locations, pos, view_a[:n]),
                        _read_window(pb, path, b.locations, pos, view_b[:n]),
                    )
                    report.bytes_read += n
                    tick(n)
                    # bytearray equality is a memcmp; slices copy, but only the last piece's.
                    same = buf_a == buf_b if n == size else buf_a[:n] == buf_b[:n]
                    if not same:
                        at = pos + _first_difference(view_a[:n], view_b[:n])
                        found.append(
                            (index, Difference(path, "bytes", f"contents differ from byte {at:,}"))
                        )
                        tick(a.nbytes - pos - n)
                        break
                    pos += n
                report.compared_by_reading += 1
                tick(0, 1)

        await asyncio.gather(*(worker() for _ in range(min(jobs, len(to_read)))))

    if progress is not None:
        progress(0, len(to_read), 0, total_bytes)
    with (
        open_storage(report.path_a, storage_options) as pa,
        open_storage(report.path_b, storage_options) as pb,
    ):
        run(compare_all(pa, pb))
    return found
