"""The take planner: from state dicts to a ``TakePlan`` (the write requests of a take and the
drafts of its manifest entries), without any I/O.

``collect`` flattens the state dicts into entries and byte payloads, each leaf by the handler of
its kind; ``place`` packs the payloads into blobs (``Placer``), one ``WriteRequest`` per blob.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

import manifest as mf
from manifest import (
    Entry,
    EntryFormatter,
    ShardedObjectEntry,
    ShardedTensorEntry,
    TensorEntry,
    TensorView,
)
from snapshot._engine.handlers import sharded
from snapshot._engine.handlers.table import (
    ALIGN,
    Draft,
    Layout,
    Made,
    Payload,
    Planned,
    PrepareFunc,
    TensorDraft,
    WholeTensor,
    by_value_type,
    crc,
    for_value,
)
from snapshot._engine.io import device
from snapshot._engine.io.pipeline import WriteRequest
from snapshot._engine.io.staging import Slab, StagingPool, write_request
from snapshot._engine.state_dicts import flatten

if TYPE_CHECKING:
    from snapshot._engine.take.incremental import Reuse

# What placed blobs are staged through: an async take's staging pool (every payload copied into
# pooled buffers), or None (from the payloads' own memory).
Stager = StagingPool | None

# ---------------------------------------------------------------------------------------------
# Placement.


class Placer:
    """Gives payloads their blobs under one name prefix (``<rank>/``, or ``<writer>/r`` for
    replicated payloads; the take's id is inserted after the rank's folder: ``0/1f2e3d4c-s0``),
    and makes the write of each complete blob when ``mine``."""

    def __init__(self, prefix: str, layout: Layout, mine: bool, stager: Stager) -> None:
        if layout.take_id:
            folder, _, rest = prefix.rpartition("/")
            prefix = f"{folder}/{layout.take_id}-{rest}" if folder else f"{layout.take_id}-{rest}"
        self.prefix = prefix
        self.threshold = layout.slab_threshold_bytes
        self.slab_bytes = layout.slab_bytes
        self.checksums = layout.checksums
        self.level = layout.zstd_level
        self.mine = mine
        self.stager = stager
        self.writes: list[WriteRequest] = []
        self._count = itertools.count()  # numbers the blobs
        self._slab: Slab | None = None

    def place(self, p: Payload) -> None:
        """In the open slab when small, else in a blob of its own."""
        nbytes = p.nbytes
        open_slab = self._slab
        if nbytes > self.threshold:
            slab, pos = Slab(f"{self.prefix}{next(self._count)}", alone=True), 0
        elif open_slab is None or open_slab.nbytes + -open_slab.nbytes % ALIGN + nbytes > (
            self.slab_bytes
        ):
            self.close()
            slab = self._slab = Slab(f"{self.prefix}s{next(self._count)}")
            pos = 0
        else:
            slab, pos = open_slab, open_slab.nbytes + -open_slab.nbytes % ALIGN
        slab.members.append(p)
        p.blob, p.pos = slab.blob, pos
        slab.nbytes = pos + nbytes
        source = p.source
        if source is not None:
            if self.stager is not None and device.cuda_index(source.tensor) is not None:
                slab.from_device = True  # its pooled buffer is pinned
            if self.mine:
                source.remaining += 1
        if slab.alone and self.mine:
            self.writes.append(write_request(slab, self.stager, self.checksums, self.level))

    def close(self) -> None:
        """Makes the write of the open slab."""
        slab, self._slab = self._slab, None
        if slab is not None and self.mine:
            self.writes.append(write_request(slab, self.stager, self.checksums, self.level))


def place(
    collected: Collected,
    *,
    rank: int,
    layout: Layout,
    writer_of: Mapping[tuple[str, int], int],
    stager: Stager,
    own: Placer | None = None,
) -> TakePlan:
    """The plan: this rank's own writes (placed by ``own`` when ``replication.settle`` did so)
    and those of the replicated payloads it writes. Each replicated payload is written once, by
    ``writer_of[(logical, index)]``, into ``<writer>/r...`` blobs: every rank places them all
    alike (sorted, with the agreed ``layout``), so every rank knows every location.
    """
    if own is None:
        own = Placer(f"{rank}/", layout, mine=True, stager=stager)
        for p in collected.payloads:
            own.place(p)
        own.close()
    replicated: dict[int, list[Payload]] = {}
    for p in collected.replicated:
        replicated.setdefault(writer_of[(p.logical, p.index)], []).append(p)
    writes = list(own.writes)
    for writer in sorted(replicated):
        shared = Placer(f"{writer}/r", layout, mine=writer == rank, stager=stager)
        for p in sorted(replicated[writer], key=lambda q: (q.logical, q.index)):
            shared.place(p)
        shared.close()
        writes.extend(shared.writes)
    mine = replicated.get(rank, [])
    return TakePlan(collected, writes, mine, layout.checksums, layout.zstd_level > 0)


# ---------------------------------------------------------------------------------------------
# Planning.


@dataclass
class Collected:
    """A rank's state, flattened: entries (or drafts) in flatten order; its own payloads and the
    replicated ones, in the order met; by path, whether a tensor was an ``nn.Parameter`` and
    required grad, the view of another leaf it is (and that leaf's draft), its digest."""

    entries: dict[str, Planned] = field(default_factory=dict)
    payloads: list[Payload] = field(default_factory=list)
    replicated: list[Payload] = field(default_factory=list)
    own_bytes: int = 0  # of ``payloads`` (across ranks: set by the take, then by ``settle``)
    # (key, dtype, global shape, offsets, sizes, main, path) of each piece of a global tensor
    pieces: list[tuple[Any, ...]] = field(default_factory=list)
    # (unique key, main, path) of each sharded object
    objects: list[tuple[str, bool, str]] = field(default_factory=list)
    grads: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    views: dict[str, tuple[TensorView, Draft]] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)


