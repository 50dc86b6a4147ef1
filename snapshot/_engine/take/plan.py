"""The take planner: from flattened state to manifest entries and byte payloads, without doing
any I/O.

Each leaf of each ``state_dict()`` becomes an entry, made by the handler of its kind
(``handlers``): tensors and long values become byte payloads, which the rank's placer
(``placement``) puts in blobs as they are met, so that the writes of a process alone start
while the rest of the state is planned. ``TakePlan`` is what the take (``take``) writes, and
completes into the manifest's entries once the writes have reported their checksums.
"""

from __future__ import annotations

import fnmatch
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import compress, repeat
from operator import attrgetter, is_
from typing import TYPE_CHECKING, Any

import torch

from manifest import Entry, EntryFormatter, TensorEntry, TensorView
from snapshot._engine.flatten import flatten
from snapshot._engine.handlers import for_value, sharded
from snapshot._engine.io.tensor_memory import conjugated, negated
from snapshot._engine.take.drafts import (
    Draft,
    Payload,
    Planned,
    PrepareFunc,
    TensorDraft,
    WholeTensor,
    crc,
    payloads_of,
)

if TYPE_CHECKING:
    from snapshot._engine.io.requests import WriteRequest
    from snapshot._engine.take.incremental import Reuse
    from snapshot._engine.take.placement import Placer, Recorder



@dataclass
class Collected:
    """A rank's state, flattened: entries (or drafts awaiting their payloads' locations) in
    flatten order; the replicated payloads, in the same order (placed once their writers are
    agreed on); the bytes of this rank's own payloads (placed as they were met; in a take
    across ranks, recorded, and placed once the first agreement has said which leaves are
    replicated: ``replication.settle``)."""

    entries: dict[str, Planned] = field(default_factory=dict)
    replicated: list[Payload] = field(default_factory=list)
    own_bytes: int = 0
    # (key, dtype, global shape, offsets, sizes, main, path) of each piece of a global tensor
    pieces: list[tuple[Any, ...]] = field(default_factory=list)
    # (unique key, main, path) of each sharded object
    objects: list[tuple[str, bool, str]] = field(default_factory=list)
    # How many of this rank's own writes (``Placer.writes``) were handed to ``submit``.
    submitted: int = 0
    # What a tensor leaf's entry records beyond its bytes (``TensorEntry``), by path: whether
    # it was an ``nn.Parameter`` and required grad (only leaves with either set), and, for a
    # leaf whose elements lie in another leaf's memory, its view and that leaf's draft.
    grads: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    views: dict[str, tuple[TensorView, Draft]] = field(default_factory=dict)
    # The digest of each tensor leaf's bytes, where the take records them (``incremental``).
    digests: dict[str, str] = field(default_factory=dict)


