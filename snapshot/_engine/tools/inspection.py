"""Looking into a snapshot without restoring it: what ``statesnap ls / show / du`` compute,
and what ``verify`` and ``diff`` share (``each``, :data:`PIECE_BYTES`, :data:`JOBS`;
``BoxReader``, which export reads with too).

Every function returns data and prints nothing. ``ls`` and ``du`` read only the manifest,
which records every entry's kind, dtype, shape, byte ranges and CRC-32s. ``verify`` and ``diff``
read blobs in pieces of at most :data:`PIECE_BYTES`, a few at a time.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch

from manifest import (
    Entry,
    Location,
    Manifest,
    ObjectEntry,
    PickledTensorEntry,
    PrimitiveEntry,
    ShardedObjectEntry,
    ShardedTensorEntry,
    TensorEntry,
    is_container,
    reference_of,
)
from snapshot._engine.format.serialization import crc32, dtype_name
from snapshot._engine.format.text import printable, unescape
from snapshot._engine.io.storage_calls import call
from snapshot._engine.restore import suggest
from snapshot._engine.runtime import run
from snapshot.errors import ChecksumError, EntryNotFoundError
from snapshot.options import Options
from snapshot.snapshot import Snapshot
from storage_plugins import StoragePlugin

PIECE_BYTES = 16 << 20  # the most bytes ``verify`` and ``diff`` read in one request
JOBS = 4  # blobs (``verify``) or entries (``diff``) read at once by default

Progress = Callable[[int, int, int, int], None]
"""``progress(items_done, items_total, bytes_done, bytes_total)``, called on the I/O thread
after each piece read and each item finished."""

T = TypeVar("T")


def each(
    items: Sequence[T],
    jobs: int,
    buffer_bytes: int,
    nbytes: int,
    progress: Progress | None,
    work: Callable[[T, memoryview, Callable[[int], None]], Awaitable[None]],
) -> None:
    """Runs ``work(item, buffer, tick)`` for every item on the I/O loop, at most ``jobs`` at
    once, each worker with a ``buffer`` of ``buffer_bytes`` of its own. ``tick(n)`` counts
    ``n`` of the ``nbytes`` bytes done; ``progress`` hears of every byte and item done."""
    todo = iter(items)
    done = [0, 0]  # items, bytes

    def tick(n: int, finished: int = 0) -> None:
        done[0] += finished
        done[1] += n
        if progress is not None:
            progress(done[0], len(items), done[1], nbytes)

    async def worker() -> None:
        buffer = memoryview(bytearray(buffer_bytes))
        for item in todo:
            await work(item, buffer, tick)
            tick(0, 1)

    async def main() -> None:
        await asyncio.gather(*(worker() for _ in range(max(1, min(jobs, len(items))))))

    tick(0)
    run(main())


class BoxReader:
    """Reads the bytes of ``chunks``, one after another, front to back: ``read(out)`` fills
    ``out`` with the next ``len(out)``. When ``verify``, each chunk's CRC-32 is checked once all
    of its bytes went by. An exported box's bytes, or an entry's that ``diff`` compares."""

    def __init__(
        self,
        plugin: StoragePlugin,
        chunks: Sequence[Location],
        label: str,
        options: Options,
        verify: bool,
    ) -> None:
        self.plugin = plugin
        self.chunks = chunks
        self.label = label
        self.options = options
        self.verify = verify
        self.chunk = 0  # the chunk being read
        self.inner = 0  # its bytes read
        self.crc = 0  # their CRC-32

    async def read(self, out: memoryview) -> None:
        filled = 0
        while filled < len(out):
            loc = self.chunks[self.chunk]
            n = min(len(out) - filled, loc.nbytes - self.inner)
            piece = out[filled : filled + n]
            # Through restore's ``call``: its retries, deadline and errors.
            read = functools.partial(
                self.plugin.read_into, loc.blob, loc.offset + self.inner, piece
            )
            await call(self.plugin, "read", loc.blob, self.label, read, options=self.options)
            if self.verify and loc.crc32 is not None:
                self.crc = crc32(piece, self.crc)
            filled += n
            self.inner += n
            if self.inner < loc.nbytes:
                continue
            if self.verify and loc.crc32 is not None and self.crc != loc.crc32:
                raise ChecksumError(
                    f"{self.label}: blob {self.plugin.describe(loc.blob)} bytes "
                    f"{loc.offset:,}..{loc.offset + loc.nbytes:,} have CRC-32 {self.crc:#010x}, "
                    f"the snapshot recorded {loc.crc32:#010x}"
                )
            self.chunk, self.inner, self.crc = self.chunk + 1, 0, 0


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


def _shared(entry: Entry) -> bool:
    """Whether an entry is one value for every rank (a sharded tensor's is not, though
    manifests before format 3 marked it so)."""
    return entry.replicated and not isinstance(entry, ShardedTensorEntry)


def _stored_bytes(entries: Iterable[Entry]) -> tuple[int, int]:
    """Bytes the blobs hold for ``entries``, each distinct range once (a compressed one's
    compressed bytes): ``(in the snapshot's own blobs, in its bases' blobs)``."""
    seen: set[tuple[str, int, int]] = set()
    own = in_bases = 0
    for entry in entries:
        for loc in entry.locations:
            key = (loc.blob, loc.offset, loc.nbytes)
            if key not in seen:
                seen.add(key)
                n = loc.nbytes if loc.stored is None else loc.stored.nbytes
                if reference_of(loc.blob) is None:
                    own += n
                else:
                    in_bases += n
    return own, in_bases


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
    base: str  # the base snapshots holding its bytes, joined by commas ("" for none)


@dataclass(frozen=True)
class Listing:
    """The rows of ``ls`` and their totals."""

    rows: list[ListRow]
    tensors: int
    nbytes: int  # the sum of the rows' nbytes
    stored_bytes: int  # what the blobs hold for them, shared ranges counted once
    base_bytes: int  # of ``stored_bytes``, those in bases' blobs (an incremental take)
    bases: tuple[str, ...]  # those bases (``Manifest.bases``)


def list_entries(manifest: Manifest, prefix: str | None = None) -> Listing:
    """Every entry of ``manifest`` (or those at or below the logical path ``prefix``), in the
    order the snapshot was taken. Reads nothing but the manifest.

    Raises:
        EntryNotFoundError: ``prefix`` is given and no entry is at or below it.
    """
    entries = manifest.entries
    items = list(entries.items())
    if prefix:
        prefix = prefix.rstrip("/")
        items = [(p, e) for p, e in items if p == prefix or p.startswith(prefix + "/")]
        if not items:
            hint = _close_matches(entries, prefix)
            raise EntryNotFoundError(f"no entry at or below {prefix!r}{hint}")
    rows = []
    for path, entry in items:
        # A sharded one: its global shape; a pickled one (torchsnapshot's): a tensor too.
        tensor = (TensorEntry, ShardedTensorEntry, PickledTensorEntry)
        shape = entry.shape if isinstance(entry, tensor) else None
        refs = {r[0] for loc in entry.locations if (r := reference_of(loc.blob)) is not None}
        rows.append(
            ListRow(
                path,
                entry.tag,
                _type_name(entry),
                shape,
                entry.nbytes,
                _shared(entry),
                ",".join(sorted(refs)),
            )
        )
    own, in_bases = _stored_bytes(e for _, e in items)
    tensors = sum(r.shape is not None for r in rows)
    nbytes = sum(r.nbytes for r in rows)
    return Listing(rows, tensors, nbytes, own + in_bases, in_bases, manifest.bases)


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
    base_bytes: int  # of ``stored_bytes``, those in bases' blobs (an incremental take)
    bases: tuple[str, ...]  # those bases (``Manifest.bases``)


def disk_usage(manifest: Manifest, progress: Progress | None = None) -> Usage:
    """Bytes per top-level key per rank, from the manifest alone. A replicated entry's bytes,
    stored once, count in every rank's row (restoring the key there reads them), whether the
    manifest lists it under every rank (before format 3) or once under rank 0;
    ``stored_bytes`` counts every distinct byte range once. ``progress(done, total, 0, 0)``
    hears of the manifest's entries counted, every 4096 of them."""
    counts: dict[tuple[str, str], list[int]] = {}  # (rank, key) -> entries, bytes, replicated
    total = len(manifest.entries)
    for i, (path, entry) in enumerate(_as_every_rank_reads(manifest)):
        if progress is not None and not i % 4096:
            progress(min(i, total), total, 0, 0)
        rank, _, rest = path.partition("/")
        slot = counts.setdefault((rank, rest.partition("/")[0]), [0, 0, 0])
        slot[0] += 1
        slot[1] += entry.nbytes
        slot[2] += entry.nbytes if _shared(entry) else 0
    rows = [UsageRow(r, k, n, b, rb) for (r, k), (n, b, rb) in counts.items()]
    rows.sort(key=lambda row: (-row.nbytes, _rank_order(row.rank), row.key))
    ranks: dict[str, int] = {}
    for row in sorted(rows, key=lambda row: _rank_order(row.rank)):
        ranks[row.rank] = ranks.get(row.rank, 0) + row.nbytes
    own, in_bases = _stored_bytes(manifest.entries.values())
    if progress is not None:
        progress(total, total, 0, 0)
    return Usage(
        rows=rows,
        entries=sum(r.entries for r in rows),
        nbytes=sum(r.nbytes for r in rows),
        replicated_bytes=sum(r.replicated_bytes for r in rows),
        stored_bytes=own + in_bases,
        rank_bytes=ranks,
        base_bytes=in_bases,
        bases=manifest.bases,
    )


