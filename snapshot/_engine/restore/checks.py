"""Checks of a snapshot's bytes before a restore takes memory for them or writes them: the sizes
a manifest claims against the blobs present (``ClaimCheck``), and the reads of
``verify_first``'s first pass (``check_needs``).

A read that makes new memory for an entry (an object's buffer, a tensor read into no target)
takes the size the manifest records, and a damaged or forged manifest can claim any size. So
before such reads are planned the store is asked the size of each blob they touch, and a blob
shorter than the manifest's last range in it is a ``CorruptSnapshotError`` before anything is
allocated. Reads into the caller's tensors take no memory sized by the manifest: their byte
counts are checked against the targets, and every blob read is compared with the manifest
after the reads.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from manifest import Entry, Location, Manifest, ShardedTensorEntry, TensorEntry, is_container
from snapshot._engine.format.checksum import LocationCheck, WholeCheck
from snapshot._engine.format.manifest_io import open_linked
from snapshot._engine.handlers import sharded
from snapshot._engine.handlers.dense import is_dense_tensor
from snapshot._engine.io.io_loop import run
from snapshot._engine.io.storage_calls import call
from snapshot._engine.restore.reads import Need, label_of
from snapshot.errors import CorruptSnapshotError
from snapshot.options import Options
from snapshot.sharding.mapping import LocalNonpersistentObject
from storage_plugins import StoragePlugin

# Reads into new memory that claim no more than this in all are planned without asking the
# store (a small read_object would pay a request per blob); past it, each claim is asked about.
UNCHECKED_BYTES = 64 << 20

# The pieces the check before a restore reads each range in: small scratch, reused.
CHECK_PIECE_BYTES = 1 << 20


def allocates(entry: Entry, target: Any) -> bool:
    """Whether reading ``entry`` into ``target`` (None: no target) takes memory of the size the
    manifest records for it."""
    if not entry.locations or isinstance(target, LocalNonpersistentObject):
        return False  # stored inline, or never read (the restoring rank's own object)
    if isinstance(entry, (TensorEntry, ShardedTensorEntry)):
        return not (is_dense_tensor(target) or sharded.is_sharded(target))
    return True  # objects and pickled tensors: their bytes land in buffers of their length


def claimed_blobs(
    entries: Mapping[str, Entry], paths: Iterable[str], targets: Mapping[str, Any]
) -> tuple[dict[str, set[str]], int]:
    """The blobs that reading the entries at ``paths`` into ``targets`` allocates for, each
    with the paths that read it; and the bytes those entries claim."""
    claims: dict[str, set[str]] = {}
    claimed = 0
    for path in paths:
        entry = entries.get(path)
        if entry is None or is_container(entry) or not allocates(entry, targets.get(path)):
            continue  # a missing entry is reported by the planning that follows
        if len(entry.locations) > 1:
            check_disjoint(path, entry.locations)
        for loc in entry.locations:
            claims.setdefault(loc.blob, set()).add(path)
            claimed += loc.nbytes
    return claims, claimed


def check_disjoint(path: str, locations: Sequence[Location]) -> None:
    """Refuses an entry two of whose ranges share a byte: a snapshot stores each byte of a value
    once, and repeated ranges would make a read allocate more than the blobs hold."""
    blob, end = None, 0
    for loc in sorted(locations, key=lambda loc: (loc.blob, loc.offset)):
        if loc.blob != blob:
            blob, end = loc.blob, 0
        if loc.nbytes and loc.offset < end:
            raise CorruptSnapshotError(
                f"{path}: two of its stored ranges in blob {loc.blob} overlap (one ends at "
                f"{end:,}, the next starts at {loc.offset:,}); a snapshot stores each byte of a "
                "value once"
            )
        end = max(end, loc.offset + loc.nbytes)


async def check_claims(
    plugin: StoragePlugin,
    claims: Mapping[str, set[str]],
    expected: Mapping[str, int],
    jobs: int,
    options: Options,
) -> None:
    """Asks the size of each blob in ``claims``, ``jobs`` at a time, and fails on the first
    shorter than ``expected[blob]``. A store that cannot tell a size passes."""
    blobs = iter(claims.items())

    async def worker() -> None:
        for blob, paths in blobs:
            label = label_of(paths)
            size = await call(
                plugin, "read", blob, label, functools.partial(plugin.size, blob), options=options
            )
            want = expected[blob]
            if size is not None and size < want:
                raise CorruptSnapshotError(
                    f"{label}: blob {plugin.describe(blob)} is shorter than the manifest says "
                    f"({size:,} bytes; the manifest's last range in it ends at {want:,}), "
                    "found before reading"
                )

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(jobs, len(claims)))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # the others stop asking: the plugin is about to be closed
            task.cancel()
        raise


@dataclass
class ClaimCheck:
    """The claims of a loader's reads that allocate, checked against the sizes the store at
    ``url`` gives once they add up to more than ``UNCHECKED_BYTES``; each blob asked once."""

    manifest: Manifest
    url: str
    storage_options: dict[str, Any] | None
    options: Options
    checked: set[str] = field(default_factory=set)
    unchecked_bytes: int = 0  # claimed by the reads planned without asking

    def check(
        self, entries: Mapping[str, Entry], paths: Iterable[str], targets: Mapping[str, Any]
    ) -> None:
        """Raises ``CorruptSnapshotError`` when a blob that reading the entries at ``paths``
        into ``targets`` allocates for is shorter than the manifest says."""
        claims, claimed = claimed_blobs(entries, paths, targets)
        fresh = {blob: paths for blob, paths in claims.items() if blob not in self.checked}
        if not fresh:
            return
        if self.unchecked_bytes + claimed <= UNCHECKED_BYTES:
            self.unchecked_bytes += claimed
            return
        with open_linked(self.url, self.manifest, self.storage_options, self.options) as plugin:
            jobs = self.options.max_concurrent_io
            assert jobs is not None
            run(check_claims(plugin, fresh, self.manifest.blob_sizes, jobs, self.options))
        self.checked.update(fresh)


# ---------------------------------------------------------------------------------------------
# verify_first: every stored range the in-place reads take bytes from, read into scratch and
# compared with its recorded CRC-32 before any target is written.


def locations_read(
    entries: Mapping[str, Entry], needs: Iterable[Need]
) -> list[tuple[str, Location]]:
    """Each stored range that holds bytes of ``needs``, once, with its entry's path: the whole
    range, even where a need reads part of it, since only the whole has a recorded CRC-32."""
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
    """An entry's locations per blob, sorted by offset, with their offsets."""
    grouped: dict[str, list[Location]] = {}
    for loc in locations:
        grouped.setdefault(loc.blob, []).append(loc)
    out = {}
    for blob, locs in grouped.items():
        locs.sort(key=lambda loc: loc.offset)
        out[blob] = ([loc.offset for loc in locs], locs)
    return out


class ScratchKeeper:
    """Buffers the check reads land in, kept for the next read of the same size while
    ``keep_bytes`` allows. Used on the I/O loop only."""

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
    """One check need's scratch: taken when its read runs, given back once it is done."""

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
    compare its bytes with its recorded CRC-32 (a range without one is read all the same)."""
    needs: list[Need] = []
    for path, loc in ranges:
        count = -(-loc.nbytes // piece_bytes)
        check: WholeCheck | LocationCheck | None = None
        if loc.crc32 is not None:
            check = WholeCheck(path, loc) if count == 1 else LocationCheck(path, loc, count)
        for lo in range(0, loc.nbytes, piece_bytes):
            n = min(piece_bytes, loc.nbytes - lo)
            read = _CheckRead(n, scratch)
            verify: Callable[[int], None] | None = None
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
