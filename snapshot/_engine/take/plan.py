"""The take planner: from state dicts to a ``TakePlan``, the write requests of a take and the
drafts of its manifest entries, without any I/O.

``collect`` flattens the state dicts into entries and byte payloads (each leaf's by the handler
of its kind); ``place`` gives the payloads their blobs (small ones packed into slabs: ``Placer``)
and makes one ``WriteRequest`` per blob. The take executes the writes and completes the drafts
into the manifest's entries with the CRC-32s the writes (or staging) reported.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from manifest import (
    Entry,
    EntryFormatter,
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
    Staged,
    TensorDraft,
    WholeTensor,
    crc,
    for_value,
)
from snapshot._engine.io import device
from snapshot._engine.io.pipeline import WriteRequest
from snapshot._engine.state_dicts import flatten
from snapshot._engine.take.views import relate

if TYPE_CHECKING:
    from snapshot._engine.take.incremental import Reuse

# ---------------------------------------------------------------------------------------------
# Placement.


@dataclass(eq=False)
class Slab:
    """Small payloads packed into one blob, each after the padding that aligns it."""

    blob: str
    members: list[tuple[int, Payload]] = field(default_factory=list)  # (padding before, payload)
    nbytes: int = 0
    staging_bytes: int = 0
    from_device: bool = False  # a member is copied from a device (async take pins its buffer)

    def label(self) -> str:
        first = self.members[0][1].label
        more = f" and {len(self.members) - 1} more" if len(self.members) > 1 else ""
        return f"{first}{more} (slab {self.blob})"


class Stager(Protocol):
    """How placed blobs are staged (``stage.stager``): ``blob`` and ``slab`` give a write's
    ``stage`` and the staging memory it costs (a slab's stage gives each member its CRC-32 with
    ``checksums``). With ``pooled`` (async take), every payload is copied into a pooled
    buffer."""

    pooled: bool

    def blob(self, p: Payload, from_device: bool) -> tuple[Callable[[], Staged], int]: ...

    def slab(self, slab: Slab, checksums: bool) -> tuple[Callable[[], Staged], int]: ...


class Placer:
    """Gives payloads their blobs under one name prefix (``<rank>/``, or ``<writer>/r`` for
    replicated payloads; the take's id is inserted after the rank's folder: ``0/1f2e3d4c-s0``),
    and makes the write of each complete blob when ``mine``."""

    def __init__(self, prefix: str, layout: Layout, mine: bool, stager: Stager) -> None:
        if layout.take_id:
            folder, _, rest = prefix.rpartition("/")
            prefix = f"{folder}/{layout.take_id}-{rest}" if folder else f"{layout.take_id}-{rest}"
        self.prefix = prefix
        self.layout = layout
        self.mine = mine
        self.stager = stager
        self.writes: list[WriteRequest] = []
        self._next = 0
        self._slab: Slab | None = None

    def _blob(self, kind: str = "") -> str:
        name = f"{self.prefix}{kind}{self._next}"
        self._next += 1
        return name

    def place(self, p: Payload) -> None:
        """In the open slab when small, else in a blob of its own."""
        pooled = self.stager.pooled
        if p.nbytes <= self.layout.slab_threshold_bytes:
            slab = self._slab
            pad = -slab.nbytes % ALIGN if slab is not None else 0
            if slab is None or slab.nbytes + pad + p.nbytes > self.layout.slab_bytes:
                self.close()
                slab = self._slab = Slab(blob=self._blob("s"))
                pad = 0
            slab.members.append((pad, p))
            p.blob, p.pos = slab.blob, slab.nbytes + pad
            slab.nbytes += pad + p.nbytes
            slab.staging_bytes += p.nbytes if pooled else p.staging_bytes
            slab.from_device = slab.from_device or (pooled and _from_device(p))
        else:
            p.blob, p.pos = self._blob(), 0
            if self.mine:
                stage, staging = self.stager.blob(p, pooled and _from_device(p))
                ranges = ((0, p.nbytes),) if self.layout.checksums else ()
                self.writes.append(WriteRequest(p.blob, p.nbytes, staging, stage, p.label, ranges))
        if self.mine and p.source is not None:
            p.source.remaining += 1

    def close(self) -> None:
        """Makes the write of the open slab (its members are checksummed as it is staged)."""
        slab, self._slab = self._slab, None
        if slab is not None and slab.members and self.mine:
            stage, staging = self.stager.slab(slab, self.layout.checksums)
            self.writes.append(WriteRequest(slab.blob, slab.nbytes, staging, stage, slab.label()))


def _from_device(p: Payload) -> bool:
    """Whether a payload is copied from a CUDA device (its pooled buffer is then pinned)."""
    return p.source is not None and device.cuda_index(p.source.tensor) is not None


def place(
    collected: Collected,
    *,
    rank: int,
    layout: Layout,
    writer_of: Mapping[tuple[str, int], int],
    stager: Stager,
    own: Placer | None = None,
) -> TakePlan:
    """The plan: this rank's own writes (its payloads placed by ``own``, when a take across
    ranks did so, ``replication.settle``; else here) and those of the replicated payloads
    ``rank`` writes. A replicated payload is written once, by ``writer_of[(logical, index)]``,
    into that writer's blobs ``<writer>/r<n>`` and ``<writer>/rs<n>``: every rank places them
    all the same way (in sorted order, with the agreed ``layout``), so every rank knows every
    location without asking.
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
    return TakePlan(collected, writes, replicated.get(rank, []), layout.checksums)


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
    own_bytes: int = 0
    # (key, dtype, global shape, offsets, sizes, main, path) of each piece of a global tensor
    pieces: list[tuple[Any, ...]] = field(default_factory=list)
    # (unique key, main, path) of each sharded object
    objects: list[tuple[str, bool, str]] = field(default_factory=list)
    grads: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    views: dict[str, tuple[TensorView, Draft]] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)


