"""Which values of a take across ranks are one value, written once and readable by any rank.

A leaf of the state (a tensor, an object, a primitive) is *replicated* when the ranks agree it
is the same everywhere. Two things make it so, decided from facts every rank gathers from every
rank, so that every rank reaches the same answer:

- the ``replicated`` globs (and the ``<key>/**`` a ``DistributedDataParallel`` module adds): a
  leaf is replicated when *every* rank's globs match it (the intersection across ranks, as
  torchsnapshot does). Such leaves must have the same kind, dtype and shape everywhere (else
  every rank raises the same error); their bytes are not compared: the user said they are equal.
- equal bytes: every other leaf that is not a piece of a sharded value is described
  (``describe``: its kind, dtype, shape and payload sizes, and the CRC-32 of its bytes, or a
  primitive's exact value) for the take's first agreement. The leaves whose description is the
  same on every rank are candidates; those holding bytes are confirmed by a second digest,
  BLAKE2b, exchanged at one more agreement (``strong_digests``, ``Pending.confirm``), run only
  when there are candidates to confirm. The optimizer state of a DDP job, a ``step`` counter,
  ``param_groups``: everything the ranks hold in common is then stored once, and a rank the
  snapshot did not have (restoring on more ranks) can read it.

A replicated leaf is written by one rank (``take.assign_writers`` balances them) and listed
once in the manifest, under rank 0's prefix (``Manifest.view`` shows it under every rank's).

Only a take across ranks runs any of this (a process alone has nothing to compare with, and
its take plans and writes exactly as before).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

from manifest import PrimitiveEntry, TensorEntry
from snapshot._engine import runtime
from snapshot._engine.format.checksum import combine, crc32
from snapshot._engine.format.serialization import ADDRESS_SPACE, gather_elements
from snapshot._engine.take.plan import (
    Collected,
    Layout,
    ObjectDraft,
    Payload,
    Placer,
    Stager,
    TensorDraft,
    WholeTensor,
)
from snapshot.errors import SnapshotError

_T = TypeVar("_T")

# ---------------------------------------------------------------------------------------------
# Digests.
#
# A false match (two ranks' bytes differ, their digests do not) would make one rank's value
# silently restore as another's, so the digest must make that as unlikely as a random 64-bit
# collision or better: it is the CRC-32 of the bytes (ISA-L's, as everywhere in the library)
# and 64 bits of BLAKE2b, 96 bits in all. BLAKE2b, a cryptographic hash, makes any two
# different inputs collide with probability about 2^-64 on its own; the CRC, a linear code,
# adds certainty for small differences (every difference of at most 3 bits, or within 32
# consecutive bits, changes it). The CRC (ISA-L's) runs many times faster than BLAKE2b.
# Weaker second digests were refused: Adler-32 sums bytes modulo 65521, so it cannot tell
# permuted bytes apart and spreads poorly below a few MiB (two random 10 KiB buffers share its
# first half with probability about 2^-15); a second CRC with another polynomial would do, but
# neither ISA-L's package nor the standard library has one; xxh3-128 would need the ``xxhash``
# package, a new dependency.
#
# So the two are taken in turn: the CRC of every candidate leaf (nearly free) travels with the
# first agreement, and BLAKE2b is computed only for the leaves whose CRCs (and kinds, shapes)
# are the same on every rank. State that differs per rank (each rank's own optimizer shard)
# then costs a pass of the CRC over its bytes, not BLAKE2b's; state the ranks share costs
# BLAKE2b once, and is then written once instead of once per rank. BLAKE2b drops the GIL for
# inputs above 2 KiB: a large tensor is digested in pieces of ``_PIECE`` bytes on up to
# ``_THREADS`` threads at once (a hash tree: the digest of the pieces' digests, which depends on
# the bytes only, not on how a rank holds them: one contiguous tensor, chunks, a strided view, a
# device), small ones in batches on the same threads.

_PIECE = 4 << 20  # a multiple of every dtype's size: pieces hold whole elements
_THREADS = max(1, min(8, os.cpu_count() or 1))

# A batch of small digests handed to a thread: large enough that handing it over (a future, a
# wake-up) is small beside the work, small enough that the threads share the work evenly.
_BATCH_BYTES = 1 << 20
_BATCH_ITEMS = 256

# Where a leaf's bytes are, to read them again for a digest: ("memory", address, nbytes) of a
# contiguous CPU tensor (alive as long as the take's plan), ("bytes", data), or ("tensor", t)
# of one that must be gathered (strided, on a device, conjugate or negated).
Source = tuple[Any, ...]


def _executor() -> ThreadPoolExecutor:
    """The digest threads: the process's runtime holds them."""
    return runtime.get().digest_pool(_THREADS)