@dataclass
class TakePlan:
    """The writes this rank performs, and the entries for the manifest (in flatten order), to be
    built once the writes have reported their checksums (``entries``).

    ``shared`` are the replicated payloads this rank writes: the other ranks' entries point at
    them too, so their checksums are shared with every rank (``shared_checksums``).
    """

    drafts: dict[str, Planned]
    writes: list[WriteRequest]
    shared: list[Payload]
    checksums: bool
    grads: dict[str, tuple[bool, bool]] = field(default_factory=dict)  # ``Collected``'s
    views: dict[str, tuple[TensorView, Draft]] = field(default_factory=dict)  # ``Collected``'s
    digests: dict[str, str] = field(default_factory=dict)  # ``Collected``'s

    def shared_checksums(
        self, checksums: Mapping[tuple[str, int], int]
    ) -> dict[tuple[str, int], int]:
        """The CRC-32 of each of ``shared``, by ``(blob, offset)``: from staging, or else from
        the writes' ``checksums``. Empty when the take records none."""
        if not self.checksums:
            return {}
        return {(p.blob, p.pos): crc(p, checksums) for p in self.shared}  # type: ignore[misc]

    def early_entries(self) -> dict[str, Entry | str | None]:
        """The entries that need no CRC from a write (None in place of the others), made
        while the last writes finish: every whole tensor staged in a slab (checksummed then) or
        recorded without a CRC, and every entry already built. For ``entries``."""
        tensor = EntryFormatter(self.drafts.keys()).tensor
        sums = self.checksums
        out: dict[str, Entry | str | None] = {}
        for path, e in self.drafts.items():
            kind = type(e)
            if kind is WholeTensor:  # most entries
                crc32 = e.crc32
                if crc32 is None and sums:  # written on its own, or by another rank
                    out[path] = None
                    continue
                out[path] = tensor(
                    path, e.dtype, e.shape, e.blob, e.pos, e.nbytes, crc32, e.replicated
                )
            elif isinstance(e, (Entry, sharded.ObjectReplica)):
                out[path] = e
            else:
                out[path] = None
        if self.grads or self.views or self.digests:
            self._attribute(out, None)
        return out

    def entries(
        self,
        checksums: Mapping[tuple[str, int], int],
        early: Mapping[str, Entry | str | None] | None = None,
    ) -> dict[str, Entry | str]:
        """The manifest's entries; ``checksums`` maps each written range ``(blob, offset)`` to
        its CRC-32 (ignored when the take records none); what ``early_entries`` made is
        taken from ``early`` (made here when not given), the rest is made now.

        A dense tensor's entry is given as its manifest line (``str``, see
        ``manifest.dumps_entries``): a take of many small tensors would otherwise build two
        records per tensor only to format them. The other entries are objects (rank 0 merges
        sharded ones across ranks).
        """
        sums = checksums if self.checksums else None
        made = early if early is not None else self.early_entries()
        # What is left to make, found by C-level passes (in a process alone, often nothing).
        todo = dict.fromkeys(compress(made, map(is_, made.values(), repeat(None))))
        out = dict(made)  # in flatten order
        fmt = EntryFormatter(todo.keys())
        drafts = self.drafts
        for path in todo:
            e = drafts[path]
            if type(e) in (WholeTensor, TensorDraft):
                out[path] = e.line(path, sums, fmt)  # type: ignore[union-attr]
            else:
                out[path] = e.build(sums)  # type: ignore[union-attr]
        if self.grads or self.views or self.digests:
            self._attribute(out, sums)
        return out  # type: ignore[return-value]

    def _attribute(
        self,
        out: dict[str, Entry | str | None],
        checksums: Mapping[tuple[str, int], int] | None,
    ) -> None:
        """Makes the entry in ``out`` of each leaf with ``grads``, ``views`` or ``digests`` a
        ``TensorEntry`` that records them (the line formatter writes plain tensors only). A path
        whose entry is not made yet (None), or that this rank does not list, is left as it
        is."""
        grads, views, drafts, digests = self.grads, self.views, self.drafts, self.digests
        for path in dict.fromkeys([*grads, *views, *digests]):
            if out.get(path) is None:
                continue
            draft = drafts[path]
            entry = draft if isinstance(draft, TensorEntry) else draft.build(checksums)  # type: ignore[union-attr]
            parameter, requires_grad = grads.get(path, (False, False))
            view = None
            if path in views:
                view, base = views[path]
                # A leaf listed once for every rank is read under each rank's prefix, where
                # its base is that rank's own leaf unless the base is listed once too.
                if entry.replicated and not base.replicated:
                    view = None
            out[path] = replace(
                entry,
                parameter=parameter,
                requires_grad=requires_grad,
                view=view,
                digest=digests.get(path, entry.digest),
            )