def _as_every_rank_reads(manifest: Manifest) -> Iterator[tuple[str, Entry]]:
    """Every entry, then each replicated leaf listed once under rank 0 again under every other
    rank that does not list it itself (what ``Manifest.view`` adds), without building views."""
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
    # The ranks that list entries of their own, not every number below ``world_size`` (a claim
    # of the manifest, which may be any number).
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


def _close_matches(entries: Mapping[str, Any], key: str) -> str:
    """``"; close matches: ..."``, naming logical paths resembling ``key`` (the same path under
    rank 0 first, then difflib's closest: ``suggest.close_matches``), or "" for none."""
    found = [f"0/{key}"] if f"0/{key}" in entries else []
    found += [p for p in suggest.close_matches(key, entries, n=5) if p not in found]
    return f"; close matches: {', '.join(map(printable, found[:5]))}" if found else ""


def read_entry(
    path: str, key: str, storage_options: dict[str, Any] | None
) -> tuple[str, Entry, Any]:
    """The logical path at ``key``, given as ``ls`` shows it (control characters escaped) or
    as it is, its manifest entry and its value, read with ``Snapshot.read_object`` (a
    container's value is the whole rebuilt container).

    Raises:
        EntryNotFoundError: no entry ``key``; the message, about ``key`` as it was given, lists
            close matches.
    """
    snap = Snapshot(path, storage_options=storage_options)
    entries = snap.get_manifest()
    found = next((k for k in (key, unescape(key)) if k in entries), None)
    if found is None:
        hint = (
            _close_matches(entries, key)
            or f"; `statesnap ls {path}` lists its {len(entries)} entries"
        )
        raise EntryNotFoundError(f"snapshot {path} has no entry {key!r}{hint}")
    return found, entries[found], snap.read_object(found)


