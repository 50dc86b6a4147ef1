"""What a failed restore did to the live state, and the check of a snapshot's bytes before a
restore writes any of them.

A restore writes an app_state value's live state in two ways. Its reads land bytes in the
tensors the value's ``state_dict()`` returned, in place; those usually share memory with the
object (a module's state-dict tensors view its parameters, an optimizer's are its own state), so
a read modifies the object before its ``load_state_dict`` is called. Then ``load_state_dict``
replaces whatever it replaces. A read into a new tensor, and an object decoded from its bytes,
reach the object only through ``load_state_dict``.

``RestoreProgress`` records, per key, which of these has begun: a read request that writes into
one of the key's targets is marked when it starts (its bytes may land from then on, even when
its checksum then fails or the read is cut short), and a ``load_state_dict`` when it is called.
A key none of them reached is untouched: no byte of it was written. A tensor that two keys'
state dicts both hold (a weight tied across two values) is written through either, so a key
whose targets share memory with a written key's counts as written too. The error a failed
restore raises carries that account (``SnapshotError.modified`` / ``untouched``).

``check_needs`` makes the reads of ``Snapshot.restore(..., verify_first=True)``'s first pass:
every stored range that the restore's in-place reads take bytes from, read into pooled scratch
and compared with its recorded CRC-32 before any target is written.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from manifest import Entry, Location
from snapshot._engine.format.serialization import LocationCheck, WholeCheck
from snapshot._engine.io.pipeline import AnyReadRequest, DirectRequest, segment_owner
from snapshot._engine.restore.reads import Need
from snapshot.errors import SnapshotError
from snapshot.sharding.mapping import ShardedTensor

PARTIALLY = "partially"
FULLY = "fully"

# The pieces the check before a restore reads each range in. Small: scratch of this size comes
# from the allocator's heap and is reused from piece to piece, where pieces as long as a read
# request are mapped afresh and faulted in page by page. A read request still spans many
# pieces (``coalesce`` merges them), so a store sees requests of the usual length.
CHECK_PIECE_BYTES = 1 << 20


class RestoreProgress:
    """Per app_state key, whether the restore has begun to write its live state (see the
    module's docstring), and the account of it that a failed restore's error carries."""

    def __init__(self, app_state: Any) -> None:
        # A non-mapping app_state is refused before anything is read: there are no keys.
        self.keys: list[str] = list(app_state) if isinstance(app_state, Mapping) else []
        self.written: dict[str, str] = {}
        # Each key's restore targets, by path, once planned: what its reads write into.
        self.targets: dict[str, Mapping[str, Any]] = {}

    def wrote(self, key: str) -> None:
        """Bytes may land in ``key``'s targets from now on."""
        self.written.setdefault(key, PARTIALLY)

    def loading(self, key: str) -> None:
        """``key``'s state is being loaded (its ``load_state_dict`` is about to be called)."""
        self.written[key] = PARTIALLY

    def loaded(self, key: str) -> None:
        """``key``'s ``load_state_dict`` returned: it holds the snapshot's state."""
        self.written[key] = FULLY

    def watch(self, requests: Sequence[AnyReadRequest]) -> None:
        """Makes each request that writes into targets mark their keys when it starts.

        The scheduler calls a request's ``destinations()`` just before its read: a
        ``DirectRequest`` runs its ``starting`` first, a ``ReadRequest`` its segments' ``dest``
        in order, so the mark goes in front of the first segment's (a need: a request never
        starts with a gap). Only those requests are wrapped, not every need."""
        for req in requests:
            if type(req) is DirectRequest:
                if req.owners:
                    req.starting = functools.partial(self._mark, req.owners)
                continue
            owners = set(map(segment_owner, req.segments))
            owners.discard(None)
            if not owners:
                continue
            first = req.segments[0]
            assert first.dest is not None
            first.dest = functools.partial(self._starting, tuple(owners), first.dest)

    def _mark(self, keys: tuple[str, ...]) -> None:
        for key in keys:
            self.wrote(key)

    def _starting(self, keys: tuple[str, ...], dest: Callable[[], memoryview]) -> memoryview:
        self._mark(keys)
        return dest()

    def account(self, error: BaseException, rank: int, world_size: int) -> None:
        """Sets the account on ``error``: ``modified``, ``untouched`` and the sentence its
        message ends with on a ``SnapshotError``; that sentence as a note on any other."""
        if not self.keys:
            return
        written = self._with_shared_memory()
        modified = {k: written[k] for k in self.keys if k in written}
        untouched = tuple(k for k in self.keys if k not in written)
        where = f" on rank {rank}" if world_size > 1 else ""
        changed = ", ".join(f"{k!r} ({how})" for k, how in modified.items()) or "none"
        left = ", ".join(map(repr, untouched)) or "none"
        sentence = (
            f"app_state keys modified{where} before the failure: {changed}; untouched: {left}"
        )
        if isinstance(error, SnapshotError):
            error.modified = modified
            error.untouched = untouched
            error.restore_account = sentence
        else:
            error.add_note(sentence)

    def _with_shared_memory(self) -> dict[str, str]:
        """``written``, with each key whose targets share a storage with a written key's
        targets marked as partially written. Computed on failure only."""
        written = dict(self.written)
        if not written or len(written) == len(self.keys):
            return written
        memory = {k: _storages(t.values()) for k, t in self.targets.items()}
        reached = set().union(*(memory.get(k, set()) for k in written))
        for key, storages in memory.items():
            if key not in written and not storages.isdisjoint(reached):
                written[key] = PARTIALLY
        return written


def _storages(values: Iterable[Any]) -> set[tuple[str, int]]:
    """The storages (device, address) that tensors among ``values`` view, for a piece of a
    sharded tensor its local data's."""
    found: set[tuple[str, int]] = set()
    for value in values:
        for t in _local_tensors(value):
            try:
                address = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # no storage (a meta or fake tensor)
                continue
            if address:
                found.add((str(t.device), address))
    return found


def _local_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, ShardedTensor):
        return [] if value.data is None else [value.data]
    local_shards = getattr(value, "local_shards", None)  # torch's ShardedTensor
    if callable(local_shards):
        return [shard.tensor for shard in local_shards()]
    to_local = getattr(value, "to_local", None)  # a DTensor
    if callable(to_local):
        return [to_local()]
    return [value] if isinstance(value, torch.Tensor) else []