class Collector:
    """Flattens state dicts into entries and payloads (no placement yet: ``own`` places).

    Each leaf's entry is made by its kind (``handlers.for_value``), given this collector as its
    ``TakeSink`` (``handlers.table``): the kinds read ``prepare``, ``chunk_bytes``,
    ``inline_max`` and ``reuse``, record into ``out``, hand payloads over with ``emit``, take
    inner values with ``leaf``, and find tied tensors in ``written``.
    """

    def __init__(
        self,
        rank: int,
        prepare: PrepareFunc | None,
        replicated: Sequence[str],
        inline_max_bytes: int,
        own: Placer | Recorder,
        submit: Callable[[WriteRequest], None] | None,
        reuse: Reuse | None = None,
    ) -> None:
        self.rank = rank
        # An incremental take's base (or a take recording digests): ``incremental.Reuse``.
        self.reuse = reuse
        self.prepare = prepare
        self.replicated = tuple(replicated)
        self.inline_max = inline_max_bytes
        self.chunk_bytes = own.layout.chunk_bytes
        self.own = own
        self.submit = submit
        self.out = Collected()
        # Tensors already planned, by memory (``dense.take_tensor``): a contiguous CPU tensor by
        # its address, another by its address, device, dtype, shape, strides and flags.
        self.written: dict[int | tuple[Any, ...], Draft] = {}
        # Whether a leaf may be a view of another leaf's memory, other than the same view
        # (``relate`` looks only then): set by a CPU leaf that is a part of its storage, or is
        # not contiguous, or starts where another leaf of another dtype or shape does.
        self.views_possible = False

    def _is_replicated(self, logical: str) -> bool:
        return any(fnmatch.fnmatchcase(logical, g) for g in self.replicated)

    def emit(self, payloads: list[Payload]) -> None:
        """Records one value's payloads. Those of this rank's own (not replicated: their
        writers are agreed on later) are placed at once, and with ``submit`` each write whose
        blob is complete is handed over at once, so writing goes on while the rest of the
        state is planned. A value's payloads are all placed before any of their writes is
        handed over: staging one releases a resolved tensor once all its placed pieces are
        staged."""
        out = self.out
        if payloads[0].replicated:
            out.replicated.extend(payloads)
            return
        own = self.own
        for p in payloads:
            out.own_bytes += p.nbytes
            own.place(p)
        if self.submit is not None and len(own.writes) > out.submitted:
            self.hand_over()

    def hand_over(self) -> None:
        """Hands each write placed since the last call to ``submit``."""
        assert self.submit is not None
        writes, out = self.own.writes, self.out
        while out.submitted < len(writes):
            out.submitted += 1
            self.submit(writes[out.submitted - 1])

    def add(self, key_path: str, state: Any) -> None:
        rank_prefix = f"{self.rank}/"
        entries = self.out.entries
        cut = len(rank_prefix)
        check = bool(self.replicated)
        for path, node, value in flatten(state, rank_prefix + key_path):
            if node is None:
                replicated = check and self._is_replicated(path[cut:])
                entries[path] = for_value(value).take(self, path, path[cut:], value, replicated)
            else:
                # A container is never marked replicated, even where a glob matches it: each
                # rank's entries keep their own (they list other keys only where the states
                # differ), and only leaves are stored once for every rank.
                entries[path] = node

    def leaf(self, path: str, logical: str, value: Any, replicated: bool) -> Planned:
        """The entry (or draft) of one leaf, by the handler of its kind."""
        return for_value(value).take(self, path, logical, value, replicated)

    def relate(self) -> None:
        """Records each tensor leaf on the CPU whose elements lie within the memory of another
        leaf of its storage and dtype that is written from its memory as it lies (a contiguous
        one), as a view of it (``Collected.views``): a read that builds new tensors then makes
        one storage of them, as ``torch.load`` does. Leaves holding the same view of one memory
        whose entries share their bytes (tied weights, on any device) need no record: a reader
        finds them by their equal locations. Negated or conjugate views hold other values than
        their memory, and are left alone; so is everything when a prepare function writes the
        tensors.

        Looked for only when planning met a leaf that may be such a view (``views_possible``),
        from the drafts: the spans of memory the leaves read are sorted in C, and only leaves
        whose spans overlap are looked at further."""
        if self.prepare is not None or not self.views_possible:
            return
        entries = self.out.entries
        drafts = list(entries.values())
        whole = list(map(is_, map(type, drafts), repeat(WholeTensor)))
        paths = list(compress(entries, whole))
        found = list(compress(drafts, whole))
        # (Arrays made from lists: made from iterators, they were filled item by item.)
        starts = array("q", list(map(_ADDRESS, found)))
        sizes = array("q", list(map(_NBYTES, found)))
        # The other tensor drafts with bytes: tied leaves, large or gathered tensors (few).
        others = map(is_, map(type, drafts), repeat(TensorDraft))
        for path, draft in compress(entries.items(), others):
            span = _span(draft)
            if span is not None:
                paths.append(path)
                found.append(draft)
                starts.append(span[0])
                sizes.append(span[1] - span[0])
        for group in _overlapping(starts, sizes):
            storages: dict[tuple[Any, ...], list[tuple[str, torch.Tensor, Draft]]] = {}
            for i in group:
                t = _tensor_of(found[i])
                key = (t.untyped_storage().data_ptr(), t.device, t.dtype)
                storages.setdefault(key, []).append((paths[i], t, found[i]))
            for members in storages.values():
                if len(members) > 1:
                    self._relate(members)

    def _relate(self, members: list[tuple[str, torch.Tensor, Draft]]) -> None:
        """``relate`` for the leaves of one storage, device and dtype: each leaf is taken in
        order of where its elements start (the widest first), and one lying within the span of
        the contiguous leaf reaching furthest so far is a view of that leaf. That leaf is not
        itself within another's: no view is of a view."""
        cut = len(f"{self.rank}/")
        spans = []
        for order, (path, t, draft) in enumerate(members):
            start = t.storage_offset()
            end = start + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
            spans.append((start, -end, order, path, t, draft))
        spans.sort(key=lambda s: s[:3])
        base: tuple[int, int, str, torch.Tensor, Draft] | None = None
        views = self.out.views
        for start, neg_end, _, path, t, draft in spans:
            end = -neg_end
            if base is not None and end <= base[1]:
                b_start, _, b_path, b_tensor, b_draft = base
                same = (
                    start == b_start
                    and t.shape == b_tensor.shape
                    and t.stride() == b_tensor.stride()
                    and payloads_of(draft)[0] is payloads_of(b_draft)[0]
                )
                if not same:
                    view = TensorView(
                        base=b_path[cut:], offset=start - b_start, stride=tuple(t.stride())
                    )
                    views[path] = (view, b_draft)
            elif t.is_contiguous():
                base = (start, end, path, t, draft)


