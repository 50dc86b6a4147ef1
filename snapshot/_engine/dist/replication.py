"""Which values of a take across ranks are one value, written once and readable by any rank.

A leaf is *replicated* when every rank reaches the same answer from facts gathered from every
rank: either every rank's ``replicated`` globs match it (then kind, dtype and shape must agree,
else every rank raises), or its bytes are equal everywhere. For the latter, ``describe`` sends
each leaf's kind, payload sizes and CRC-32 (the exact bytes of a primitive or of a value of at
most ``_EXACT`` bytes, such as an optimizer's step count) with the take's first agreement;
leaves whose CRCs match on every rank are confirmed by 64 bits of BLAKE2b at one more
agreement (``Pending.confirm``), run only when there are candidates. The CRC (cheap) weeds out
per-rank state; BLAKE2b makes a false match about as likely as a random 64-bit collision, and
the CRC adds certainty for small differences.

A replicated leaf is written by one rank (``assign_writers``) and listed once in the
manifest, under rank 0's prefix. The copies of a piece of a DTensor on a submesh, held by the
ranks outside it (``sharded.copies``), are written once, by one of them (spread as ``assign_writers`` spreads). Each holder
computes its copy's CRC-32 before the take returns (``Pending.copy_crcs``) and sends it with the
agreement after writing, which checks them (``Pending.check_copies``): copies that differ fail
the take before anything is committed, without an agreement of their own. Only the pieces the first agreement finds on
several ranks are digested: a piece no other rank holds (a pipeline stage's) costs nothing.
Only a take across ranks runs any of this.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from manifest import PrimitiveEntry, TensorEntry
from snapshot._engine import runtime
from snapshot._engine.format.serialization import combine, crc32, gather_elements, tensor_memoryview
from snapshot._engine.handlers import sharded
from snapshot._engine.handlers.table import (
    Layout,
    ObjectDraft,
    Payload,
    ShardDraft,
    TensorDraft,
    WholeTensor,
)
from snapshot._engine.take.plan import Collected, Placer, Stager
from snapshot.errors import SnapshotError

_T = TypeVar("_T")

# A large value is digested in pieces of this many bytes (whole elements of any dtype) on up to
# ``_THREADS`` threads (BLAKE2b and the CRC drop the GIL), as a hash tree of the pieces'
# digests: the digest depends on the bytes only, not on how a rank holds them.
_PIECE = 4 << 20
# A value of at most this many bytes is described by its bytes themselves, compared exactly,
# so it needs no BLAKE2b (and no agreement to confirm it).
_EXACT = 64
_THREADS = max(1, min(8, os.cpu_count() or 1))
# A CRC-32 runs at memory speed (ISA-L), so a value of fewer pieces than this is taken on the
# caller's thread: handing a few pieces to the threads cost more than it saved (a 4.3 MiB copy
# of an HSDP take took 1.5-3.5 ms through them, 0.4 ms on the caller's thread).
_CRC_POOL_PIECES = 16

Source = memoryview | torch.Tensor
"""Where a leaf's bytes are, to digest them: a byte view (a contiguous CPU tensor's memory, an
object's serialized bytes), or a tensor to gather piece by piece (strided, on a device,
conjugate or negated)."""


def _map_pieces(
    src: Source, fn: Callable[[memoryview], _T], pool_from: int = 2
) -> list[tuple[_T, int]]:
    """``fn`` of each consecutive piece of ``_PIECE`` bytes of ``src`` (the last one shorter),
    with its length; on the threads when there are ``pool_from`` pieces or more. A tensor to
    gather is gathered one piece at a time per thread (a CUDA tensor's pieces are copied from
    the device)."""
    if isinstance(src, torch.Tensor):
        t = src.detach().resolve_conj().resolve_neg()
        if t.is_cpu and t.is_contiguous():
            src = tensor_memoryview(t)
    if isinstance(src, memoryview):
        view = src
        nbytes = view.nbytes

        def piece(lo: int, hi: int) -> _T:
            return fn(view[lo:hi])

    else:
        itemsize = t.element_size()
        nbytes = t.numel() * itemsize

        def piece(lo: int, hi: int) -> _T:
            return fn(tensor_memoryview(gather_elements(t, lo // itemsize, hi // itemsize)))

    bounds = [(lo, min(nbytes, lo + _PIECE)) for lo in range(0, nbytes, _PIECE)] or [(0, 0)]
    sizes = [hi - lo for lo, hi in bounds]
    if len(bounds) < pool_from:
        return [(piece(*b), n) for b, n in zip(bounds, sizes, strict=True)]
    pool = runtime.get().digest_pool(_THREADS)
    return list(zip(pool.map(lambda b: piece(*b), bounds), sizes, strict=True))


def crc_of(src: Source) -> int:
    """The CRC-32 of a source's bytes."""
    crc = 0
    for c, n in _map_pieces(src, crc32, _CRC_POOL_PIECES):
        crc = combine(crc, c, n)
    return crc