class Collector:
    """Flattens state dicts into entries and payloads; places nothing. Its interface for the
    handlers' ``take(planner, path, logical, value, replicated)``: ``prepare``, ``chunk_bytes``
    (the size above which a tensor is split), ``inline_max`` (the largest str or bytes kept in
    the manifest), ``out`` (the ``Collected`` they record into), ``written`` (tensor drafts by
    memory: tied tensors), ``views_possible`` (set when a leaf may be a view of another's
    memory), ``emit(payloads)`` and ``leaf(path, logical, value, replicated)``."""

    def __init__(
        self,
        rank: int,
        prepare: PrepareFunc | None,
        replicated: Sequence[str],
        inline_max_bytes: int,
        chunk_bytes: int,
        reuse: Reuse | None = None,
    ) -> None:
        self.rank = rank
        self.prepare = prepare
        self.replicated = tuple(replicated)
        self.inline_max = inline_max_bytes
        self.chunk_bytes = chunk_bytes
        self.reuse = reuse
        self.out = Collected()
        self.written: dict[int | tuple[Any, ...], Draft] = {}
        self.views_possible = False

    def emit(self, payloads: list[Payload]) -> None:
        """Records one value's payloads (all replicated, or all this rank's own)."""
        if payloads[0].replicated:
            self.out.replicated.extend(payloads)
        else:
            self.out.payloads.extend(payloads)
            self.out.own_bytes += sum(p.nbytes for p in payloads)

    def leaf(self, path: str, logical: str, value: Any, replicated: bool) -> Planned:
        """The entry (or draft) of one leaf, by its kind (``handlers.for_value``)."""
        return for_value(value).take(self, path, logical, value, replicated)

    def add(self, key_path: str, state: Any) -> None:
        """Plans one state dict, at ``<rank>/<key_path>``. A container is never replicated,
        even where a glob matches it: only leaves are stored once for every rank."""
        prefix = f"{self.rank}/"
        for path, node, value in flatten(state, prefix + key_path):
            if node is None:
                logical = path[len(prefix) :]
                replicated = bool(self.replicated) and any(
                    fnmatch.fnmatchcase(logical, g) for g in self.replicated
                )
                self.out.entries[path] = self.leaf(path, logical, value, replicated)
            else:
                self.out.entries[path] = node


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
    """Flattens ``(key_path, state_dict)`` pairs of process ``rank`` into entries and payloads.

    Manifest paths are ``"<rank>/<key_path>/..."``; ``prepare`` and the ``replicated`` globs see
    the logical path without the rank. Tensors are split into chunks of ``chunk_bytes``.
    """
    collector = Collector(rank, prepare, replicated, inline_max_bytes, chunk_bytes, reuse)
    for key_path, state in states:
        collector.add(key_path, state)
    if reuse is not None:
        collector.out.digests = reuse.digests
    if prepare is None and collector.views_possible:
        entries = collector.out.entries.items()
        drafts = [(p, d) for p, d in entries if isinstance(d, (WholeTensor, TensorDraft))]
        collector.out.views = relate(drafts, f"{rank}/")
    return collector.out


