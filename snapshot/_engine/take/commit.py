"""The commit protocol of a take: the names it writes at the top of a snapshot, the pending
marker written before the first blob (``begin``), the manifest written last (``commit``), and
the cleanup of what a failed take left (``remove_written``).

A snapshot is visible once its manifest is there, and only then: the manifest is written after
every blob is durable, and a path holding the pending marker without a manifest is a take that
was interrupted (``manifest_io`` says so; a new take there replaces what it left).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

import manifest as mf
from manifest import Entry, ShardedObjectEntry, ShardedTensorEntry, TensorEntry
from snapshot._engine.format.torchsnapshot_format import FOREIGN_MARKERS
from snapshot._engine.handlers.table import merge_entries
from snapshot._engine.io.storage_calls import call
from snapshot.errors import PathNotEmptyError, SnapshotExistsError
from snapshot.version import __version__
from storage_plugins import StoragePlugin

if TYPE_CHECKING:
    from snapshot.options import Options

logger = logging.getLogger("snapshot")

MANIFEST_NAME = "manifest.yaml"
# Written before the first blob and deleted after the commit: its presence without a manifest
# means a take was interrupted.
PENDING_NAME = ".statesnap-pending"

# What a take writes at the top of its directory, and so what an interrupted one may leave
# there (with the pending marker, or without it once its cleanup deleted the marker): rank
# directories of blobs ("0", "1", ...) and the local plugin's temporary files
# (".<name>.<12 hex digits>.tmp", renamed into place when written).
TAKE_DEBRIS = re.compile(r"[0-9]+|\.statesnap-pending|\..+\.[0-9a-f]{12}\.tmp")
# Names of the directory asked for before a take: beyond the debris of a few thousand ranks.
LISTED_NAMES = 4096


def left_by_a_take(name: str) -> bool:
    return TAKE_DEBRIS.fullmatch(name) is not None


def plugin_location(plugin: StoragePlugin) -> str:
    """The snapshot's location as messages name it."""
    return plugin.describe("").rstrip("/")


# ---------------------------------------------------------------------------------------------
# Before the first blob.


async def begin(plugin: StoragePlugin, where: str, options: Options) -> asyncio.Future[None]:
    """Checks that the take may write at the snapshot's path (rank 0, before any blob is
    written), and starts writing the pending marker; returns that write, which the commit, and
    the cleanup of a failed take, wait for. ``options``: each storage call's retries and
    deadline.

    Raises:
        SnapshotExistsError: the path holds a committed snapshot, or another library's
            checkpoint.
        PathNotEmptyError: the path holds files no snapshot wrote.
    """
    # Our manifest, and the files that mark another library's checkpoint (which statesnap
    # may read, but must never write into), asked about at once; and, at the same time,
    # the names the path holds (below).
    names = (MANIFEST_NAME, *FOREIGN_MARKERS)
    *found, listed = await asyncio.gather(
        *(
            call(plugin, "check", n, where, lambda n=n: plugin.exists(n), options=options)
            for n in names
        ),
        call(plugin, "list", "", where, lambda: plugin.list_names(LISTED_NAMES), options=options),
    )
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
    # Nor into a directory (or prefix) holding files of its own: the snapshot's would mix
    # with them, and deleting the snapshot would take them along or leave it half there.
    # Missing, empty, or holding what an interrupted take left is fine. Only stores that
    # can list cheaply are checked (``StoragePlugin.list_names``: local disk, memory, S3).
    others = sorted(n for n in listed or () if not left_by_a_take(n))
    if others:
        shown = ", ".join(repr(n) for n in others[:5]) + (", ..." if len(others) > 5 else "")
        raise PathNotEmptyError(
            f"{where} is not empty: it holds {shown}, which no snapshot wrote; take the "
            "snapshot at a new or empty directory, or move those files away first"
        )
    marker = f"pid {os.getpid()} started {time.time():.3f}\n".encode()
    # Written in the background, alongside the blobs; the commit waits for it. On local
    # disk the write is fsync'd, and an fsync may wait for the file system's journal to
    # commit whatever else is pending (such as the deletion of an older snapshot): time the
    # caller need not wait for.
    write = lambda: plugin.write(PENDING_NAME, [marker])  # noqa: E731
    return asyncio.ensure_future(call(plugin, "write", PENDING_NAME, where, write, options=options))