def strong_of(src: Source) -> bytes:
    """64 bits of BLAKE2b over the 128-bit BLAKE2b digests of the source's pieces."""
    pieces = _map_pieces(src, lambda v: hashlib.blake2b(v, digest_size=16).digest())
    joined = b"".join(h for h, _ in pieces)
    return hashlib.blake2b(joined, digest_size=8, person=b"statesnap-tree").digest()


def joined(sources: Mapping[str, Source], paths: Sequence[str]) -> bytes:
    """``strong_of`` each of ``paths``, joined in their order (8 bytes each): what a rank sends
    (every rank knows the same ``paths``)."""
    return b"".join(strong_of(sources[p]) for p in paths)


class Desc(NamedTuple):
    """What must be equal on every rank for a leaf to be one value: its kind (``float32[4,
    4]``, ``object torch_save dict``, ``primitive``), its payloads' sizes in order, and the
    path of the earlier leaf whose payloads it shares (tied weights), or None."""

    kind: str
    sizes: tuple[int, ...]
    alias: str | None


@dataclasses.dataclass
class Facts:
    """What ``describe`` found, by logical path: ``marked``, the leaves a glob marks replicated;
    ``prints``, each other leaf that may be one value, with its ``Desc`` and a check (a CRC-32
    to confirm, or a final value: a primitive's exact value, ``()`` for an empty tensor, None
    for a tied leaf); ``sources``, where each leaf with a CRC, and each main piece of a DTensor
    on a submesh (which other ranks may hold copies of), has its bytes (kept, not sent)."""

    marked: dict[str, Desc]
    prints: dict[str, tuple[Desc, Any]]
    sources: dict[str, Source]


def describe(collected: Collected, rank_prefix: str) -> Facts:
    """This rank's facts for the first agreement (paths relative to ``rank_prefix``). Pieces of
    sharded values are not described (each rank writes its own), nor tensors given to a custom
    prepare function (the bytes written are the function's)."""
    cut = len(rank_prefix)
    facts = Facts({}, {}, {})

    def add(logical: str, desc: Desc, replicated: bool, check: Any, src: Source | None) -> None:
        if replicated:
            facts.marked[logical] = desc
            return
        if src is not None:
            try:
                if sum(desc.sizes) <= _EXACT:  # final: its bytes
                    check = b"".join(b for b, _ in _map_pieces(src, bytes))
                else:
                    check = crc_of(src)
                    facts.sources[logical] = src
            except RuntimeError:  # unreadable here (no copy kernel): stays the rank's own
                return
        facts.prints[logical] = (desc, check)

    for path, e in collected.entries.items():
        logical = path[cut:]
        if isinstance(e, WholeTensor):
            desc = Desc(f"{e.dtype}{list(e.shape)}", (e.nbytes,), None)
            add(logical, desc, e.replicated, None, e.tensor)
        elif isinstance(e, TensorDraft):
            first = e.payloads[0]
            alias = first.label[cut:] if first.label != path else None
            desc = Desc(f"{e.dtype}{list(e.shape)}", tuple(p.nbytes for p in e.payloads), alias)
            if alias is not None:  # the same memory as ``alias``: one value when that one is
                add(logical, desc, e.replicated, None, None)
            elif first.tensor is not None:  # chunks of one contiguous CPU tensor
                add(logical, desc, e.replicated, None, first.tensor)
            elif first.source is not None and first.source.prepare is None:
                add(logical, desc, e.replicated, None, first.source.tensor)
            elif e.replicated:
                facts.marked[logical] = desc
        elif isinstance(e, ObjectDraft):
            desc = Desc(f"object {e.serializer} {e.obj_type}", (e.payload.nbytes,), None)
            assert e.payload.data is not None
            add(logical, desc, e.replicated, None, memoryview(e.payload.data))
        elif isinstance(e, PrimitiveEntry):
            # repr is exact: 1 from True and 1.0, -0.0 from 0.0, nan equal to nan.
            check = (type(e.value).__name__, repr(e.value))
            add(logical, Desc("primitive", (), None), e.replicated, check, None)
        elif isinstance(e, TensorEntry) and not e.chunks:  # an empty tensor, stored inline
            add(logical, Desc(f"{e.dtype}{list(e.shape)}", (), None), e.replicated, (), None)
        elif isinstance(e, ShardDraft) and e.held.copied:
            for piece, _ in e.written:  # a DTensor's one piece, when it is a main one
                facts.sources[logical] = piece.data
    return facts


