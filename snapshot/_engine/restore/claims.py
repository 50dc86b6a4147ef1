"""The sizes a manifest claims, checked against the bytes present before any memory is taken
for them.

A manifest says how many bytes each entry holds, and a read that makes new memory for an entry
takes what the manifest says: an object's bytes (a buffer of its length), a tensor or sharded
tensor read into no target (a new tensor of its shape), a pickled tensor's pieces. A damaged or
forged manifest can claim any size, so before the reads of a subtree are planned, the store is
asked the size of each blob such reads would touch (one call per blob, a few at a time), and a
blob shorter than the manifest's last range in it is a ``CorruptSnapshotError`` before anything
is allocated. The memory a read then takes is bounded by bytes that exist. (Reads that claim
``UNCHECKED_BYTES`` in all, a small read_object, skip the question: they take no more than that
before a blob cut short fails its read.)

A read into a target the caller gives (a tensor, or a piece of a sharded one) takes no memory
sized by the manifest: the target's size is the caller's, and the stored byte count must match
it before any read (``reads.check_tensor_entry``, ``check_target``, ``sharded.check_region``).
A blob cut short then fails the read that reaches its end, and every blob read is compared with
the manifest after the reads; such reads make no extra call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from manifest import Entry, Location, Manifest, is_container
from snapshot._engine.handlers import for_entry
from snapshot._engine.io.io_loop import run
from snapshot._engine.io.storage_calls import call
from snapshot._engine.restore.linked import open_linked
from snapshot.errors import CorruptSnapshotError
from snapshot.options import Options
from snapshot.sharding.mapping import LocalNonpersistentObject
from storage_plugins import StoragePlugin


def allocates(entry: Entry, target: Any) -> bool:
    """Whether reading ``entry`` into ``target`` (None: no target) takes memory of the size the
    manifest records for it."""
    if not entry.locations or isinstance(target, LocalNonpersistentObject):
        return False  # stored inline, or never read (the restoring rank's own object)
    kind = for_entry(entry)
    return kind is None or kind.allocates(entry, target)


def claimed_blobs(
    entries: Mapping[str, Entry], paths: Iterable[str], targets: Mapping[str, Any]
) -> tuple[dict[str, set[str]], int]:
    """The blobs that reading the entries at ``paths`` into ``targets`` (by path) allocates
    for, each with the logical paths that read it; and the bytes those entries claim."""
    claims: dict[str, set[str]] = {}
    claimed = 0
    for path in paths:
        entry = entries.get(path)
        if entry is None or is_container(entry) or not allocates(entry, targets.get(path)):
            continue  # a missing entry is reported by the planning that follows
        locations = entry.locations
        if len(locations) > 1:
            check_disjoint(path, locations)
        for loc in locations:
            claims.setdefault(loc.blob, set()).add(path)
            claimed += loc.nbytes
    return claims, claimed


def check_disjoint(path: str, locations: Sequence[Location]) -> None:
    """Refuses an entry two of whose ranges share a byte. The writer stores each byte of a
    value once (a tensor's chunks are consecutive pieces of it, a sharded tensor's shards are
    boxes of their own), and ranges that repeat would make a read allocate more than the blobs
    hold: a thousand chunks over one megabyte are a gigabyte of tensor. Sorted by position,
    each range must start where the ranges before it in its blob have ended."""
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
    """Asks the size of each blob in ``claims`` (blob -> logical paths reading it), ``jobs`` at
    a time, and fails on the first shorter than ``expected[blob]`` (the end of the manifest's
    last range in it). A store that cannot tell a size passes. ``options``: each call's retries
    and deadline."""
    blobs = iter(claims.items())

    async def worker() -> None:
        for blob, paths in blobs:
            first = min(paths)  # named as a read of the blob names them (``needs_label``)
            label = first if len(paths) == 1 else f"{first} and {len(paths) - 1} more"
            size = await call(
                plugin, "read", blob, label, lambda b=blob: plugin.size(b), options=options
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


# Reads into new memory that claim no more than this in all are planned without asking the
# store first: what they may take before a blob cut short fails its read (and the size check
# after the reads) is bounded by this, while asking would cost every small read_object one more
# request per blob (a HEAD on S3, whose ranged GETs give the length anyway). Past it, each
# claim is asked about before anything is taken for it.
UNCHECKED_BYTES = 64 << 20


class ClaimCheck:
    """What a loader runs before it plans each subtree's reads (``check``): the claims of the
    reads that allocate, against the sizes the store at ``url`` gives, once the claims of the
    loader's reads add up to more than ``UNCHECKED_BYTES``. Each blob is asked about once,
    ``options.max_concurrent_io`` at a time."""

    def __init__(
        self,
        manifest: Manifest,
        url: str,
        storage_options: dict[str, Any] | None,
        options: Options,
    ):
        self.manifest = manifest
        self.url = url
        self.storage_options = storage_options
        self.options = options
        self.checked: set[str] = set()
        self.unchecked_bytes = 0  # claimed by the reads planned without asking

    def check(
        self, entries: Mapping[str, Entry], paths: Iterable[str], targets: Mapping[str, Any]
    ) -> None:
        """Raises ``CorruptSnapshotError`` when a blob that reading the entries at ``paths``
        into ``targets`` allocates for is shorter than the manifest says; opens the store only
        when some read allocates."""
        claims, claimed = claimed_blobs(entries, paths, targets)
        fresh = {blob: paths for blob, paths in claims.items() if blob not in self.checked}
        if not fresh:
            return
        if self.unchecked_bytes + claimed <= UNCHECKED_BYTES:
            self.unchecked_bytes += claimed
            return
        with open_linked(self.url, self.manifest, self.storage_options, self.options) as plugin:
            expected = self.manifest.blob_sizes
            jobs = self.options.max_concurrent_io
            assert jobs is not None
            run(check_claims(plugin, fresh, expected, jobs, self.options))
        self.checked.update(fresh)
