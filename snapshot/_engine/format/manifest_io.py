"""Opening a snapshot: its committed manifest read and decoded, or another library's checkpoint
recognized (torchsnapshot's translated into a manifest, read-only; others refused with what to
load them with); and its storage opened for reading, through its bases where an incremental
take's manifest points at sibling snapshots (``open_linked``).

A manifest is untrusted input: a base must lie in the same store and parent, on local disk,
not behind a link (``checked_sibling``), and hold a committed snapshot whose own
manifest records every range pointed at. That keeps a crafted ``../<name>/<blob>`` from
reading anything but the recorded bytes of another committed snapshot."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

import manifest as mf
from manifest import Manifest, reference_of
from snapshot._engine.format.text import printable_message
from snapshot._engine.format.torchsnapshot_format import (
    DCP_METADATA_NAME,
    METADATA_NAME,
    translate,
)
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
    the translated manifest of a torchsnapshot snapshot, a DCP checkpoint or a safetensors
    folder), and the snapshot's location for messages.

    Raises:
        IncompleteSnapshotError: a take started there and never committed.
        IncompatibleSnapshotError: ``path`` is a ``torch.save`` file (the message says how to
            load it), or another library's checkpoint of a layout this library does not read.
        SnapshotNotFoundError: nothing of the kind is there.
    """
    t0 = time.perf_counter()
    with open_storage(path, storage_options, options) as plugin:
        where = plugin_location(plugin)

        async def exists(name: str) -> bool:
            look = lambda: plugin.exists(name)  # noqa: E731
            try:
                return await call(
                    plugin, "check", name, where, look, options=options, convert=False
                )
            except (FileNotFoundError, NotADirectoryError):  # (the path is a file)
                return False

        async def fetch() -> tuple[str, bytes | None]:
            # Our manifest's name and bytes, else torchsnapshot's; else the name of the marker
            # found there ("" for none) and None.
            for name in (MANIFEST_NAME, METADATA_NAME):
                try:
                    return name, await read_unrecorded(plugin, name, where, options)
                except (FileNotFoundError, NotADirectoryError):
                    if name == MANIFEST_NAME and await exists(PENDING_NAME):
                        return PENDING_NAME, None
            # Other libraries' checkpoints, read-only: DCP's, a safetensors folder.
            for name in (DCP_METADATA_NAME, _SAFETENSORS_INDEX):
                try:
                    return name, await read_unrecorded(plugin, name, where, options)
                except (FileNotFoundError, NotADirectoryError):
                    pass
            return (_SAFETENSORS if await exists(_SAFETENSORS) else ""), None

        try:
            name, data = run(fetch())
            sizes_of = lambda blobs: _blob_sizes(plugin, where, options, blobs)  # noqa: E731
            if name == METADATA_NAME and data is not None:
                # torchsnapshot's: translated (read-only), the lengths of its pickles' files
                # asked of the store.
                with gc_paused():
                    return translate(data, where, sizes_of), where
            if name in (DCP_METADATA_NAME, _SAFETENSORS_INDEX, _SAFETENSORS):
                return _foreign(name, data, where, plugin, options, sizes_of), where
        except SnapshotError:
            raise
        except UnsafeBlobError as e:  # a marker, or a link on the way to one
            raise refused(where, e) from e
        except Exception as e:
            raise StorageError(f"cannot read the manifest of {where}: {e}") from e
        if data is None:  # raised inside: a failed operation keeps no plugin open
            _refuse_other(name, where, path)
    elapsed = time.perf_counter() - t0
    logger.debug("manifest of %s: %d bytes read in %.3f s", where, len(data), elapsed)
    with _manifest_errors():  # the checks that decode no entry: checksum line, header
        mf.check_head(data, source=f"{where}/{MANIFEST_NAME}", verify=bool(options.checksums))
    return data, where


_SAFETENSORS = "model.safetensors"
_SAFETENSORS_INDEX = "model.safetensors.index.json"


def _foreign(
    name: str,
    data: bytes | None,
    where: str,
    plugin: StoragePlugin,
    options: Options,
    sizes_of: Callable[[Iterable[str]], dict[str, int]],
) -> Manifest:
    """The manifest of a DCP checkpoint (``data``: its ``.metadata``) or a safetensors folder
    (``data``: its index, or None for one ``model.safetensors``), translated read-only; their
    modules are imported only here."""
    read = lambda ranges: _read_ranges(plugin, where, options, ranges)  # noqa: E731
    t0 = time.perf_counter()
    with gc_paused():
        if name == DCP_METADATA_NAME:
            from snapshot._engine.format.dcp_format import translate_dcp

            assert data is not None
            manifest = translate_dcp(data, where, sizes_of, read)
        else:
            from snapshot._engine.format.safetensors_format import translate_safetensors

            manifest = translate_safetensors(data, where, sizes_of, read)
    logger.debug(
        "%s of %s translated: %d entries in %.3f s",
        name,
        where,
        len(manifest.entries),
        time.perf_counter() - t0,
    )
    return manifest