@dataclasses.dataclass
class Decision:
    """What the agreements decided: the replicated leaves (logical path -> rank 0's ``Desc``,
    in rank 0's order), their payloads for ``assign_writers``, each rank's bytes of its own
    once the decision is applied, and ``copies``: the paths (rank prefix included) of the
    sharded pieces another rank writes (``sharded.copies``), which ``settle`` drops."""

    replicated: dict[str, Desc]
    signature: list[tuple[str, int, int, str]]
    local_bytes: list[int]
    copies: frozenset[str] = frozenset()


Box = tuple[str, tuple[int, ...], tuple[int, ...]]
"""A sharded tensor's key and a box of it: its offsets and sizes."""


@dataclasses.dataclass
class Pending:
    """The first agreement's answer: ``replicated`` holds the leaves of ``to_confirm`` (whose
    CRCs matched) until ``confirm`` checks their BLAKE2b on every rank; ``copies``, the
    holders of each box copied on several ranks (``sharded.copies``), whose CRC-32s
    ``check_copies`` compares once they are written."""

    where: str
    replicated: dict[str, Desc]
    to_confirm: list[str]
    infos: Sequence[Mapping[str, Any]]
    copies: dict[Box, list[tuple[int, str]]]

    def digests(self, sources: Mapping[str, Source]) -> bytes:
        """What a rank sends to confirm ``to_confirm``: the BLAKE2b of each leaf (``joined``)."""
        return joined(sources, self.to_confirm)

    def copy_crcs(self, sources: Mapping[str, Source], rank: int) -> bytes:
        """The CRC-32 of each copy ``rank`` holds, 8 bytes each, in ``copies`` order. A CRC
        suffices: the copies are known to be of one box, so it only has to catch copies that
        drifted apart (a training bug), not two values that merely look alike."""
        mine = [p for holders in self.copies.values() for r, p in holders if r == rank]
        return b"".join(crc_of(sources[p.partition("/")[2]]).to_bytes(8, "big") for p in mine)

    def check_copies(self, crcs: Sequence[bytes]) -> None:
        """Compares every rank's ``copy_crcs``.

        Raises:
            SnapshotError: the copies of a box differ.
        """
        at = [0] * len(self.infos)  # where each rank's next CRC starts
        for box, holders in self.copies.items():
            found = []
            for rank, _ in holders:
                found.append(crcs[rank][at[rank] : at[rank] + 8])
                at[rank] += 8
            _check_copies(self.where, box, holders, found)

    def confirm(self, digests: Sequence[bytes] | None) -> Decision:
        """The ``Decision``, given every rank's ``digests`` (None when there is nothing to
        confirm)."""
        replicated = dict(self.replicated)
        for i, logical in enumerate(self.to_confirm):
            if digests and len({d[8 * i : 8 * i + 8] for d in digests}) > 1:
                del replicated[logical]
        copies = frozenset(p for holders in self.copies.values() for _, p in holders[1:])
        # A leaf sharing an earlier one's payloads is one value only when that one is.
        for logical in [p for p, d in replicated.items() if d.alias is not None]:
            if replicated[logical].alias not in replicated:
                del replicated[logical]
        signature = [
            (logical, i, n, desc.kind)
            for logical, desc in replicated.items()
            if desc.alias is None
            for i, n in enumerate(desc.sizes)
        ]
        own = [_own_bytes(info, replicated) for info in self.infos]
        return Decision(replicated, signature, own, copies)


