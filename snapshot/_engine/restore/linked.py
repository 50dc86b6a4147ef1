"""Reading a snapshot whose ranges lie partly in sibling snapshots (an incremental take's
bases: ``incremental``).

``open_linked`` opens the snapshot's own storage and, when its manifest points at siblings,
first checks each of them: it must lie in the same store and parent as the snapshot (one at
the root of a bucket or of the memory store has none: refused), be a directory on local disk,
not a link (``incremental.checked_sibling``), and hold a committed snapshot (else
``MissingBaseError`` naming it, and nothing is read); every range pointed at must lie within a
blob that the sibling's own manifest records, within the bytes it records there. A manifest
is untrusted input: this is what keeps a crafted ``../<name>/<blob>`` from reading anything
beside the snapshot but the recorded bytes of another committed snapshot. Reads then go
through ``LinkedStorage``, which sends each ``../<name>/<blob>`` to a plugin opened on that
sibling (lazily, on the I/O loop) and everything else to the snapshot's own plugin.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from manifest import Manifest, reference_of
from snapshot._engine.format.manifest_io import load_manifest
from snapshot._engine.io.storage_calls import open_storage
from snapshot._engine.runtime import run
from snapshot._engine.take.incremental import checked_sibling, sibling_path
from snapshot.errors import CorruptSnapshotError, MissingBaseError, SnapshotNotFoundError
from snapshot.options import Options
from storage_plugins import Buffer, StoragePlugin
from storage_plugins.registry import url_to_storage_plugin

logger = logging.getLogger("snapshot")


def check_bases(
    path: str, manifest: Manifest, storage_options: dict[str, Any] | None, options: Options
) -> None:
    """Checks that every sibling snapshot ``manifest`` points at is committed and records each
    range pointed at (see the module's docstring).

    Raises:
        MissingBaseError: a sibling holds no committed snapshot.
        CorruptSnapshotError: a range lies outside what its sibling's manifest records.
    """
    if not manifest.bases:
        return
    t = time.perf_counter()
    extents: dict[str, dict[str, int]] = {}
    for name in manifest.bases:
        where = checked_sibling(path, name)  # same store and parent, no link
        try:
            extents[name] = load_manifest(where, storage_options, options).blob_sizes
        except SnapshotNotFoundError as e:
            raise MissingBaseError(
                f"snapshot {path} needs the bytes of its base {where}, which holds no committed "
                f"snapshot ({e}); it was deleted, or never finished. Nothing was read.",
                base=where,
            ) from None
    for blob, end in manifest.blob_sizes.items():
        ref = reference_of(blob)
        if ref is None:
            continue
        name, inner = ref
        recorded = extents[name].get(inner)
        if recorded is None or reference_of(inner) is not None or end > recorded:
            what = "no such blob" if recorded is None else f"{recorded:,} bytes recorded"
            raise CorruptSnapshotError(
                f"snapshot {path}: entries read up to byte {end:,} of blob {inner!r} of its base "
                f"{sibling_path(path, name)}, whose manifest says otherwise ({what})"
            )
    logger.debug(
        "snapshot %s: %d base(s) checked in %.3f s", path, len(extents), time.perf_counter() - t
    )


@contextmanager
def open_linked(
    path: str, manifest: Manifest, storage_options: dict[str, Any] | None, options: Options
) -> Iterator[StoragePlugin]:
    """``open_storage`` for reading the snapshot at ``path`` whose manifest is ``manifest``:
    its own plugin when it points at no sibling, else a ``LinkedStorage`` over it, once the
    siblings have passed ``check_bases``."""
    if not manifest.bases:
        with open_storage(path, storage_options, options) as plugin:
            yield plugin
        return
    check_bases(path, manifest, storage_options, options)
    with open_storage(path, storage_options, options) as plugin:
        linked = LinkedStorage(plugin, path, storage_options)
        try:
            yield linked
        finally:
            run(linked.close())


class LinkedStorage(StoragePlugin):
    """The reads of a snapshot whose manifest points at sibling snapshots: ``../<name>/<blob>``
    goes to ``<name>``'s plugin, every other blob to ``own``. Writes and deletes reach
    ``own`` only. ``close`` closes the siblings' plugins, not ``own`` (its opener does)."""

    def __init__(
        self, own: StoragePlugin, path: str, storage_options: dict[str, Any] | None
    ) -> None:
        self.own = own
        self.path = path
        self.storage_options = storage_options
        self.siblings: dict[str, StoragePlugin] = {}

    def _route(self, blob: str) -> tuple[StoragePlugin, str]:
        ref = reference_of(blob)
        if ref is None:
            return self.own, blob
        name, inner = ref
        plugin = self.siblings.get(name)
        if plugin is None:  # made on the I/O loop: every caller is a coroutine on it
            where = checked_sibling(self.path, name)
            plugin = url_to_storage_plugin(where, self.storage_options)
            self.siblings[name] = plugin
        return plugin, inner

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        await self.own.write(path, buffers)

    async def read(self, path: str) -> bytes:
        plugin, blob = self._route(path)
        return await plugin.read(blob)

    async def read_limited(self, path: str, limit: int) -> bytes:
        plugin, blob = self._route(path)
        return await plugin.read_limited(blob, limit)

    async def read_into(self, path: str, offset: int, out: memoryview) -> None:
        plugin, blob = self._route(path)
        await plugin.read_into(blob, offset, out)

    async def readv(self, path: str, offset: int, outs: Sequence[memoryview]) -> None:
        plugin, blob = self._route(path)
        await plugin.readv(blob, offset, outs)

    async def read_ahead(self, path: str, offset: int, nbytes: int) -> None:
        plugin, blob = self._route(path)
        await plugin.read_ahead(blob, offset, nbytes)

    def read_ahead_now(self, path: str, offset: int, nbytes: int) -> bool:
        # Off the I/O loop: the snapshot's own blobs only (a sibling's plugin is made on the
        # loop, by ``_route``); a sibling's hint goes through ``read_ahead``.
        if reference_of(path) is not None:
            return False
        return self.own.read_ahead_now(path, offset, nbytes)

    async def readv_observed(
        self,
        path: str,
        offset: int,
        outs: Sequence[memoryview],
        observe: Callable[[memoryview], None],
    ) -> None:
        plugin, blob = self._route(path)
        await plugin.readv_observed(blob, offset, outs, observe)

    async def size(self, path: str) -> int | None:
        plugin, blob = self._route(path)
        return await plugin.size(blob)

    async def exists(self, path: str) -> bool:
        plugin, blob = self._route(path)
        return await plugin.exists(blob)

    async def list_names(self, limit: int) -> list[str] | None:
        return await self.own.list_names(limit)

    async def delete(self, path: str) -> None:
        if reference_of(path) is not None:
            raise PermissionError(f"{path}: a base's blob is not deleted through this snapshot")
        await self.own.delete(path)

    def describe(self, path: str) -> str:
        ref = reference_of(path)
        if ref is None:
            return self.own.describe(path)
        name, inner = ref
        return f"{inner} of base {sibling_path(self.path, name)}"

    def is_transient(self, error: BaseException) -> bool:
        return self.own.is_transient(error)

    def forget(self) -> None:
        self.own.forget()

    async def close(self) -> None:
        siblings, self.siblings = list(self.siblings.values()), {}
        for plugin in siblings:
            await plugin.close()