# ---------------------------------------------------------------------------------------------
# The manifest, written last.


def manifest_bytes(
    parts: Sequence[Mapping[str, Entry | str]],
    *,
    world_size: int,
    replicated_once: bool,
    strategies: dict[str, list[Any]] | None,
    user: Mapping[str, Any] | None = None,
) -> tuple[int, bytes]:
    """The number of entries and the bytes of the manifest holding every rank's entries
    (``parts``, in rank order); ``replicated_once`` when replicated leaves are listed once,
    under rank 0's prefix; ``strategies``, the backend and version that wrote each part;
    ``user``, the caller's own metadata (``Snapshot.take(user_metadata=...)``)."""
    entries = merge_entries(parts)
    # Version 2 adds sharded entries; a manifest without any stays readable by version 1.
    kinds = set(map(type, entries.values()))
    with_shards = ShardedTensorEntry in kinds or ShardedObjectEntry in kinds
    metadata = {
        "library": f"statesnap {__version__}",
        "torch": str(torch.__version__),
        "created_unix": round(time.time(), 3),
        **({"strategies": strategies} if strategies else {}),
        **({"user": dict(user)} if user is not None else {}),
    }
    # Version 3 lists a replicated leaf once, under rank 0's prefix: a manifest of several
    # ranks with such leaves is one an older reader would misread (``mf.FORMAT_VERSION``).
    if replicated_once and world_size > 1:
        version = mf.REPLICATED_ONCE_VERSION
    else:
        version = 2 if with_shards else 1
    # Version 4 adds what a tensor was beyond its values (a Parameter, requires_grad, a
    # view of another's storage); such entries are objects, never preformatted lines.
    if TensorEntry in kinds and any(
        e.has_attrs for e in entries.values() if type(e) is TensorEntry
    ):
        version = mf.TENSOR_ATTRS_VERSION
        # Version 5 adds digests and ranges in a sibling snapshot (an incremental take).
        if any(
            e.digest is not None or any(c.blob.startswith(mf.REFERENCE_PREFIX) for c in e.chunks)
            for e in entries.values()
            if type(e) is TensorEntry
        ):
            version = mf.INCREMENTAL_VERSION
    data = mf.dumps_entries(version, world_size, metadata, entries)
    return len(entries), data


async def commit(plugin: StoragePlugin, manifest: bytes, options: Options) -> None:
    """Makes the snapshot visible: blobs durable, then the manifest, then the manifest durable.

    Nothing before the manifest's write makes the snapshot visible; a crash at any point leaves
    either no manifest (an incomplete snapshot) or a complete one. ``options``: each storage
    call's retries and deadline.
    """
    where = plugin_location(plugin)
    lost = False

    async def write() -> None:
        # Only if no manifest is there: of two takes racing at one path (each writing blobs of
        # its own names: ``Layout.take_id``), the first manifest wins and the other fails.
        nonlocal lost
        try:
            await plugin.write_if_absent(MANIFEST_NAME, [manifest])
        except FileExistsError:
            # Ours, if an earlier attempt of this call landed but its answer was lost (a
            # manifest names its own take's blobs: no other take's is the same).
            lost = await plugin.read(MANIFEST_NAME) != manifest

    await call(plugin, "sync", "", where, plugin.sync, options=options)
    await call(plugin, "write", MANIFEST_NAME, where, write, options=options)
    if lost:
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


# ---------------------------------------------------------------------------------------------
# After a failure.


async def remove_written(
    plugin: StoragePlugin,
    where: str,
    blobs: list[str],
    marker_write: asyncio.Future[None] | None,
) -> None:
    """Best effort removal of what a failed take wrote on this rank (``blobs``, and the pending
    marker when this rank started writing it: ``marker_write``), then storage closed."""
    blobs = list(blobs)
    if marker_write is not None:
        with contextlib.suppress(Exception):
            await marker_write  # so that it cannot land after its deletion
        blobs.append(PENDING_NAME)
    failed: list[tuple[str, Exception]] = []
    try:
        # Each blob on its own: one that cannot be removed (a link on its way, which the
        # plugin refuses to follow) leaves the others, the marker too, to be removed.
        for blob in blobs:
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
            len(failed),
            where,
            blob,
            type(error).__name__,
            error,
        )
