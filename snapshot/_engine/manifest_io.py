"""Opening a snapshot: its committed manifest read and decoded, or another library's checkpoint
recognized (torchsnapshot's translated into a manifest, read-only; others refused with what to
load them with)."""

from __future__ import annotations

import logging
import time
from typing import Any

import manifest as mf
from manifest import Manifest
from snapshot._engine.commit import MANIFEST_NAME, PENDING_NAME, plugin_location
from snapshot._engine.context import gc_paused
from snapshot._engine.io_loop import run
from snapshot._engine.storage_calls import call, open_storage, read_unrecorded, refused
from snapshot._engine.text import printable_message
from snapshot._engine.torchsnapshot_format import open_foreign
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
            return foreign
    t_read = time.perf_counter()
    manifest = decode_manifest(data, where, verify=bool(options.checksums))
    logger.debug(
        "manifest of %s: %d entries, %d bytes; read %.3f s, decoded %.3f s",
        where,
        len(manifest.entries),
        len(data),
        t_read - t0,
        time.perf_counter() - t_read,
    )
    return manifest


def decode_manifest(data: bytes, where: str, *, verify: bool) -> Manifest:
    """The manifest in ``data``, read from the snapshot ``where`` (or just written there);
    ``verify``: its recorded checksum is checked."""
    try:
        with gc_paused():
            return mf.loads(data, source=f"{where}/{MANIFEST_NAME}", verify=verify)
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