# ---------------------------------------------------------------------------------------------
# The plan.


@dataclass
class TakePlan:
    """The writes this rank performs, and the drafts of its entries (``collected``), completed
    once the writes have reported their checksums. ``shared``: the replicated payloads this
    rank writes, whose checksums it shares with every rank (``shared_checksums``)."""

    collected: Collected
    writes: list[WriteRequest]
    shared: list[Payload]
    checksums: bool

    def shared_checksums(
        self, checksums: Mapping[tuple[str, int], int]
    ) -> dict[tuple[str, int], int]:
        """The CRC-32 of each of ``shared``, by ``(blob, offset)``; empty when the take records
        none."""
        out = {}
        for p in self.shared if self.checksums else ():
            value = crc(p, checksums)
            assert p.blob is not None and value is not None
            out[(p.blob, p.pos)] = value
        return out

    def early_entries(self) -> dict[str, Made | None]:
        """The entries that need no CRC from a write (None in place of the others), made while
        the last writes finish: a whole tensor staged in a slab (checksummed then) or recorded
        without a CRC, and every entry made while planning."""
        return self._made(None, {}, early=True)

    def entries(
        self,
        checksums: Mapping[tuple[str, int], int],
        early: Mapping[str, Made | None] | None = None,
    ) -> dict[str, Made]:
        """The manifest's entries, in flatten order; ``checksums`` maps each written range
        ``(blob, offset)`` to its CRC-32 (ignored when the take records none); what
        ``early_entries`` made is taken from ``early``. A dense tensor's entry is its manifest
        line (``str``: see ``manifest.dumps_entries``); rank 0 merges the sharded ones."""
        made = self._made(checksums if self.checksums else None, early or {}, early=False)
        out = {path: e for path, e in made.items() if e is not None}
        assert len(out) == len(made)
        return out

    def _made(
        self,
        checksums: Mapping[tuple[str, int], int] | None,
        known: Mapping[str, Made | None],
        early: bool,
    ) -> dict[str, Made | None]:
        """Each entry: from ``known``, or made from its draft (when ``early``, only those that
        need no CRC from a write). A leaf with attributes gets a ``TensorEntry`` recording them."""
        c = self.collected
        fmt = EntryFormatter()
        out: dict[str, Made | None] = {}
        for path, e in c.entries.items():
            done = known.get(path)
            if done is not None:
                out[path] = done
            elif isinstance(e, (WholeTensor, TensorDraft)):  # most entries
                ready = isinstance(e, WholeTensor) and (e.crc32 is not None or not self.checksums)
                out[path] = _line(path, e, checksums, fmt) if ready or not early else None
            elif isinstance(e, (Entry, sharded.ObjectReplica)):
                out[path] = e
            else:
                out[path] = None if early else e.build(checksums)
        for path in dict.fromkeys([*c.grads, *c.views, *c.digests]):
            if out.get(path) is None or known.get(path) is not None:
                continue  # not made yet, or made (with its attributes) by the early pass
            draft = c.entries[path]
            assert isinstance(draft, (TensorEntry, WholeTensor, TensorDraft))
            entry = draft if isinstance(draft, TensorEntry) else draft.build(checksums)
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


def _line(
    path: str, draft: Draft, checksums: Mapping[tuple[str, int], int] | None, fmt: EntryFormatter
) -> str:
    """A tensor entry's manifest line; one in one range is formatted from its fields."""
    if isinstance(draft, TensorDraft):
        if len(draft.payloads) != 1:
            return fmt.entry(path, draft.build(checksums))
        p = draft.payloads[0]
    else:
        p = draft
    assert p.blob is not None
    return fmt.tensor(
        path, draft.dtype, draft.shape, p.blob, p.pos, p.nbytes, crc(p, checksums),
        draft.replicated,
    )  # fmt: skip
