"""``statesnap diff``: how two snapshots differ, entry by entry.

Kinds, dtypes, shapes, container keys and primitive values are compared from the manifests, and
bytes through the recorded CRC-32s; only entries whose CRC-32s were not recorded are read, from
both snapshots, piece by piece. Returns a report and prints nothing; :mod:`snapshot.cli`
formats it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from manifest import (
    DictEntry,
    Entry,
    ListEntry,
    Location,
    ObjectEntry,
    PrimitiveEntry,
    ShardedObjectEntry,
    ShardedTensorEntry,
    TensorEntry,
    TupleEntry,
)
from snapshot._engine.format.manifest_io import load_manifest, open_linked
from snapshot._engine.format.serialization import combine
from snapshot._engine.tools.inspection import (
    JOBS,
    PIECE_BYTES,
    BoxReader,
    Progress,
    Tally,
    each,
    format_shape,
)
from snapshot.options import resolve


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
        return Difference(path, "kind", f"{a.type} -> {other.type}")
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


def _first_difference(a: memoryview, b: memoryview) -> int:
    """The index of the first byte where the equally long ``a`` and ``b`` differ."""
    ta = torch.frombuffer(a, dtype=torch.uint8)
    tb = torch.frombuffer(b, dtype=torch.uint8)
    return int(torch.ne(ta, tb).nonzero()[0, 0])


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
            found.append((i, Difference(path, "only in A", a.type)))
            continue
        outcome = _compare(path, a, b)
        if isinstance(outcome, Difference):
            found.append((i, outcome))
        elif outcome:
            to_read.append((i, path, a, b))
    n = len(a_entries)
    for j, (path, b) in enumerate(b_entries.items()):
        if path not in a_entries:
            found.append((n + j, Difference(path, "only in B", b.type)))
    report = DiffReport(path_a, path_b, len(a_entries), len(b_entries), [])
    if to_read:  # the bytes of each ``(index, path, a, b)``, entries of the same size
        tally = Tally(progress, len(to_read), sum(a.nbytes for _, _, a, _ in to_read))
        size = max(1, min(PIECE_BYTES, max(a.nbytes for _, _, a, _ in to_read)))
        workers = max(1, min(jobs, len(to_read)))
        buffers = [(bytearray(size), bytearray(size)) for _ in range(workers)]
        with (
            open_linked(path_a, ma, storage_options, options) as pa,
            open_linked(path_b, mb, storage_options, options) as pb,
        ):

            async def compare(item: tuple[int, str, Entry, Entry], worker: int) -> None:
                index, path, a, b = item
                buf_a, buf_b = buffers[worker]
                view_a, view_b = memoryview(buf_a), memoryview(buf_b)
                # The bytes as stored: a CRC-32 either side recorded is not checked here.
                read_a = BoxReader(pa, a.locations, path, options, verify=False)
                read_b = BoxReader(pb, b.locations, path, options, verify=False)
                for pos in range(0, a.nbytes, size):
                    n = min(size, a.nbytes - pos)
                    await asyncio.gather(read_a.read(view_a[:n]), read_b.read(view_b[:n]))
                    tally(n)
                    # bytearray equality is a memcmp; slices copy, but only the last piece's.
                    if not (buf_a == buf_b if n == size else buf_a[:n] == buf_b[:n]):
                        at = pos + _first_difference(view_a[:n], view_b[:n])
                        what = f"contents differ from byte {at:,}"
                        found.append((index, Difference(path, "bytes", what)))
                        tally(a.nbytes - pos - n)
                        break
                report.compared_by_reading += 1
                tally(0, 1)

            each(to_read, workers, compare)
    report.differences = [d for _, d in sorted(found, key=lambda x: x[0])]
    return report