@dataclass(frozen=True)
class TensorSummary:
    """What ``show`` says about a tensor; a statistic the dtype does not allow is None. For
    floating dtypes, min/max/mean are over the finite values, ``nonfinite`` counts the others."""

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
    """``fn()``, or None when torch cannot do it for this dtype."""
    try:
        return fn()
    except Exception:
        return None


def _stats(flat: torch.Tensor) -> tuple[Any, Any, Any, int | None]:
    """(min, max, mean, non-finite count) of a non-empty flat tensor, each None where its dtype
    does not allow it: bool has no mean, complex numbers no order, floating point values are
    summarized over their finite values."""
    dtype = flat.dtype
    if dtype == torch.bool:
        return bool(flat.all()), bool(flat.any()), None, None
    if dtype.is_complex:
        return None, None, _try(lambda: complex(flat.to(torch.complex128).mean().item())), None
    f = _try(lambda: flat.to(torch.float64))
    if f is None:  # through float32 for dtypes that convert to nothing else
        f = _try(lambda: flat.to(torch.float32).to(torch.float64))
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


# ---------------------------------------------------------------------------------------------
# show: values that are not tensors

_SEQUENCES: dict[type, tuple[str, str]] = {
    list: ("[", "]"),
    tuple: ("(", ")"),
    set: ("{", "}"),
    frozenset: ("{", "}"),
}
_DEPTH = 4  # containers nested deeper are shown as their type and length


def brief(value: Any, items: int, chars: int, depth: int = 0) -> str:
    """``repr(value)`` with every container (exactly a list, tuple, set, frozenset or dict)
    of more than ``items`` items cut after ``items`` (``... (N more)``), every str or bytes
    cut after ``chars`` characters (``... (N more characters)``), a tensor written as its dtype,
    shape and first ``items`` values, and any other value's repr cut after ``chars``; equal to
    ``repr(value)`` when nothing is cut (the RNG states of Python, NumPy and torch, long lists
    and strings are shown in a line or two)."""
    kind = type(value)
    inner = min(chars, 100)  # the characters of an item inside a container
    if kind in _SEQUENCES or kind is dict:
        n = len(value)
        if depth >= _DEPTH and n:
            return f"<{kind.__name__} of {n:,} items>"
        if kind is dict:
            shown = [
                f"{brief(k, items, inner, depth + 1)}: {brief(v, items, inner, depth + 1)}"
                for k, v in itertools.islice(value.items(), items)
            ]
            opening, closing = "{", "}"
        else:
            shown = [brief(v, items, inner, depth + 1) for v in itertools.islice(value, items)]
            opening, closing = _SEQUENCES[kind]
            if kind in (set, frozenset) and not n:
                return f"{kind.__name__}()"
        if n > items:
            shown.append(f"... ({n - items:,} more)")
        text = opening + ", ".join(shown) + ("," if kind is tuple and n == 1 else "") + closing
        return f"frozenset({text})" if kind is frozenset else text
    if isinstance(value, torch.Tensor):
        s = summarize_tensor(value, values=items)
        first = ", ".join(map(repr, s.values or []))
        shown_n = len(s.values or [])
        more = f", ... ({s.numel - shown_n:,} more)" if s.numel > shown_n else ""
        return f"tensor(dtype={s.dtype}, shape={format_shape(s.shape)}, [{first}{more}])"
    text = repr(value)
    if len(text) > chars:
        return f"{text[:chars]}... ({len(text) - chars:,} more characters)"
    return text
