"""Checks of a snapshot's bytes before a restore takes memory for them or writes them: the sizes
a manifest claims against the blobs present (``check_claims``), and the reads of
``verify_first``'s first pass (``check_needs``).

A read into new memory (an object's buffer, a tensor read into no target) takes the size the
manifest records, which a forged manifest can set to anything: the store is asked each blob's
size first. Reads into the caller's tensors take no such memory (their sizes are checked
against the targets), and every blob read is compared with the manifest after the reads.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from manifest import Entry, Location, is_container, reference_of
from snapshot._engine.format.manifest_io import open_linked
from snapshot._engine.handlers import for_entry
from snapshot._engine.io.storage_calls import call
from snapshot._engine.restore.reads import Need, label_of, pieces
from snapshot._engine.runtime import run
from snapshot.errors import CorruptSnapshotError
from snapshot.options import Options
from snapshot.sharding.mapping import LocalNonpersistentObject
from storage_plugins import StoragePlugin

if TYPE_CHECKING:
    from snapshot._engine.restore.loader import Loader

# Reads into new memory that claim no more than this in all are planned without asking the
# store (a small read_object would pay a request per blob); past it, each claim is asked about.
UNCHECKED_BYTES = 64 << 20

# The pieces the check before a restore reads each range in: small scratch, reused.
CHECK_PIECE_BYTES = 1 << 20


def allocates(entry: Entry, target: Any) -> bool:
    """Whether reading ``entry`` into ``target`` takes memory of the size the manifest records."""
    if not entry.locations or isinstance(target, LocalNonpersistentObject):
        return False  # stored inline, or never read (the restoring rank's own object)
    kind = for_entry(entry)
    return kind is None or kind.allocates(entry, target)


def claimed_blobs(
    entries: Mapping[str, Entry], paths: Iterable[str], targets: Mapping[str, Any]
) -> tuple[dict[str, set[str]], int]:
    """The blobs that reading ``paths`` into ``targets`` allocates for, with the paths reading
    each; and the bytes claimed."""
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
    """Refuses an entry two of whose ranges share a byte (a read would allocate more than the
    blobs hold)."""
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


async def check_blob_sizes(
    plugin: StoragePlugin,
    paths: Mapping[str, Iterable[str]],
    expected: Mapping[str, int],
    jobs: int,
    options: Options,
    *,
    before: bool = False,
) -> None:
    """Asks the size of each blob of ``paths`` (blob -> the entries reading it), ``jobs`` at a
    time: fails on one shorter than ``expected``, or after the reads (not ``before``) longer,
    but for a base's."""
    blobs = iter(paths.items())

    async def worker() -> None:
        for blob, readers in blobs:
            label = label_of(readers)
            ask = functools.partial(plugin.size, blob)
            size = await call(plugin, "read", blob, label, ask, options=options)
            want = expected[blob]
            if size is None or size == want:
                continue
            if size > want and (before or reference_of(blob) is not None):
                continue
            how = "longer" if size > want else "shorter"
            raise CorruptSnapshotError(
                f"{label}: blob {plugin.describe(blob)} is {how} than the manifest says "
                f"({size:,} bytes; the manifest's last range in it ends at {want:,})"
                + (", found before reading" if before else "")
            )

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(jobs, len(paths)))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:  # the others stop asking: the plugin is about to be closed
            task.cancel()
        raise


def check_claims(loader: Loader, paths: Iterable[str], targets: Mapping[str, Any]) -> None:
    """Checks the claims of the reads of ``paths`` into new memory once the loader's reads
    planned without asking pass ``UNCHECKED_BYTES``: ``CorruptSnapshotError`` for a claimed
    blob shorter than the manifest says (``loader.checked_blobs``: those asked about already)."""
    claims, claimed = claimed_blobs(loader.entries, paths, targets)
    checked = loader.checked_blobs
    fresh = {blob: paths for blob, paths in claims.items() if blob not in checked}
    if not fresh:
        return
    if loader.unchecked_bytes + claimed <= UNCHECKED_BYTES:
        loader.unchecked_bytes += claimed
        return
    manifest, options = loader.manifest, loader.options
    with open_linked(loader.where, manifest, loader.storage_options, options) as plugin:
        sizes = check_blob_sizes(
            plugin, fresh, manifest.blob_sizes, loader.concurrency, options, before=True
        )
        run(sizes)
    checked.update(fresh)


# ---------------------------------------------------------------------------------------------
# verify_first: every stored range the in-place reads take bytes from, read into scratch and
# compared with its recorded CRC-32 before any target is written.


def locations_read(
    entries: Mapping[str, Entry], needs: Iterable[Need]
) -> list[tuple[str, Location]]:
    """Each stored range holding bytes of ``needs``, once, whole (the unit of a CRC-32), with
    its entry's path."""
    index: dict[str, tuple[list[tuple[str, int]], list[Location]]] = {}
    found: dict[tuple[str, int, int], tuple[str, Location]] = {}
    for need in needs:
        by_start = index.get(need.label)
        if by_start is None:  # the entry's ranges by (blob, offset)
            locs = sorted(entries[need.label].locations, key=lambda loc: (loc.blob, loc.offset))
            by_start = index[need.label] = ([(loc.blob, loc.offset) for loc in locs], locs)
        starts, locs = by_start
        loc = locs[bisect.bisect_right(starts, (need.blob, need.offset)) - 1]
        found.setdefault((loc.blob, loc.offset, loc.nbytes), (need.label, loc))
    return list(found.values())


def _scratch(nbytes: int) -> memoryview:
    return memoryview(bytearray(nbytes))


def check_needs(ranges: Iterable[tuple[str, Location]], piece_bytes: int) -> list[Need]:
    """Needs that read each range in pieces of at most ``piece_bytes`` into scratch (charged
    to the budget until the piece is checked) and compare its bytes with its recorded CRC-32
    (a range without one is read all the same)."""
    return [
        Need(
            blob=loc.blob,
            offset=loc.offset + lo,
            nbytes=n,
            dest=functools.partial(_scratch, n),
            done=None,
            scratch_bytes=n,
            label=path,
            verify=check,
        )
        for path, loc in ranges
        for lo, n, check in pieces(path, loc, piece_bytes, True)
    ]
