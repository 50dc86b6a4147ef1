"""Read-ahead while a restore plans: the byte ranges a restore is about to read are handed to the
storage plugin as hints (``StoragePlugin.read_ahead``) while the caller's thread plans the reads,
so that the device works while the CPU plans. The local plugin turns them into
``posix_fadvise(WILLNEED)``: the kernel reads the ranges into the page cache, and the restore's
buffered reads copy them from there.

The hints stop once the reads begin (``ReadAhead.stop``): from then on the reads ask for the
bytes themselves, and a hint would only compete with them. The ranges come from the manifest
entries of the keys being restored, in the order the manifest lists them, merged per blob while
they are close; the ranges of a sharded tensor (a rank reads its part of them, planned only
from its targets) and, in a group where one rank may read replicated leaves for all
(``shared_reads.decide``: not a local directory, or the option set), of those leaves are left
out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping

from manifest import Entry, ObjectEntry, TensorEntry
from snapshot._engine.flatten import subtree
from snapshot._engine.io_loop import spawn
from snapshot._engine.linked import LinkedStorage
from storage_plugins import StoragePlugin

logger = logging.getLogger(__name__)

# The hints cover a blob in pieces of this size, so that they stop soon after the reads begin.
PIECE_BYTES = 8 << 20

# Two ranges of a blob this close are one hint (the gap between them read too).
GAP_BYTES = 1 << 20


# The walk of the entries yields None after this many of them, so that the I/O loop it runs on
# serves its other work (the writes of a pending async take) and sees a stop in between.
WALK_STEP = 1024


def ranges(
    entries: Mapping[str, Entry], roots: Iterable[str], skip_replicated: bool
) -> Iterator[tuple[str, int, int] | None]:
    """``(blob, offset, nbytes)`` covering the bytes of the dense tensors and objects under
    ``roots``, in the manifest's order, a range per run of close locations of one blob; and
    None after every ``WALK_STEP`` entries walked."""
    # The loop runs once per leaf while the caller's thread plans (and waits for the GIL
    # meanwhile): kept lean, a tensor's chunks read straight.
    get = entries.get
    gap = GAP_BYTES
    blob = None
    start = end = 0
    walked = 0
    for root in roots:
        for path in subtree(entries, root):
            walked += 1
            if walked == WALK_STEP:
                walked = 0
                yield None
            entry = get(path)
            kind = type(entry)
            if kind is TensorEntry:
                locations = entry.chunks  # type: ignore[union-attr]
            elif kind is ObjectEntry:
                locations = entry.locations  # type: ignore[union-attr]
            else:
                continue
            if skip_replicated and entry.replicated:  # type: ignore[union-attr]
                continue
            for loc in locations:
                offset = loc.offset
                if loc.blob == blob and end - gap <= offset <= end + gap:
                    if offset < start:
                        start = offset
                    offset += loc.nbytes
                    if offset > end:
                        end = offset
                    continue
                if blob is not None:
                    yield blob, start, end - start
                blob, start, end = loc.blob, offset, offset + loc.nbytes
    if blob is not None and end > start:
        yield blob, start, end - start


def takes_hints(plugin: StoragePlugin) -> bool:
    """Whether ``plugin`` does anything with a hint (it has a ``read_ahead`` of its own; a
    linked snapshot's storage hands hints to the snapshot's own store): for any other, finding
    the ranges would only cost the planning caller the GIL."""
    if isinstance(plugin, LinkedStorage):
        plugin = plugin.own
    return type(plugin).read_ahead is not StoragePlugin.read_ahead


class ReadAhead:
    """Hints ``ranges`` to ``plugin`` on the I/O loop, piece by piece, until ``stop``."""

    def __init__(self, plugin: StoragePlugin, spans: Iterator[tuple[str, int, int] | None]) -> None:
        self._stopped = threading.Event()
        self.nbytes = 0  # hinted so far
        self._future = spawn(self._run(plugin, spans))

    async def _run(
        self, plugin: StoragePlugin, spans: Iterator[tuple[str, int, int] | None]
    ) -> None:
        # The ranges are found here, on the I/O loop, while the caller's thread plans: the
        # first hint goes out after the first blob's entries, not after every entry's.
        for span in spans:
            if span is None:  # a step of the walk: the loop's other work, and a stop, first
                if self._stopped.is_set():
                    return
                await asyncio.sleep(0)
                continue
            blob, offset, nbytes = span
            end = offset + nbytes
            while offset < end:
                if self._stopped.is_set():
                    return
                n = min(PIECE_BYTES, end - offset)
                try:
                    await plugin.read_ahead(blob, offset, n)
                except Exception as e:  # a hint: the read itself reports what is wrong
                    logger.debug("read-ahead of %s stopped: %s", plugin.describe(blob), e)
                    return
                self.nbytes += n
                offset += n
            await asyncio.sleep(0)  # let the loop run other work between blobs

    def stop(self) -> None:
        """No hint starts after this (one in flight finishes)."""
        self._stopped.set()

    def close(self) -> None:
        """Stops the hints and waits for the one in flight, if any."""
        self._stopped.set()
        try:
            self._future.result()
        except Exception as e:  # a hint's failure is never the restore's
            logger.debug("read-ahead ended with %r", e)