class Collector:
    """What the handlers' ``take(planner, path, logical, value, replicated)`` is given:
    ``prepare``, ``chunk_bytes`` (above which a tensor is split), ``inline_max`` (the largest str
    or bytes kept in the manifest), ``out`` (the ``Collected`` they record into), ``written``
    (tensor drafts by memory: tied tensors), ``views_possible``, ``emit`` and ``leaf``."""

    def __init__(
        self,
        prepare: PrepareFunc | None,
        inline_max_bytes: int,
        chunk_bytes: int,
        reuse: Reuse | None = None,
    ) -> None:
        self.prepare = prepare
        self.inline_max = inline_max_bytes
        self.chunk_bytes = chunk_bytes
        self.reuse = reuse
        self.out = Collected()
        self.written: dict[int | tuple[Any, ...], Draft] = {}
        self.views_possible = False

    def emit(self, payloads: list[Payload]) -> None:
        """Records one value's payloads (all replicated, or all this rank's own)."""
        if payloads[0].replicated:
            self.out.replicated += payloads
        else:
            self.out.payloads += payloads

    def leaf(self, path: str, logical: str, value: Any, replicated: bool) -> Planned:
        """The entry (or draft) of one leaf, by its kind (``handlers.for_value``)."""
        return for_value(value).take(self, path, logical, value, replicated)


def collect(
    states: Iterable[tuple[str, Any]],
    *,
    rank: int,
    prepare: PrepareFunc | None,
    replicated: Sequence[str],
    inline_max_bytes: int,
    chunk_bytes: int,
    reuse: Reuse | None = None,
) -> Collected:
    """Flattens ``(key_path, state_dict)`` pairs of process ``rank`` into entries (at
    ``"<rank>/<key_path>/..."``) and payloads. ``prepare`` and the ``replicated`` globs see the
    path without the rank; only leaves, never containers, are stored once for every rank.
    """
    collector = Collector(prepare, inline_max_bytes, chunk_bytes, reuse)
    entries = collector.out.entries
    prefix = f"{rank}/"
    cut = len(prefix)
    globs = tuple(replicated)
    for key_path, state in states:
        for path, node, value in flatten(state, prefix + key_path):
            if node is not None:
                entries[path] = node
                continue
            logical = path[cut:]
            shared = bool(globs) and any(fnmatch.fnmatchcase(logical, g) for g in globs)
            kind = by_value_type.get(type(value))  # ``for_value``, its lookup inline
            if kind is None or not kind.accepts(value):
                kind = for_value(value)
            entries[path] = kind.take(collector, path, logical, value, shared)
    if reuse is not None:
        collector.out.digests = reuse.digests
    if prepare is None and collector.views_possible:
        drafts = [(p, d) for p, d in entries.items() if isinstance(d, (WholeTensor, TensorDraft))]
        collector.out.views = relate(drafts, prefix)
    return collector.out


def relate(
    drafts: Iterable[tuple[str, Draft]], rank_prefix: str
) -> dict[str, tuple[TensorView, Draft]]:
    """Each CPU tensor leaf of ``drafts`` whose elements lie within the memory of a contiguous
    leaf of its storage and dtype, as a view of that leaf, with its draft: a restore into new
    tensors then makes one storage of them, as ``torch.load`` does. Tied leaves (sharing their
    payloads) and negated or conjugate tensors get no view."""
    cut = len(rank_prefix)
    storages: dict[tuple[Any, ...], list[tuple[int, int, str, torch.Tensor, Draft]]] = {}
    views: dict[str, tuple[TensorView, Draft]] = {}
    for path, draft in drafts:
        first = draft.payloads[0]
        t = first.tensor if first.source is None else first.source.tensor
        if t is None or not t.is_cpu or t.is_neg() or t.is_conj():
            continue
        start = int(t.storage_offset())
        end = start + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        key = (t.untyped_storage().data_ptr(), t.dtype)
        storages.setdefault(key, []).append((start, -end, path, t, draft))
    for members in storages.values():
        if len(members) < 2:
            continue
        # By where their elements start, the widest first, contiguous ones first among equal
        # spans (a transpose and its base): a leaf within the span of the contiguous leaf
        # reaching furthest so far is a view of that one.
        members.sort(key=lambda m: (m[0], m[1], not m[3].is_contiguous()))
        base: tuple[int, int, str, Draft] | None = None
        for start, neg_end, path, t, draft in members:
            if base is not None and -neg_end <= base[1]:
                b_start, _, b_path, b_draft = base
                # Tied leaves (the same memory, dtype, shape and strides) share their payloads.
                if draft.payloads[0] is not b_draft.payloads[0]:
                    stride = tuple(t.stride())
                    view = TensorView(base=b_path[cut:], offset=start - b_start, stride=stride)
                    views[path] = (view, b_draft)
            elif t.is_contiguous():
                base = (start, -neg_end, path, draft)
    return views