def decide(where: str, infos: Sequence[Mapping[str, Any]]) -> Pending:
    """Every rank's ``marked``, ``prints`` (``Facts``) and ``own_bytes`` -> what is replicated,
    pending the confirmation of the leaves whose CRCs matched.

    Raises:
        SnapshotError: a leaf every rank marked replicated differs in kind or size between
            rank 0 and another rank.
    """
    first = infos[0]
    replicated: dict[str, Desc] = {}
    for logical, desc in first["marked"].items():  # marked on every rank
        others = [info["marked"].get(logical) for info in infos[1:]]
        if any(o is None for o in others):
            continue
        for rank, other in enumerate(others, start=1):
            if (other.kind, other.sizes) != (desc.kind, desc.sizes):
                raise SnapshotError(
                    f"snapshot {where}: replicated entries differ between rank 0 and rank "
                    f"{rank}: {logical} is {desc.kind} ({sum(desc.sizes)} bytes) on rank 0 but "
                    f"{logical} is {other.kind} ({sum(other.sizes)} bytes) on rank {rank}; "
                    "values marked replicated must have the same dtype and shape on every rank"
                )
        if all(o.alias == desc.alias for o in others):  # tied alike everywhere
            replicated[logical] = desc
    to_confirm = []
    for logical, fp in first["prints"].items():  # the same description on every rank
        if all(info["prints"].get(logical) == fp for info in infos[1:]):
            replicated[logical] = fp[0]
            if type(fp[1]) is int:
                to_confirm.append(logical)
    pieces = [info.get("pieces", ()) for info in infos]
    copies = sharded.copies(pieces) if any(pieces) else {}
    return Pending(where, replicated, to_confirm, infos, copies)


def _check_copies(where: str, box: Box, holders: list[tuple[int, str]], found: list[Any]) -> None:
    """Raises unless the copies of a box held by ``holders`` (rank, path) are equal: their
    digests, ``found``, in the same order.

    Raises:
        SnapshotError: naming the tensor, the box and the ranks whose copies differ.
    """
    differ = [rank for (rank, _), f in zip(holders, found, strict=True) if f != found[0]]
    if differ:
        (key, offsets, sizes), first = box, holders[0][0]
        raise SnapshotError(
            f"snapshot {where}: the copies of DTensor {key!r} at {list(offsets)} size "
            f"{list(sizes)} differ: rank {first}'s is not equal to that of ranks {differ}; the "
            "copies of a DTensor's piece (on the ranks outside its submesh, or along its "
            "Replicate mesh dimensions) must be equal, as they are stored once (e.g. a module "
            "left out of tensor parallelism got different updates on different tp ranks); no "
            "snapshot was taken"
        )


def _own_bytes(info: Mapping[str, Any], replicated: Mapping[str, Desc]) -> int:
    """A rank's bytes of its own once ``replicated`` is applied (as ``settle`` does): what it
    placed, less what became replicated, plus what it marked that is not, plus the copies of
    tied leaves whose tie is split."""
    total: int = info["own_bytes"]
    for logical, (desc, _) in info["prints"].items():
        if logical in replicated:
            if desc.alias is None:
                total -= sum(desc.sizes)
        elif desc.alias in replicated:
            total += sum(desc.sizes)
    for logical, desc in info["marked"].items():
        if logical not in replicated and (desc.alias is None or desc.alias in replicated):
            total += sum(desc.sizes)
    return total