def _read_ranges(
    plugin: StoragePlugin, where: str, options: Options, ranges: list[tuple[str, int, int]]
) -> list[bytes]:
    """The bytes of each ``(blob, offset, nbytes)``, at most ``max_concurrent_io`` reads at a
    time; a range past a blob's end is refused as a damaged checkpoint."""
    limit = asyncio.Semaphore(options.max_concurrent_io or 1)

    async def one(blob: str, offset: int, nbytes: int) -> bytes:
        out = bytearray(nbytes)
        if not nbytes:
            return b""
        read = lambda: plugin.read_into(blob, offset, memoryview(out))  # noqa: E731
        async with limit:
            try:
                await call(plugin, "read", blob, where, read, options=options, convert=False)
            except (FileNotFoundError, NotADirectoryError):
                raise CorruptSnapshotError(f"{where}: {blob} is missing") from None
            except (EOFError, ValueError) as e:
                raise CorruptSnapshotError(
                    f"{where}: {blob} holds fewer than {offset + nbytes:,} bytes: {e}"
                ) from None
        return bytes(out)

    async def every() -> list[bytes]:
        return list(await asyncio.gather(*(one(*r) for r in ranges)))

    return run(every())


def _refuse_other(marker: str, where: str, url: str) -> NoReturn:
    """Raises what the snapshot path ``url`` (``where``) holds instead of a snapshot: an
    incomplete take, another library's checkpoint (with what to load it with), or nothing."""
    if marker == PENDING_NAME:
        raise IncompleteSnapshotError(
            f"{where} holds an incomplete snapshot: a take started there but never "
            "committed (it was interrupted or failed). Its blobs are not usable; "
            "taking a new snapshot at this path replaces them."
        )
    kind = _single_file(url)
    if kind is not None:
        raise IncompatibleSnapshotError(
            f"{where} is {kind}, not a statesnap snapshot (a directory): load it with "
            f"torch.load({url!r}, weights_only=True) and give each object its part "
            "(model.load_state_dict(...))"
        )
    raise SnapshotNotFoundError(f"no snapshot at {where} (no {MANIFEST_NAME} there)")


# torch.save's legacy format starts with the pickle (protocol 2) of its magic number.
_LEGACY_TORCH_SAVE = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


def _single_file(url: str) -> str | None:
    """What the local file at ``url`` is (which of its formats), when ``torch.save`` wrote it.
    None when it is not such a file, or ``url`` is not a local path (best effort: only the
    message differs; on an object store the look would cost a request for every path without a
    snapshot)."""
    if "://" in url and not url.startswith("file://"):
        return None
    # The path the user named may be a link (their choice, so it is followed); the file is then
    # opened without following one, and read only when it is a regular file.
    path = os.path.realpath(os.path.expanduser(url.removeprefix("file://")))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            head = f.read(512) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return None
    # A zip archive whose first member is "<archive name>/data.pkl": torch.save's.
    if head.startswith(b"PK\x03\x04") and len(head) >= 30:
        name_len = int.from_bytes(head[26:28], "little")
        name = head[30 : 30 + name_len]
        if name == b"data.pkl" or name.endswith(b"/data.pkl"):
            return "a torch.save file (zip format)"
    if head.startswith(_LEGACY_TORCH_SAVE):
        return "a torch.save file (legacy format)"
    return None


def _blob_sizes(
    plugin: StoragePlugin, where: str, options: Options, blobs: Iterable[str]
) -> dict[str, int]:
    """The lengths of whole-file blobs, asked of the store at most ``max_concurrent_io`` at a
    time; a missing blob counts as empty (reading it later fails naming it)."""
    limit = asyncio.Semaphore(options.max_concurrent_io or 1)

    async def one(blob: str) -> tuple[str, int]:
        def ask(what: str, fn: Callable[[], Awaitable[Any]]) -> Awaitable[Any]:
            return call(plugin, what, blob, where, fn, options=options, convert=False)

        async with limit:
            try:
                size = await ask("check", lambda: plugin.size(blob))
                if size is None:  # the store cannot tell: the pickle is read to learn it
                    size = len(await ask("read", lambda: plugin.read(blob)))
            except (FileNotFoundError, NotADirectoryError):
                size = 0
            return blob, size

    async def every() -> dict[str, int]:
        return dict(await asyncio.gather(*(one(b) for b in sorted(set(blobs)))))

    return run(every())


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
    path: str,
    manifest: Manifest,
    storage_options: dict[str, Any] | None,
    options: Options,
    *,
    inflate: bool = True,
) -> Iterator[StoragePlugin]:
    """``open_storage`` for reading the snapshot at ``path``: through a ``LinkedStorage``,
    once its bases pass ``check_bases``, where ``manifest`` points at any; with ``inflate``,
    ranges stored compressed are read as the blob would hold them uncompressed
    (``io.compression``, imported only for a manifest of that format version)."""
    if manifest.bases:
        check_bases(path, manifest, storage_options, options)
    with open_storage(path, storage_options, options) as plugin:
        linked = LinkedStorage(plugin, path, storage_options) if manifest.bases else None
        reader: StoragePlugin = plugin if linked is None else linked
        if inflate and manifest.format_version >= mf.COMPRESSED_VERSION:
            from snapshot._engine.io.compression import inflating

            reader = inflating(reader, manifest, bool(options.checksums))
        try:
            yield reader
        finally:
            if linked is not None:
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
