"""A take's commit protocol on its storage: the names it writes at the top of a snapshot, which
readers, the checkpoint manager and cleanup look for; the checks before the first blob; the
manifest's write; and the removal of what a failed take wrote.

A snapshot is visible once its manifest is there, and only then; a path holding the pending
marker without a manifest is a take that was interrupted (``manifest_io`` says so; a new take
there replaces what it left).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import time
from typing import TYPE_CHECKING

from snapshot._engine.format.torchsnapshot_format import FOREIGN_MARKERS
from snapshot._engine.io.pipeline import plugin_location
from snapshot._engine.io.storage_calls import call
from snapshot.errors import PathNotEmptyError, SnapshotExistsError

if TYPE_CHECKING:
    from snapshot.options import Options
    from storage_plugins import StoragePlugin

logger = logging.getLogger("snapshot")

MANIFEST_NAME = "manifest.yaml"
# Written before the first blob and deleted after the commit.
PENDING_NAME = ".statesnap-pending"
# The detached signature ``snapshot.signing`` writes beside a committed manifest (never a take).
SIGNATURE_NAME = "manifest.sig.json"

# What a take writes at the top of its directory, and so what an interrupted one may leave
# there: rank directories of blobs ("0", "1", ...), the pending marker, and the local plugin's
# temporary files (".<name>.<12 hex digits>.tmp", renamed into place when written); and a
# signature left by an earlier snapshot there (it fails to verify the new one, so is harmless).
TAKE_DEBRIS = re.compile(r"[0-9]+|\.statesnap-pending|manifest\.sig\.json|\..+\.[0-9a-f]{12}\.tmp")
# Names of the directory asked for before a take: beyond the debris of a few thousand ranks.
LISTED_NAMES = 4096


def left_by_a_take(name: str) -> bool:
    return TAKE_DEBRIS.fullmatch(name) is not None


async def begin(plugin: StoragePlugin, where: str, options: Options) -> asyncio.Future[None]:
    """On rank 0 before any blob: checks that the take may write at its path, and starts
    writing the pending marker (which the commit and a failed take's cleanup wait for).
    Raises ``SnapshotExistsError`` or ``PathNotEmptyError``."""
    names = (MANIFEST_NAME, *FOREIGN_MARKERS)
    listing = functools.partial(plugin.list_names, LISTED_NAMES)
    listed = await call(plugin, "list", "", where, listing, options=options)
    names_there = list(listed) if isinstance(listed, (list, tuple)) else None
    if names_there is not None and len(names_there) < LISTED_NAMES:
        # A whole listing (local disk, memory, S3) answers for the marker files: one request.
        found = [n in names_there for n in names]
    else:  # a store that cannot list cheaply, or more names than were listed: ask for each
        checks = [
            call(plugin, "check", n, where, functools.partial(plugin.exists, n), options=options)
            for n in names
        ]
        found = await asyncio.gather(*checks)
    if found[0]:
        raise SnapshotExistsError(
            f"{where} already holds a snapshot; take a new one at another path, "
            "or delete this one first"
        )
    for name, there in zip(names[1:], found[1:], strict=True):
        if there:
            raise SnapshotExistsError(
                f"{where} holds {FOREIGN_MARKERS[name]} ({name}), which statesnap never "
                "writes into; take the snapshot at another path"
            )
    # Nor into a directory holding files of its own (stores that list cheaply only: local
    # disk, memory, S3); missing, empty, or holding what an interrupted take left is fine.
    others = sorted(n for n in names_there or () if TAKE_DEBRIS.fullmatch(n) is None)
    if others:
        shown = ", ".join(repr(n) for n in others[:5]) + (", ..." if len(others) > 5 else "")
        raise PathNotEmptyError(
            f"{where} is not empty: it holds {shown}, which no snapshot wrote; take the "
            "snapshot at a new or empty directory, or move those files away first"
        )
    marker = f"pid {os.getpid()} started {time.time():.3f}\n".encode()
    write = functools.partial(plugin.write, PENDING_NAME, [marker])
    return asyncio.ensure_future(call(plugin, "write", PENDING_NAME, where, write, options=options))


async def commit(plugin: StoragePlugin, manifest: bytes, options: Options) -> None:
    """Makes the snapshot visible once every rank's blobs are durable (each rank synced its
    own): the manifest, then the manifest durable. A crash at any point leaves either no
    manifest (an incomplete snapshot) or a complete one."""
    where = plugin_location(plugin)

    async def lost() -> bool:
        # Only if no manifest is there: of two takes racing at one path, the first wins.
        try:
            await plugin.write_if_absent(MANIFEST_NAME, [manifest])
        except FileExistsError:
            # Ours, if an earlier attempt of this call landed but its answer was lost.
            return await plugin.read(MANIFEST_NAME) != manifest
        return False

    if await call(plugin, "write", MANIFEST_NAME, where, lost, options=options):
        raise SnapshotExistsError(
            f"{where}: another take committed a snapshot at this path while this one was "
            "writing; that snapshot stays as it is, and nothing of this take is committed "
            "(its blobs are removed)"
        )
    await call(plugin, "sync", "", where, plugin.sync, options=options)
    try:
        await plugin.delete(PENDING_NAME)
    except FileNotFoundError:
        pass
    except OSError:
        logger.warning("snapshot %s committed, but its pending marker could not be removed", where)


async def not_committed(plugin: StoragePlugin, manifest: bytes | None) -> bool:
    """After a failed commit: whether the path surely holds no manifest of this take (read back;
    an answer lost on its way back may hide a write that landed)."""
    if manifest is None:
        return True
    try:
        return await plugin.read(MANIFEST_NAME) != manifest
    except FileNotFoundError:
        return True
    except Exception:
        return False


async def remove_written(
    plugin: StoragePlugin,
    where: str,
    blobs: list[str],
    marker_write: asyncio.Future[None] | None,
) -> None:
    """Best effort removal of what a failed take wrote on this rank (``blobs``, and the pending
    marker when this rank started writing it), then storage closed."""
    if marker_write is not None:
        with contextlib.suppress(Exception):
            await marker_write  # so that it cannot land after its deletion
        blobs = [*blobs, PENDING_NAME]
    failed: list[tuple[str, Exception]] = []
    try:
        for blob in blobs:  # each on its own: one that cannot be removed leaves the others
            try:
                await plugin.delete(blob)
            except (FileNotFoundError, NotADirectoryError):
                pass  # never written
            except Exception as e:
                failed.append((blob, e))
    finally:
        await plugin.close()
    if failed:
        blob, error = failed[0]
        logger.warning(
            "could not remove %d blob(s) of a failed take at %s; the first, %s: %s: %s",
            len(failed), where, blob, type(error).__name__, error,
        )  # fmt: skip