def locations_read(
    entries: Mapping[str, Entry], needs: Iterable[Need]
) -> list[tuple[str, Location]]:
    """Each stored range that holds bytes of ``needs``, once, with the path of the entry it
    belongs to: the whole range, even where a need reads part of it (a piece of a sharded
    tensor), since only the whole range has a recorded CRC-32."""
    index: dict[str, dict[str, tuple[list[int], list[Location]]]] = {}
    found: dict[tuple[str, int, int], tuple[str, Location]] = {}
    for need in needs:
        by_blob = index.get(need.label)
        if by_blob is None:
            by_blob = index[need.label] = _by_blob(entries[need.label].locations)
        starts, locs = by_blob[need.blob]
        loc = locs[bisect.bisect_right(starts, need.offset) - 1]
        found.setdefault((loc.blob, loc.offset, loc.nbytes), (need.label, loc))
    return list(found.values())


def _by_blob(locations: Iterable[Location]) -> dict[str, tuple[list[int], list[Location]]]:
    """An entry's locations per blob, sorted by offset (the ranges of one entry never overlap,
    so the last one starting at or before an offset is the one holding it)."""
    grouped: dict[str, list[Location]] = {}
    for loc in locations:
        grouped.setdefault(loc.blob, []).append(loc)
    out = {}
    for blob, locs in grouped.items():
        locs.sort(key=lambda loc: loc.offset)
        out[blob] = ([loc.offset for loc in locs], locs)
    return out


class ScratchKeeper:
    """Buffers the check reads land in: taken when a read is about to run, given back once it
    is done, and kept for the next read of the same size while ``keep_bytes`` allows (reused
    memory costs no page faults). Used on the I/O loop only."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[bytearray]] = {}
        self._kept = 0

    def take(self, nbytes: int) -> bytearray:
        free = self._free.get(nbytes)
        if free:
            self._kept -= nbytes
            return free.pop()
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        if self._kept + len(buf) <= self.keep_bytes:
            self._free.setdefault(len(buf), []).append(buf)
            self._kept += len(buf)


class _CheckRead:
    """What one check need does with its bytes: lands them in scratch (the read computes their
    CRC-32 as they land) and gives the scratch back."""

    __slots__ = ("buf", "nbytes", "scratch")

    def __init__(self, nbytes: int, scratch: ScratchKeeper) -> None:
        self.nbytes = nbytes
        self.scratch = scratch
        self.buf: bytearray | None = None

    def dest(self) -> memoryview:
        self.buf = self.scratch.take(self.nbytes)
        return memoryview(self.buf)

    def done(self) -> None:
        buf, self.buf = self.buf, None
        assert buf is not None
        self.scratch.give(buf)


def check_needs(
    ranges: Iterable[tuple[str, Location]], piece_bytes: int, scratch: ScratchKeeper
) -> list[Need]:
    """Needs that read each range in pieces of at most ``piece_bytes`` into ``scratch`` and
    compare the range's bytes with its recorded CRC-32 (a range without one is read all the
    same: that it exists and is that long is what can be checked)."""
    needs: list[Need] = []
    for path, loc in ranges:
        count = -(-loc.nbytes // piece_bytes)
        check: WholeCheck | LocationCheck | None = None
        if loc.crc32 is not None:
            check = WholeCheck(path, loc) if count == 1 else LocationCheck(path, loc, count)
        for lo in range(0, loc.nbytes, piece_bytes):
            n = min(piece_bytes, loc.nbytes - lo)
            read = _CheckRead(n, scratch)
            verify = None
            if isinstance(check, LocationCheck):
                verify = functools.partial(check.add, lo, n)
            elif check is not None:
                verify = check
            needs.append(
                Need(
                    blob=loc.blob,
                    offset=loc.offset + lo,
                    nbytes=n,
                    dest=read.dest,
                    done=read.done,
                    scratch_bytes=n,
                    label=path,
                    verify=verify,
                )
            )
    return needs