def _view(address: int, nbytes: int) -> memoryview:
    return ADDRESS_SPACE[address - 1 : address - 1 + nbytes] if nbytes else memoryview(b"")


def _nbytes(src: Source) -> int:
    if src[0] == "memory":
        return int(src[2])
    if src[0] == "bytes":
        return len(src[1])
    t = src[1]
    return int(t.numel() * t.element_size())


def _map_pieces(src: Source, fn: Callable[[memoryview], _T]) -> list[tuple[_T, int]]:
    """``fn`` of each consecutive piece of ``_PIECE`` bytes of the source (the last one
    shorter), with the piece's length; on the threads when there are several pieces. A tensor
    to gather is gathered one piece at a time per thread (at most ``_THREADS`` pieces exist at
    once: no copy of the whole tensor). On a CUDA tensor, ``gather_elements`` copies each piece
    from the device (synchronously, on the current stream): only a run on a machine with a GPU
    proves that path; on the CPU the same lines gather strided pieces."""
    nbytes = _nbytes(src)
    bounds = [(lo, min(nbytes, lo + _PIECE)) for lo in range(0, nbytes, _PIECE)] or [(0, 0)]
    piece: Callable[[tuple[int, int]], _T]
    if src[0] == "memory":
        address = src[1]

        def piece(b: tuple[int, int]) -> _T:
            return fn(_view(address + b[0], b[1] - b[0]))

    elif src[0] == "bytes":
        data = memoryview(src[1])

        def piece(b: tuple[int, int]) -> _T:
            return fn(data[b[0] : b[1]])

    else:
        t = src[1].detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if t.is_cpu and t.is_contiguous():  # resolved into memory of its own
            results = _map_pieces(("memory", t.data_ptr(), nbytes), fn)
            del t
            return results
        itemsize = t.element_size()

        def piece(b: tuple[int, int]) -> _T:
            part = gather_elements(t, b[0] // itemsize, b[1] // itemsize)  # contiguous, CPU
            return fn(_view(part.data_ptr(), b[1] - b[0]))

    sizes = [hi - lo for lo, hi in bounds]
    if len(bounds) == 1:
        return [(piece(bounds[0]), sizes[0])]
    return list(zip(_executor().map(piece, bounds), sizes, strict=True))


def crc_of(src: Source) -> int:
    """The CRC-32 of a source's bytes."""
    if src[0] == "memory" and src[2] <= _PIECE:  # most leaves
        return crc32(_view(src[1], src[2]))
    crc = 0
    for c, n in _map_pieces(src, crc32):
        crc = combine(crc, c, n)
    return crc


def _blake8(view: memoryview) -> bytes:
    return hashlib.blake2b(view, digest_size=8).digest()


def _blake16(view: memoryview) -> bytes:
    return hashlib.blake2b(view, digest_size=16).digest()


def strong_of(src: Source) -> bytes:
    """64 bits of the BLAKE2b of a source's bytes: of the bytes themselves up to ``_PIECE``,
    else of the 128-bit BLAKE2b digests of its pieces (a hash tree, personalized apart; the
    length decides which applies, so the two forms never meet)."""
    if _nbytes(src) <= _PIECE:
        return _map_pieces(src, _blake8)[0][0]
    pieces = b"".join(h for h, _ in _map_pieces(src, _blake16))
    return hashlib.blake2b(pieces, digest_size=8, person=b"statesnap-tree").digest()


def _strong_batch(ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    return [_blake8(_view(a, n)) for a, n in ranges]


def joined(sources: Mapping[str, Source], paths: Sequence[str]) -> bytes:
    """``strong_digests`` of ``paths``, joined in their order: 8 bytes each, what a rank sends
    (every rank knows the same ``paths``, so the digests need no names)."""
    digests = strong_digests(sources, paths)
    return b"".join(digests[p] for p in paths)


def strong_digests(sources: Mapping[str, Source], paths: Sequence[str]) -> dict[str, bytes]:
    """``strong_of`` the source of each of ``paths``: small ones in memory in batches of about
    ``_BATCH_BYTES`` on the threads (BLAKE2b drops the GIL for more than 2 KiB, so a state of
    many small tensors is digested by several cores too), the others one by one (their pieces
    on the threads)."""
    out: dict[str, bytes] = {}
    small: list[str] = []
    batches: list[list[tuple[int, int]]] = [[]]
    size = 0
    for path in paths:
        src = sources[path]
        if src[0] == "memory" and src[2] <= _PIECE:
            if size >= _BATCH_BYTES or len(batches[-1]) >= _BATCH_ITEMS:
                batches.append([])
                size = 0
            batches[-1].append((src[1], src[2]))
            size += src[2]
            small.append(path)
        else:
            out[path] = strong_of(src)
    if len(batches) == 1:
        digests = _strong_batch(batches[0])
    else:
        digests = [d for part in _executor().map(_strong_batch, batches) for d in part]
    out.update(zip(small, digests, strict=True))
    return out


# ---------------------------------------------------------------------------------------------
# What each rank says about its leaves.


class Desc(NamedTuple):
    """What must be equal on every rank for a leaf to be one value: its kind (``float32[4,
    4]``, ``object torch_save dict``, ``primitive``), the sizes of its payloads in order (how it
    is chunked: every rank must place the same payloads), and the path of the earlier leaf
    whose payloads it shares (tied weights: the same memory under two paths), or None."""

    kind: str
    sizes: tuple[int, ...]
    alias: str | None


@dataclasses.dataclass
class Facts:
    """What ``describe`` found, by logical path (without the rank): ``marked``, each leaf a
    glob marked replicated; ``prints``, each other leaf that may be one value across ranks,
    with its ``Desc`` and a check: the CRC-32 of its bytes (an int; BLAKE2b confirms a match
    later), or a final value (a tuple: a primitive's exact value, an empty tensor's nothing;
    None for a leaf tied to another); ``sources``, where each leaf with a CRC has its bytes
    (kept on this rank, not sent)."""

    marked: dict[str, Desc]
    prints: dict[str, tuple[Desc, Any]]
    sources: dict[str, Source]


def describe(collected: Collected, rank_prefix: str) -> Facts:
    """This rank's facts for the first agreement (paths relative to ``rank_prefix``). Pieces
    of sharded tensors and sharded objects are not described (each rank writes its own piece);
    nor are tensors given to a custom prepare function (the bytes written are the function's,
    and it is called only once per tensor, when writing)."""
    cut = len(rank_prefix)
    marked: dict[str, Desc] = {}
    prints: dict[str, tuple[Desc, Any]] = {}
    sources: dict[str, Source] = {}
    kinds: dict[tuple[str, tuple[int, ...]], str] = {}  # "float32[4, 4]" by (dtype, shape)
    for path, e in collected.entries.items():
        kind = type(e)
        logical = path[cut:]
        if kind is WholeTensor:  # most leaves
            name = kinds.get((e.dtype, e.shape))
            if name is None:
                name = kinds[(e.dtype, e.shape)] = f"{e.dtype}{list(e.shape)}"
            desc = Desc(name, (e.nbytes,), None)
            if e.replicated:
                marked[logical] = desc
            else:
                src = sources[logical] = ("memory", e.address, e.nbytes)
                prints[logical] = (desc, crc_of(src))
        elif kind is TensorDraft:
            payloads = e.payloads
            first = payloads[0]
            alias = first.label[cut:] if first.label != path else None
            desc = Desc(f"{e.dtype}{list(e.shape)}", tuple(p.nbytes for p in payloads), alias)
            if e.replicated:
                marked[logical] = desc
            elif alias is not None:
                # The same memory as ``alias``: equal on every rank when that one is.
                prints[logical] = (desc, None)
            else:
                src = _tensor_source(payloads)
                if src is not None:
                    try:
                        prints[logical] = (desc, crc_of(src))
                        sources[logical] = src
                    except RuntimeError:
                        # Cannot be read here (a dtype without a copy kernel, a device that
                        # refuses): it stays the rank's own; staging reports any problem.
                        pass
        elif kind is ObjectDraft:
            p = e.payload
            desc = Desc(f"object {e.serializer} {e.obj_type}", (p.nbytes,), None)
            if e.replicated:
                marked[logical] = desc
            else:
                src = sources[logical] = ("bytes", p.data)
                prints[logical] = (desc, crc_of(src))
        elif kind is PrimitiveEntry:
            desc = Desc("primitive", (), None)
            if e.replicated:
                marked[logical] = desc
            else:
                # repr is exact: it tells 1 from True and 1.0, -0.0 from 0.0, finds nan equal to
                # nan, and is what the manifest stores of a float.
                value = e.value
                prints[logical] = (desc, (type(value).__name__, repr(value)))
        elif kind is TensorEntry and not e.chunks:  # an empty tensor, stored inline
            desc = Desc(f"{e.dtype}{list(e.shape)}", (), None)
            if e.replicated:
                marked[logical] = desc
            else:
                prints[logical] = (desc, ())
    return Facts(marked, prints, sources)


def _tensor_source(payloads: Sequence[Payload]) -> Source | None:
    """Where the bytes of a tensor written in several payloads are (a large one's chunks, or a
    tensor whose bytes are gathered); None when it is not to be compared (a custom prepare
    function writes other bytes)."""
    first = payloads[0]
    if first.tensor is not None:  # chunks of a contiguous CPU tensor: one run of memory
        return ("memory", first.address, sum(p.nbytes for p in payloads))
    source = first.source
    if source is None or source.prepare is not None:
        return None
    return ("tensor", source.tensor)


# ---------------------------------------------------------------------------------------------
# The decision, the same on every rank.


@dataclasses.dataclass
class Decision:
    """What the agreements decided: the replicated leaves (logical path -> rank 0's ``Desc``,
    in rank 0's order), the replicated payloads for ``plan.assign_writers``, and each rank's
    bytes of its own once the decision is applied (to balance the writers)."""

    replicated: dict[str, Desc]
    signature: list[tuple[str, int, int, str]]
    local_bytes: list[int]


@dataclasses.dataclass
class Pending:
    """The first agreement's answer: the leaves replicated if ``to_confirm`` (those whose CRCs
    matched) are confirmed by their BLAKE2b on every rank (``confirm``)."""

    replicated: dict[str, Desc]
    to_confirm: list[str]
    infos: Sequence[Mapping[str, Any]]

    def confirm(self, digests: Sequence[bytes] | None) -> Decision:
        """The ``Decision``, given every rank's ``strong_digests`` of ``to_confirm`` joined in
        that order (``joined``; None when there is nothing to confirm)."""
        replicated = dict(self.replicated)
        if digests:
            first = digests[0]
            for i, logical in enumerate(self.to_confirm):
                mine = first[8 * i : 8 * i + 8]
                if any(d[8 * i : 8 * i + 8] != mine for d in digests[1:]):
                    del replicated[logical]
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
        return Decision(
            replicated, signature, [_own_bytes(info, replicated) for info in self.infos]
        )


def decide(where: str, infos: Sequence[Mapping[str, Any]]) -> Pending:
    """Every rank's ``marked``, ``prints`` (``Facts``) and ``own_bytes`` (the bytes of the
    payloads it placed as its own) -> what is replicated, pending the confirmation of the
    leaves whose CRCs matched.

    Raises:
        SnapshotError: a leaf every rank marked replicated differs in kind, dtype, shape or
            size between rank 0 and another rank (naming both, and the path).
    """
    first = infos[0]
    replicated: dict[str, Desc] = {}
    # Marked on every rank: the intersection of the ranks' globs.
    for logical, desc in first["marked"].items():
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
    # The same description on every rank: a final value, or a CRC to confirm.
    to_confirm = []
    for logical, fp in first["prints"].items():
        if all(info["prints"].get(logical) == fp for info in infos[1:]):
            replicated[logical] = fp[0]
            if type(fp[1]) is int:
                to_confirm.append(logical)
    return Pending(replicated, to_confirm, infos)


def _own_bytes(info: Mapping[str, Any], replicated: Mapping[str, Desc]) -> int:
    """A rank's bytes of its own once ``replicated`` is applied (``settle`` does the same to
    the payloads): what it placed as its own, less what became replicated, plus what it had
    marked that is not (another rank's globs did not match it), plus the copies of tied leaves
    whose tie is split."""
    total = info["own_bytes"]
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


# ---------------------------------------------------------------------------------------------
# Applying it to this rank's plan.


def settle(
    collected: Collected,
    replicated: Mapping[str, Desc],
    rank_prefix: str,
    layout: Layout,
    stager: Stager,
) -> tuple[Placer, list[str]]:
    """Marks this rank's leaves replicated or not as decided, places its own payloads (a
    ``Placer`` under ``rank_prefix``, closed), and leaves the replicated ones, in order, in
    ``collected.replicated`` for ``plan.place``. Returns the placer and the paths (with the
    rank prefix) of the replicated leaves.

    A leaf that shares an earlier leaf's payloads (tied weights) but was decided otherwise than
    that one gets payloads of its own (the same memory, written twice)."""
    cut = len(rank_prefix)
    entries = collected.entries
    extra: list[Payload] = []
    paths: list[str] = []
    for path, e in entries.items():
        kind = type(e)
        logical = path[cut:]
        mine = logical in replicated
        if mine:
            paths.append(path)
        if kind is WholeTensor:
            e.replicated = mine
        elif kind is TensorDraft:
            payloads = e.payloads
            e.replicated = mine
            if payloads[0].label == path:
                for p in payloads:
                    p.replicated = mine
            elif payloads[0].replicated != mine:  # a tie split by the decision
                e.payloads = [_copy(p, logical, path, mine) for p in payloads]
                extra.extend(e.payloads)
        elif kind is ObjectDraft:
            e.replicated = e.payload.replicated = mine
        elif (kind is PrimitiveEntry or kind is TensorEntry) and e.replicated != mine:
            entries[path] = dataclasses.replace(e, replicated=mine)
    own = Placer(rank_prefix, layout, mine=True, stager=stager)
    shared: list[Payload] = []
    own_bytes = 0
    seen: set[int] = set()
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


def _copy(p: Payload, logical: str, path: str, replicated: bool) -> Payload:
    """A payload of the same bytes as ``p``, of the leaf at ``path``."""
    if type(p) is WholeTensor:
        return Payload(logical, 0, p.nbytes, path, replicated, tensor=p.tensor, address=p.address)
    return Payload(
        logical,
        p.index,
        p.nbytes,
        path,
        replicated,
        tensor=p.tensor,
        address=p.address,
        data=p.data,
        source=p.source,
        start=p.start,
        stop=p.stop,
    )
