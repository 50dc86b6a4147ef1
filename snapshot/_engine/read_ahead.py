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
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from manifest import Entry, ObjectEntry, TensorEntry
from manifest.scan import tensor_ranges
from snapshot._engine.io_loop import run
from snapshot._engine.linked import LinkedStorage
from snapshot._engine.storage_calls import open_storage
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
    # One iteration per leaf, before the planning: kept lean, a tensor's chunks read straight.
    get = entries.get
    gap = GAP_BYTES
    out: list[tuple[str, int, int]] = []
    blob = None
    start = end = 0
    for walk in walks:
        for path in walk:
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
                    out.append((blob, start, end - start))
                blob, start, end = loc.blob, offset, offset + loc.nbytes
    if blob is not None and end > start:
        out.append((blob, start, end - start))
    return out


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
    ``read_ahead`` on the I/O loop."""

    def __init__(
        self,
        plugin: StoragePlugin,
        spans: Iterable[tuple[str, int, int]],
        resources: contextlib.ExitStack | None = None,
    ) -> None:
        self._resources = resources  # closed once the hints are done (``close``): the plugin's
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

    def close(self) -> None:
        """Stops the hints and waits for the one in flight, if any."""
        self._stopped.set()
        self._thread.join()
        if self._resources is not None:
            self._resources.close()


def early(
    data: bytes,
    roots: Iterable[str],
    path: str,
    storage_options: dict[str, Any] | None,
    options: Options,
) -> ReadAhead | None:
    """Hints of the dense tensors under ``roots``, found in ``data``, the snapshot's manifest
    bytes before they are decoded (``manifest.scan``), given to a plugin of its own for
    ``path``; None where there is nothing to hint, or the store takes no hints. A restore of one
    process that opened the snapshot from its path starts them before it decodes the manifest:
    decoding 20,000 entries takes longer than the device needs to start reading. A failure here
    only costs the hints (the restore reads as it would without)."""
    if not _serves_hints(path):
        return None
    resources = contextlib.ExitStack()
    try:
        spans = tensor_ranges(data, roots, GAP_BYTES)
        if spans:
            plugin = resources.enter_context(open_storage(path, storage_options, options))
    except Exception as e:  # hints: the restore reports what is wrong
        logger.debug("no read-ahead of %s before its manifest is decoded: %s", path, e)
        spans = []
    if not spans:
        resources.close()
        return None
    return ReadAhead(plugin, spans, resources)