_ADDRESS = attrgetter("address")
_NBYTES = attrgetter("nbytes")


def _tensor_of(draft: Draft) -> torch.Tensor:
    """The tensor whose memory a draft's bytes come from (for a tied leaf, the first leaf's:
    the same view of the same memory)."""
    first = payloads_of(draft)[0]
    if first.tensor is not None:
        return first.tensor
    assert first.source is not None
    return first.source.tensor


def _span(draft: TensorDraft) -> tuple[int, int] | None:
    """The addresses of the first byte of a draft's tensor and of the byte after its last
    element (its memory as a range); None for a tensor whose written values are not its memory
    (prepared, negated, conjugate), or that is not on the CPU (``relate``)."""
    first = draft.payloads[0]
    if first.tensor is not None:  # a contiguous CPU tensor in several chunks
        return first.address, first.address + sum(p.nbytes for p in draft.payloads)
    source = first.source
    assert source is not None
    t = source.tensor
    if source.prepare is not None or not t.is_cpu or negated(t) or conjugated(t):
        return None
    start = t.data_ptr()
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return start, start + (reach + 1) * t.itemsize


def _overlapping(starts: array[int], sizes: array[int]) -> list[list[int]]:
    """The groups of indices of the ranges of ``sizes[i]`` bytes at ``starts[i]`` that overlap
    one another (through any chain of overlaps), each of two ranges or more: sorted and scanned
    in C."""
    if len(starts) < 2:
        return []
    first = torch.frombuffer(starts, dtype=torch.int64)
    ends = first + torch.frombuffer(sizes, dtype=torch.int64)
    first, order = torch.sort(first)
    # (``index_select``: indexing by a tensor of indices takes torch's general advanced-indexing
    # path, many times slower.)
    reach = _running_max(ends.index_select(0, order))
    joins = first[1:] < reach[:-1]  # each range overlapping one before it in start order
    if not bool(joins.any()):
        return []
    group = torch.cat([torch.zeros(1, dtype=torch.int64), (~joins).cumsum(0)])
    joined = group[1:].masked_select(joins)
    at = torch.isin(group, joined).nonzero().flatten()
    groups: dict[int, list[int]] = {}
    members = order.index_select(0, at).tolist()
    for g, i in zip(group.index_select(0, at).tolist(), members, strict=True):
        groups.setdefault(g, []).append(i)
    return list(groups.values())


def _running_max(x: torch.Tensor) -> torch.Tensor:
    """The maximum of ``x[: i + 1]`` at each ``i`` of a 1-d tensor, by doubling steps of
    element-wise maxima (``cummax`` also tracks indices, element by element, and was many
    times slower)."""
    step = 1
    while step < len(x):
        x = torch.cat([x[:step], torch.maximum(x[step:], x[:-step])])
        step *= 2
    return x


def collect(
    states: Iterable[tuple[str, Any]],
    *,
    rank: int,
    prepare: PrepareFunc | None,
    replicated: Sequence[str],
    inline_max_bytes: int,
    own: Placer | Recorder,
    submit: Callable[[WriteRequest], None] | None = None,
    reuse: Reuse | None = None,
) -> Collected:
    """Flattens ``(key_path, state_dict)`` pairs of process ``rank`` into entries and payloads.

    Manifest paths are ``"<rank>/<key_path>/..."``; ``prepare`` and the ``replicated`` globs see
    the logical path without the rank. The rank's own payloads are placed by ``own`` as they
    are met (tensors chunked by its layout), or only recorded by a ``Recorder``; with
    ``submit``, each of their writes is handed to it as soon as its blob is complete, the last
    one when the state is done. (``own``'s writes hold every blob placed so far, also when this
    raises.)
    """
    collector = Collector(rank, prepare, replicated, inline_max_bytes, own, submit, reuse)
    for key_path, state in states:
        collector.add(key_path, state)
    if reuse is not None:
        collector.out.digests = reuse.digests
    collector.relate()
    own.close()
    if submit is not None:
        collector.hand_over()
    return collector.out