# ---------------------------------------------------------------------------------------------
# The plan.


@dataclass
class TakePlan:
    """The writes this rank performs, and the drafts of its entries (``collected``), completed
    once the writes have reported their checksums. ``shared``: the replicated payloads this
    rank writes, whose checksums it shares with every rank (``shared_checksums``).
    ``compressed``: every payload is written compressed (``Payload.stored``)."""

    collected: Collected
    writes: list[WriteRequest]
    shared: list[Payload]
    checksums: bool
    compressed: bool = False

    def shared_checksums(self, checksums: Mapping[tuple[str, int], int]) -> dict[Any, Any]:
        """The CRC-32 of each of ``shared``, by ``(blob, offset)``; compressed, the pair
        ``(crc32, stored)`` (``crc32`` None without checksums). Empty when the take records
        neither."""
        out: dict[Any, Any] = {}
        for p in self.shared if self.checksums or self.compressed else ():
            value = crc(p, checksums if self.checksums else None)
            assert p.blob is not None and (value is not None or not self.checksums)
            out[(p.blob, p.pos)] = value if p.stored is None else (value, p.stored)
        return out

    def entries(self, checksums: Mapping[tuple[str, int], int]) -> dict[str, Made]:
        """The manifest's entries, in flatten order, given the CRC-32 of each written range
        ``(blob, offset)``; a tensor in one range as its manifest line (``str``), one with
        attributes (parameter flags, a view, a digest) as a ``TensorEntry``."""
        sums = checksums if self.checksums else None
        line = EntryFormatter().tensor
        c = self.collected
        compressed = self.compressed
        for p in c.replicated if compressed else ():  # the others' writes: CRC, compressed range
            got = checksums.get((p.blob, p.pos))  # type: ignore[arg-type]
            if type(got) is tuple:
                p.crc32, p.stored = got
        out: dict[str, Made] = {}
        for path, e in c.entries.items():
            if isinstance(e, WholeTensor) and not compressed:  # most entries
                p = e
            elif isinstance(e, TensorDraft) and len(e.payloads) == 1 and not compressed:
                p = e.payloads[0]
            elif isinstance(e, (Entry, sharded.ObjectReplica)):
                out[path] = e
                continue
            else:
                out[path] = e.build(sums)
                continue
            assert p.blob is not None
            value = crc(p, sums)
            out[path] = line(path, e.dtype, e.shape, p.blob, p.pos, p.nbytes, value, e.replicated)
        for path in dict.fromkeys([*c.grads, *c.views, *c.digests]):
            if path not in out:
                continue  # listed once, under rank 0's prefix, by rank 0
            draft = c.entries[path]
            assert isinstance(draft, (TensorEntry, WholeTensor, TensorDraft))
            entry = draft if isinstance(draft, TensorEntry) else draft.build(sums)
            parameter, requires_grad = c.grads.get(path, (False, False))
            view, base = c.views.get(path, (None, None))
            # A leaf listed once for every rank is read under each rank's prefix, where its
            # base is that rank's own leaf unless the base is listed once too.
            if entry.replicated and base is not None and not base.replicated:
                view = None
            out[path] = replace(
                entry,
                parameter=parameter,
                requires_grad=requires_grad,
                view=view,
                digest=c.digests.get(path, entry.digest),
            )
        return out


def format_version(
    entries: Mapping[str, Any], *, replicated_once: bool, maybe_compressed: bool
) -> int:
    """The lowest format version that holds a manifest's ``entries`` (merged: a tensor in one
    plain range may be its line, a ``str``): ``replicated_once`` when a replicated leaf is
    listed once for every rank; ranges stored compressed are looked for only when
    ``maybe_compressed`` (the take compressed, or reused a base's ranges)."""
    kinds = set(map(type, entries.values()))
    tensors = [e for e in entries.values() if type(e) is TensorEntry]
    if replicated_once:
        version = mf.REPLICATED_ONCE_VERSION
    else:
        version = 2 if ShardedTensorEntry in kinds or ShardedObjectEntry in kinds else 1
    if any(e.has_attrs for e in tensors):
        version = mf.TENSOR_ATTRS_VERSION
        if any(
            e.digest is not None or any(c.blob.startswith(mf.REFERENCE_PREFIX) for c in e.chunks)
            for e in tensors
        ):
            version = mf.INCREMENTAL_VERSION
    if maybe_compressed and any(
        loc.stored is not None
        for e in entries.values()
        if isinstance(e, mf.Entry)
        for loc in e.locations
    ):
        version = mf.COMPRESSED_VERSION
    return version
