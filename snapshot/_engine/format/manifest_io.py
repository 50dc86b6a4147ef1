"""Opening a snapshot: its committed manifest read and decoded, or another library's checkpoint
recognized (torchsnapshot's translated into a manifest, read-only; others refused with what to
load them with); and its storage opened for reading, through its bases where an incremental
take's manifest points at sibling snapshots (``open_linked``).

A manifest is untrusted input: a base must lie in the same store and parent, on local disk,
not behind a link (``checked_sibling``), and hold a committed snapshot whose own
manifest records every range pointed at. That keeps a crafted ``../<name>/<blob>`` from
reading anything but the recorded bytes of another committed snapshot."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import manifest as mf
from manifest import Manifest, reference_of
from snapshot._engine.format.text import printable_message
from snapshot._engine.format.torchsnapshot_format import open_foreign
from snapshot._engine.io.pipeline import plugin_location
from snapshot._engine.io.storage_calls import call, open_storage, read_unrecorded, refused
from snapshot._engine.runtime import gc_paused, run
from snapshot._engine.take.commit import MANIFEST_NAME, PENDING_NAME
from snapshot.errors import (
    ChecksumError,
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    IncompleteSnapshotError,
    MissingBaseError,
    SnapshotError,
    SnapshotNotFoundError,
    StorageError,
    UnsafeSnapshotError,
)
from snapshot.options import Options
from storage_plugins import Buffer, StoragePlugin, UnsafeBlobError
from storage_plugins.registry import url_to_storage_plugin

logger = logging.getLogger("snapshot")


def split_parent(path: str) -> tuple[str, str]:
    """``(parent, name)`` of a snapshot's path: a local path made absolute, a URL by its last
    ``/``-separated part (trailing slashes ignored). A URL at the root of its store (a bucket,
    ``memory://name``) has no parent: ``("", path)``; a ``file://`` URL's parent may be ``/``."""
    if "://" in path:
        protocol, _, location = path.partition("://")
        parent, _, name = location.rstrip("/").rpartition("/")
        if not parent.strip("/") and protocol != "file":
            return "", path.rstrip("/")
        return f"{protocol}://{parent}", name
    full = os.path.abspath(path)
    return os.path.dirname(full), os.path.basename(full)


def sibling_path(path: str, name: str) -> str:
    """The path of the sibling snapshot ``name`` of the snapshot at ``path``: in the same
    store and parent folder (or prefix).

    Raises:
        UnsafeSnapshotError: ``path`` lies at the root of its store (a bucket, ``memory://x``),
            where a sibling would be another bucket or store, or a local path.
    """
    parent, _ = split_parent(path)
    if "://" in path:
        if not parent:
            raise UnsafeSnapshotError(
                f"snapshot {path} names a sibling snapshot {name!r}, but it lies at the root of "
                "its store, which has no folder beside it: a reference is resolved only within "
                "the same store and parent"
            )
        return f"{parent}/{name}"
    return os.path.join(parent, name)


def checked_sibling(path: str, name: str) -> str:
    """``sibling_path(path, name)``, once it is known to be a place a take could have made: on
    local disk (a plain path or ``file://``) a directory, not a link to one. A missing sibling
    passes (reading its manifest then says it is missing). The snapshot's own path may be a
    link (the user chose it); only the sibling's own name is looked at, without following it.

    Raises:
        UnsafeSnapshotError: the sibling is a link or not a directory, or ``path`` has no
            parent in its store (``sibling_path``).
    """
    where = sibling_path(path, name)
    if "://" in where and not where.startswith("file://"):
        return where
    local = where.removeprefix("file://")
    try:
        mode = os.lstat(local).st_mode
    except FileNotFoundError:
        return where
    except OSError as e:
        raise UnsafeSnapshotError(
            f"snapshot {path}: its base {local} cannot be looked at: {e}"
        ) from e
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
        raise UnsafeSnapshotError(
            f"snapshot {path} points at bytes of its base {local}, which is {what}: a base "
            "must be a sibling folder a take made, and no link is followed. Nothing was read."
        )
    return where


def load_manifest(
    path: str, storage_options: dict[str, Any] | None, options: Options | None = None
) -> Manifest:
    """Reads and decodes the committed manifest at ``path``, with ``options`` (None: the
    environment's)."""
    options = options if options is not None else Options.from_env()
    found, where = read_manifest(path, storage_options, options)
    if isinstance(found, Manifest):
        return found
    return decode_manifest(found, where, verify=False)  # its checksum line checked as read


def read_manifest(
    path: str, storage_options: dict[str, Any] | None, options: Options
) -> tuple[Manifest | bytes, str]:
    """The committed manifest at ``path`` (its bytes, checked short of decoding the entries; or
    another library's checkpoint, translated), and the snapshot's location for messages."""
    t0 = time.perf_counter()
    with open_storage(path, storage_options, options) as plugin:
        where = plugin_location(plugin)

        async def fetch() -> bytes | None:
            try:
                return await read_unrecorded(plugin, MANIFEST_NAME, where, options)
            except (FileNotFoundError, NotADirectoryError):  # (the path is a file)
                exists = lambda: plugin.exists(PENDING_NAME)  # noqa: E731
                pending = await call(
                    plugin, "check", PENDING_NAME, where, exists, options=options, convert=False
                )
                if pending:
                    raise IncompleteSnapshotError(
                        f"{where} holds an incomplete snapshot: a take started there but never "
                        "committed (it was interrupted or failed). Its blobs are not usable; "
                        "taking a new snapshot at this path replaces them."
                    ) from None
                return None

        try:
            data = run(fetch())
        except SnapshotError:
            raise
        except UnsafeBlobError as e:  # the pending marker, or a link on the way to it
            raise refused(where, e) from e
        except Exception as e:
            raise StorageError(f"cannot read the manifest of {where}: {e}") from e
        if data is None:
            # Another library's checkpoint: torchsnapshot's is translated (read-only), others
            # are refused with what to load them with.
            with gc_paused():
                foreign = open_foreign(plugin, where, path, storage_options, options)
            if foreign is None:
                raise SnapshotNotFoundError(f"no snapshot at {where} (no {MANIFEST_NAME} there)")
            return foreign, where
    elapsed = time.perf_counter() - t0
    logger.debug("manifest of %s: %d bytes read in %.3f s", where, len(data), elapsed)
    with _manifest_errors():  # the checks that decode no entry: checksum line, header
        mf.check_head(data, source=f"{where}/{MANIFEST_NAME}", verify=bool(options.checksums))
    return data, where


def decode_manifest(data: bytes, where: str, *, verify: bool) -> Manifest:
    """The manifest in ``data``, read from the snapshot ``where`` (or just written there);
    ``verify``: its recorded checksum is checked."""
    t0 = time.perf_counter()
    with _manifest_errors(), gc_paused():
        manifest = mf.loads(data, source=f"{where}/{MANIFEST_NAME}", verify=verify)
    elapsed = time.perf_counter() - t0
    logger.debug(
        "manifest of %s: %d entries decoded in %.3f s", where, len(manifest.entries), elapsed
    )
    return manifest


@contextlib.contextmanager
def _manifest_errors() -> Iterator[None]:
    """The codec's errors as the library's."""
    try:
        yield
    # The codec's messages quote the manifest's own text (keys, field values): escaped, like
    # every message that names what a snapshot holds.
    except mf.UnsupportedFormatError as e:
        raise IncompatibleSnapshotError(printable_message(str(e))) from None
    except mf.ManifestChecksumError as e:
        raise ChecksumError(
            f"{e} (Options(checksums=False), or STATESNAP_CHECKSUMS=0, reads it unchecked)"
        ) from None
    except mf.UnsafeManifestError as e:  # what the library never writes: aliases, tags, depth
        raise UnsafeSnapshotError(printable_message(str(e))) from None
    except mf.ManifestDecodeError as e:
        raise CorruptSnapshotError(printable_message(str(e))) from None


def check_bases(
    path: str, manifest: Manifest, storage_options: dict[str, Any] | None, options: Options
) -> None:
    """Checks that every base ``manifest`` points at is committed (else ``MissingBaseError``)
    and records each range pointed at (else ``CorruptSnapshotError``)."""
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


@contextlib.contextmanager
def open_linked(
    path: str, manifest: Manifest, storage_options: dict[str, Any] | None, options: Options
) -> Iterator[StoragePlugin]:
    """``open_storage`` for reading the snapshot at ``path``: through a ``LinkedStorage``,
    once its bases pass ``check_bases``, where ``manifest`` points at any."""
    if manifest.bases:
        check_bases(path, manifest, storage_options, options)
    with open_storage(path, storage_options, options) as plugin:
        if not manifest.bases:
            yield plugin
            return
        linked = LinkedStorage(plugin, path, storage_options)
        try:
            yield linked
        finally:
            run(linked.close())


def _routed(name: str) -> Callable[..., Any]:
    """``LinkedStorage``'s method ``name``: the same call on the plugin holding the blob."""

    async def method(self: Any, path: str, *args: Any) -> Any:
        plugin, blob = self._route(path)
        return await getattr(plugin, name)(blob, *args)

    method.__name__ = name
    return method


class LinkedStorage(StoragePlugin):
    """Routes ``../<name>/<blob>`` to base ``<name>``'s plugin, all else (writes, deletes) to
    ``own``; ``close`` closes the bases' plugins, not ``own`` (its opener does)."""

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

    # The calls that read a blob (or ask about one), wherever it lies.
    read = _routed("read")
    read_limited = _routed("read_limited")
    read_into = _routed("read_into")
    readv = _routed("readv")
    readv_observed = _routed("readv_observed")
    size = _routed("size")
    exists = _routed("exists")

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