def settle(
    collected: Collected,
    decision: Decision,
    rank_prefix: str,
    layout: Layout,
    stager: Stager,
) -> tuple[Placer, list[str]]:
    """Marks this rank's leaves replicated or not as decided, places its own payloads (a closed
    ``Placer`` under ``rank_prefix``), and leaves the replicated ones, in order, in
    ``collected.replicated``. Returns the placer and the paths of the replicated leaves. A tied
    leaf decided otherwise than the leaf it shares payloads with gets payloads of its own; the
    pieces of ``decision.copies`` are not written."""
    cut = len(rank_prefix)
    entries = collected.entries
    extra: list[Payload] = []
    paths: list[str] = []
    replicated = decision.replicated
    dropped = _drop_copies(entries, decision.copies)
    for path, e in entries.items():
        logical = path[cut:]
        mine = logical in replicated
        if mine:
            paths.append(path)
        if isinstance(e, WholeTensor):
            e.replicated = mine
        elif isinstance(e, TensorDraft):
            e.replicated = mine
            if e.payloads[0].label == path:
                for p in e.payloads:
                    p.replicated = mine
            elif e.payloads[0].replicated != mine:  # a tie split by the decision
                e.payloads = [_copy(p, logical, path, mine) for p in e.payloads]
                extra.extend(e.payloads)
        elif isinstance(e, ObjectDraft):
            e.replicated = e.payload.replicated = mine
        elif isinstance(e, (PrimitiveEntry, TensorEntry)) and e.replicated != mine:
            entries[path] = dataclasses.replace(e, replicated=mine)
    own = Placer(rank_prefix, layout, mine=True, stager=stager)
    shared: list[Payload] = []
    own_bytes = 0
    seen: set[int] = dropped  # a dropped copy is neither placed nor shared
    for p in itertools.chain(collected.payloads, collected.replicated, extra):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.replicated:
            shared.append(p)
        else:
            own_bytes += p.nbytes
            own.place(p)
    own.close()
    collected.replicated = shared
    collected.own_bytes = own_bytes
    return own, paths


def _drop_copies(entries: Mapping[str, Any], copies: frozenset[str]) -> set[int]:
    """Empties the ``ShardDraft`` of each of this rank's ``copies`` (its entry lists no shard
    of its own, as a replica's); returns the ids of the payloads no other leaf shares (tied to
    the same memory), which are not written."""
    mine = [entries[p] for p in copies if isinstance(entries.get(p), ShardDraft)]
    if not mine:
        return set()
    dropped: set[int] = set()
    for draft in mine:
        for _, t in draft.written:
            dropped.update(id(p) for p in _payloads(t))
        draft.written = []
    for e in entries.values():  # a payload another leaf still needs stays
        if isinstance(e, ShardDraft):
            for _, t in e.written:
                dropped.difference_update(id(p) for p in _payloads(t))
        elif isinstance(e, (TensorDraft, WholeTensor)):
            dropped.difference_update(id(p) for p in _payloads(e))
    return dropped


def _payloads(t: Any) -> list[Payload]:
    """A dense draft's payloads: a ``WholeTensor`` is its own; an entry has none."""
    if isinstance(t, WholeTensor):
        return [t]
    return list(t.payloads) if isinstance(t, TensorDraft) else []


def _copy(p: Payload, logical: str, path: str, replicated: bool) -> Payload:
    """A payload of the same bytes as ``p``, of the leaf at ``path``."""
    if isinstance(p, WholeTensor):  # (its unused slots are unset)
        return Payload(logical, 0, p.nbytes, path, replicated, tensor=p.tensor, address=p.address)
    return Payload(
        logical, p.index, p.nbytes, path, replicated, tensor=p.tensor, address=p.address,
        data=p.data, source=p.source, start=p.start, stop=p.stop,
    )  # fmt: skip


def assign_writers(
    signature: Sequence[tuple[str, int, int, str]], local_bytes: Sequence[int]
) -> dict[tuple[str, int], int]:
    """Which rank writes each replicated payload: greedily, largest first, to the rank that has
    the fewest bytes to write so far (its own payloads included; ties go to the lower rank)."""
    load = list(local_bytes)
    writers: dict[tuple[str, int], int] = {}
    for logical, index, nbytes, _ in sorted(signature, key=lambda s: (-s[2], s[0], s[1])):
        rank = min(range(len(load)), key=lambda r: (load[r], r))
        writers[(logical, index)] = rank
        load[rank] += nbytes
    return writers
