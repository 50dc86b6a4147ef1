"""Opening a snapshot: its committed manifest read and decoded, or another library's checkpoint
recognized (torchsnapshot's translated into a manifest, read-only; others refused with what to
load them with)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import manifest as mf
from manifest import Manifest
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
    SnapshotError,
    SnapshotNotFoundError,
    StorageError,
    UnsafeSnapshotError,
)
from snapshot.options import Options
from storage_plugins import UnsafeBlobError

logger = logging.getLogger("snapshot")


def load_manifest(
    path: str, storage_options: dict[str, Any] | None, options: Options | None = None
) -> Manifest:
    """Reads and decodes the committed manifest at ``path``, with ``options`` (resolved; None:
    the environment's, for callers with no options of their own, such as the command line)."""
    options = options if options is not None else Options.from_env()
    found, where = read_manifest(path, storage_options, options)
    if isinstance(found, Manifest):
        return found
    return decode_manifest(found, where, verify=False)  # its checksum line checked as read


def read_manifest(
    path: str, storage_options: dict[str, Any] | None, options: Options
) -> tuple[Manifest | bytes, str]:
    """The committed manifest at ``path``, and the snapshot's location as messages name it: its
    bytes, checked as far as they can be without decoding the entries (``check_manifest``),
    for ``decode_manifest`` to decode when they are first needed; or another library's
    checkpoint, translated."""
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
            logger.debug(
                "manifest of %s: %d entries translated from torchsnapshot's in %.3f s",
                where,
                len(foreign.entries),
                time.perf_counter() - t0,
            )
            return foreign, where
    logger.debug(
        "manifest of %s: %d bytes read in %.3f s", where, len(data), time.perf_counter() - t0
    )
    check_manifest(data, where, verify=bool(options.checksums))
    return data, where


def decode_manifest(
    data: bytes, where: str, *, verify: bool, on_tensors: mf.TensorsDecoded | None = None
) -> Manifest:
    """The manifest in ``data``, read from the snapshot ``where`` (or just written there);
    ``verify``: its recorded checksum is checked; ``on_tensors``: as ``manifest.loads``."""
    t0 = time.perf_counter()
    with _manifest_errors(), gc_paused():
        manifest = mf.loads(
            data, source=f"{where}/{MANIFEST_NAME}", verify=verify, on_tensors=on_tensors
        )
    logger.debug(
        "manifest of %s: %d entries decoded in %.3f s",
        where,
        len(manifest.entries),
        time.perf_counter() - t0,
    )
    return manifest


def check_manifest(data: bytes, where: str, *, verify: bool) -> None:
    """The checks of ``decode_manifest`` that decode none of the entries (its checksum line,
    its header): a snapshot opened is known to be one this library reads before its entries
    are decoded."""
    with _manifest_errors():
        mf.check_head(data, source=f"{where}/{MANIFEST_NAME}", verify=verify)


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
