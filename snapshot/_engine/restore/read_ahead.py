"""Read-ahead while a restore plans: the byte ranges a restore is about to read are handed to the
storage plugin as hints (``StoragePlugin.read_ahead_now`` / ``read_ahead``) while the caller's
thread plans the reads, so that the device works while the CPU plans. The local plugin turns
them into ``posix_fadvise(WILLNEED)``: the kernel reads the ranges into the page cache, and the
restore's buffered reads copy them from there.

The ranges come from the manifest entries of the keys being restored, in the order the manifest
lists them, merged per blob while they are close; the ranges of a sharded tensor (a rank reads
its part of them, planned only from its targets) and, in a group where one rank may read
replicated leaves for all (``shared_reads.decide``: not a local directory, or the option set),
of those leaves are left out. They are found on the caller's thread, in one lean pass, before it
plans; a thread of the restore's own then gives the hints, one system call each for the local
plugin, and stops once the reads begin (``ReadAhead.stop``: from then on the reads ask for the
bytes themselves, and a hint would only compete with them). Finding the ranges, or giving the
hints, on the I/O loop beside the planning cost more: every hand-over between the loop, the
plugin's pool and the planning thread takes the GIL from the planning (a cold restore of 20,000
small tensors ran some 10% slower that way; benchmarks/README.md).

A process restoring alone, from a ``Snapshot`` whose manifest is not decoded yet, starts the
hints before the decoding (``early``): the codec hands the tensor entries of each piece of the
manifest to ``DecodedRanges`` as it decodes them, so the device reads the first keys' bytes
while the rest of the manifest is decoded, and the restore finds no ranges of its own.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain, compress, repeat
from operator import attrgetter, itemgetter
from typing import Any

from manifest import Entry, Location, ObjectEntry, TensorEntry
from snapshot._engine.io.storage_calls import open_storage
from snapshot._engine.restore.linked import LinkedStorage
from snapshot._engine.runtime import run
from snapshot.options import Options
from storage_plugins import StoragePlugin
from storage_plugins.registry import resolve_factory, split_url

logger = logging.getLogger(__name__)

# The hints cover a blob in pieces of this size: Linux reads ahead at most the device's
# read-ahead window per ``WILLNEED`` call (the larger of ``read_ahead_kb`` and
# ``max_sectors_kb``, 8 MiB on the machine of the benchmarks), so a larger hint would be cut
# short; and the hints stop soon after the reads begin.
PIECE_BYTES = 8 << 20

# Two ranges of a blob this close are one hint (the gap between them read too).
GAP_BYTES = 1 << 20


def ranges(
    entries: Mapping[str, Entry], walks: Iterable[Sequence[str]], skip_replicated: bool
) -> list[tuple[str, int, int]]:
    """``(blob, offset, nbytes)`` covering the bytes of the dense tensors and objects at the
    paths of ``walks`` (each root's ``subtree``, which the planning then uses too), in the
    manifest's order, a range per run of close locations of one blob."""
    # One iteration per leaf, before the planning: kept lean, a tensor's chunks read straight;
    # the locations are then merged as the decoding's are (``merged``).
    get = entries.get
    locations: list[Location] = []
    for walk in walks:
        for path in walk:
            entry = get(path)
            kind = type(entry)
            if kind is TensorEntry:
                found = entry.chunks  # type: ignore[union-attr]
            elif kind is ObjectEntry:
                found = entry.locations  # type: ignore[union-attr]
            else:
                continue
            if skip_replicated and entry.replicated:  # type: ignore[union-attr]
                continue
            locations.extend(found)
    return merged(locations, GAP_BYTES)


def takes_hints(plugin: StoragePlugin) -> bool:
    """Whether ``plugin`` does anything with a hint (it has a ``read_ahead`` or
    ``read_ahead_now`` of its own; a linked snapshot's storage hands hints to the snapshot's own
    store): for any other, finding the ranges would only cost the planning time."""
    if isinstance(plugin, LinkedStorage):
        plugin = plugin.own
    return _acts_on_hints(type(plugin))


def _acts_on_hints(kind: type) -> bool:
    return (
        kind.read_ahead is not StoragePlugin.read_ahead  # type: ignore[attr-defined]
        or kind.read_ahead_now is not StoragePlugin.read_ahead_now  # type: ignore[attr-defined]
    )


def _serves_hints(url: str) -> bool:
    """Whether the plugin class that would serve ``url`` acts on hints, known without opening
    it (an object store's session is not opened for nothing)."""
    try:
        factory, _ = resolve_factory(split_url(url)[0])
    except (ValueError, ImportError):
        return False  # opening the storage will say why
    return (
        isinstance(factory, type) and issubclass(factory, StoragePlugin) and _acts_on_hints(factory)
    )


class ReadAhead:
    """Hints ``spans`` to ``plugin``, piece by piece, from a thread of its own until ``stop``:
    each through ``read_ahead_now``, or where the plugin has none, by awaiting its
    ``read_ahead`` on the I/O loop. ``feed``: the ``spans`` when they are a ``DecodedRanges``
    (ended by ``stop`` too, so the thread never waits for ranges that will not come)."""

    def __init__(
        self,
        plugin: StoragePlugin,
        spans: Iterable[tuple[str, int, int]],
        resources: contextlib.ExitStack | None = None,
    ) -> None:
        self._resources = resources  # closed once the hints are done (``close``): the plugin's
        self.feed = spans if isinstance(spans, DecodedRanges) else None
        self._stopped = threading.Event()
        self.nbytes = 0  # hinted so far
        self._thread = threading.Thread(
            target=self._run, args=(plugin, spans), name="statesnap-hints", daemon=True
        )
        self._thread.start()

    def _run(self, plugin: StoragePlugin, spans: Iterable[tuple[str, int, int]]) -> None:
        blob = ""
        try:
            for blob, offset, nbytes in spans:
                end = offset + nbytes
                while offset < end:
                    if self._stopped.is_set():
                        return
                    n = min(PIECE_BYTES, end - offset)
                    if not plugin.read_ahead_now(blob, offset, n):
                        run(plugin.read_ahead(blob, offset, n))
                    self.nbytes += n
                    offset += n
        except Exception as e:  # a hint: the read itself reports what is wrong
            logger.debug("read-ahead of %s stopped: %s", plugin.describe(blob), e)

    def stop(self) -> None:
        """No hint starts after this (one in flight finishes)."""
        self._stopped.set()
        if self.feed is not None:
            self.feed.end()

    def close(self) -> None:
        """Stops the hints and waits for the one in flight, if any."""
        self.stop()
        self._thread.join()
        if self._resources is not None:
            self._resources.close()


class DecodedRanges:
    """The ranges of the dense tensors under some paths, found as the manifest is decoded: the
    codec hands each piece's tensor entries to ``tensors`` (its ``on_tensors``), which keeps
    those under ``prefixes`` and merges their locations per run of close ranges of a blob
    (``merged``); iterating yields the ranges as they come, until ``end``. One producer (the
    decoding thread), one consumer (the hint thread)."""

    def __init__(self, prefixes: tuple[str, ...], gap_bytes: int) -> None:
        self._prefixes = prefixes
        self._gap = gap_bytes
        self._queue: queue.SimpleQueue[tuple[str, int, int] | None] = queue.SimpleQueue()

    def tensors(self, items: list[tuple[str, TensorEntry]]) -> None:
        # A piece is some 1,800 entries: kept, and their chunks listed, in C-level passes.
        keep = map(str.startswith, map(_PATH, items), repeat(self._prefixes))
        chunks = list(chain.from_iterable(map(_CHUNKS, map(_ENTRY, compress(items, keep)))))
        for span in merged(chunks, self._gap):
            self._queue.put(span)

    def end(self) -> None:
        """No more ranges (the decoding is over, or failed): the iteration ends."""
        self._queue.put(None)

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        while (span := self._queue.get()) is not None:
            yield span


_PATH = itemgetter(0)
_ENTRY = itemgetter(1)
_CHUNKS = attrgetter("chunks")


def merged(locations: Iterable[Location], gap: int) -> list[tuple[str, int, int]]:
    """``(blob, offset, nbytes)`` covering ``locations``, one per run of a blob's locations (in
    their order) that lie at most ``gap`` apart. One lean pass: it runs once per location of
    the keys restored (as the manifest is decoded, or before the planning)."""
    out: list[tuple[str, int, int]] = []
    blob = None
    start = end = 0
    for loc in locations:
        offset = loc.offset
        stop = offset + loc.nbytes
        # Within ``gap`` of the run on either side (a slab's members may come in any order).
        if loc.blob == blob and offset <= end + gap and start <= stop + gap:
            if offset < start:
                start = offset
            if stop > end:
                end = stop
            continue
        if blob is not None:
            out.append((blob, start, end - start))
        blob, start, end = loc.blob, offset, stop
    if blob is not None and end > start:
        out.append((blob, start, end - start))
    return out


def early(
    roots: Iterable[str],
    path: str,
    storage_options: dict[str, Any] | None,
    options: Options,
) -> ReadAhead | None:
    """Hints of the dense tensors under ``roots`` (manifest paths) for the snapshot at
    ``path``, given as its manifest is decoded: the caller decodes it with the returned
    hints' ``feed.tensors`` as the codec's ``on_tensors``, then calls ``feed.end()``. None
    where the store takes no hints. A restore of one process that opened the snapshot from its
    path starts them before it decodes the manifest: the device reads the first tensors'
    bytes while the rest are decoded (decoding 20,000 entries takes longer than the device
    needs to start reading). A failure here only costs the hints (the restore reads as it
    would without)."""
    prefixes = tuple(f"{root}/" for root in roots)
    if not prefixes or not _serves_hints(path):
        return None
    resources = contextlib.ExitStack()
    try:
        plugin = resources.enter_context(open_storage(path, storage_options, options))
    except Exception as e:  # hints: the restore reports what is wrong
        logger.debug("no read-ahead of %s while its manifest is decoded: %s", path, e)
        resources.close()
        return None
    return ReadAhead(plugin, DecodedRanges(prefixes, GAP_BYTES), resources)
