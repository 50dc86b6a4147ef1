"""Snapshots of other formats at a snapshot's path.

torchsnapshot 0.1.0: its manifest (``.snapshot_metadata``) is translated into this library's
``Manifest`` when the snapshot is opened (:mod:`.torchsnapshot_translator`), so the one loader
reads it; this module finds and parses it, and asks the store for the lengths of pickles' files,
which torchsnapshot does not record (nor checksums). Every byte of it is untrusted.

A torch.distributed.checkpoint directory, or a single ``torch.save`` file, given as a snapshot's
path is recognized too, and refused with what to load it with instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import manifest as mf
from manifest import Manifest, ShardedTensorEntry
from snapshot._engine.format.text import printable_message
from snapshot._engine.format.torchsnapshot_translator import Translator
from snapshot._engine.io.storage_calls import call, read_unrecorded, refused
from snapshot._engine.runtime import run
from snapshot.errors import (
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    SnapshotError,
    StorageError,
    UnsafeSnapshotError,
)
from snapshot.options import Options
from storage_plugins import StoragePlugin, UnsafeBlobError

logger = logging.getLogger("snapshot")

METADATA_NAME = ".snapshot_metadata"
"""torchsnapshot's manifest, at the root of its snapshot."""

DCP_METADATA_NAME = ".metadata"
"""torch.distributed.checkpoint's metadata file, at the root of its checkpoint."""

FOREIGN_MARKERS = {
    METADATA_NAME: "a torchsnapshot snapshot",
    DCP_METADATA_NAME: "a torch.distributed.checkpoint (DCP) checkpoint",
}
"""Files that say a path holds another library's checkpoint, which a take must not write into."""


# ---------------------------------------------------------------------------------------------
# Opening a path that holds no manifest of ours.


def open_foreign(
    plugin: StoragePlugin,
    where: str,
    url: str,
    storage_options: dict[str, Any] | None,
    options: Options,
) -> Manifest | None:
    """What ``url`` (opened as ``plugin``, described as ``where``) holds when it has no
    ``manifest.yaml``: a torchsnapshot snapshot's manifest, translated; None when nothing is
    recognized there. ``options`` (resolved) are the call's: its storage calls' retries and
    deadline, and how many length requests are in flight at once (``max_concurrent_io``).

    Raises:
        IncompatibleSnapshotError: ``url`` holds a DCP checkpoint or is a ``torch.save`` file
            (the message says how to load it), or a torchsnapshot snapshot of a layout this
            translator does not know.
        CorruptSnapshotError: the torchsnapshot manifest is damaged.
    """

    async def look() -> bytes | bool:
        # The torchsnapshot manifest's bytes; else whether DCP's metadata file is there.
        try:
            return await read_unrecorded(plugin, METADATA_NAME, where, options)
        except (FileNotFoundError, NotADirectoryError):
            pass
        name, exists = DCP_METADATA_NAME, lambda: plugin.exists(DCP_METADATA_NAME)
        try:
            return await call(plugin, "check", name, where, exists, options=options, convert=False)
        except (FileNotFoundError, NotADirectoryError):
            return False

    try:
        found = run(look())
        if isinstance(found, bytes):
            return translate(found, where, lambda blobs: _blob_sizes(plugin, where, options, blobs))
    except SnapshotError:
        raise
    except UnsafeBlobError as e:  # DCP's marker, or a link on the way to it
        raise refused(where, e) from e
    except Exception as e:
        raise StorageError(f"cannot read the torchsnapshot manifest of {where}: {e}") from e
    if found:
        raise IncompatibleSnapshotError(
            f"{where} holds a torch.distributed.checkpoint (DCP) checkpoint ({DCP_METADATA_NAME}"
            "), not a statesnap snapshot: load it with torch.distributed.checkpoint.load("
            f"state_dict, checkpoint_id={url!r}), or convert it to one torch.save file with "
            "torch.distributed.checkpoint.format_utils.dcp_to_torch_save"
            f"({url!r}, 'checkpoint.pt')"
        )
    kind = _single_file(url)
    if kind is not None:
        raise IncompatibleSnapshotError(
            f"{where} is {kind}, not a statesnap snapshot (a directory): load it with "
            f"torch.load({url!r}, weights_only=True) and give each object its part "
            "(model.load_state_dict(...))"
        )
    return None


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


# ---------------------------------------------------------------------------------------------
# Translation.


def translate(
    data: bytes, where: str, sizes_of: Callable[[Iterable[str]], dict[str, int]]
) -> Manifest:
    """The ``Manifest`` of a torchsnapshot snapshot whose ``.snapshot_metadata`` holds
    ``data``; ``sizes_of(blobs)`` gives the lengths of whole-file blobs.

    Raises:
        CorruptSnapshotError: the manifest is not valid, or a field is missing, of the wrong
            type or out of range (a blob path leaving the root, a size that does not fit the
            dtype and shape).
        IncompatibleSnapshotError: an entry type, serializer or dtype this translator does not
            know.
    """
    source = f"{where}/{METADATA_NAME}"
    doc = _parse(data, source)
    if not isinstance(doc, dict) or set(doc) != {"version", "world_size", "manifest"}:
        keys = sorted(map(str, doc)) if isinstance(doc, dict) else type(doc).__name__
        raise CorruptSnapshotError(
            f"{source}: expected a mapping of version, world_size and manifest, got {keys}"
        )
    version, world_size, raw = doc["version"], doc["world_size"], doc["manifest"]
    if type(version) is not str or len(version) > 100:
        raise CorruptSnapshotError(f"{source}: version must be a short string, got {version!r}")
    if type(world_size) is not int or world_size < 1:
        raise CorruptSnapshotError(f"{source}: world_size must be >= 1, got {world_size!r}")
    if not isinstance(raw, dict):
        raise CorruptSnapshotError(f"{source}: manifest must be a mapping")
    # Two passes: the first checks everything and learns which blobs hold pickles (whose
    # lengths the store must give), the second builds the entries with those lengths.
    wanted: set[str] = set()

    def record(blob: str) -> int:
        wanted.add(blob)
        return 0

    Translator(source, version, world_size, raw, record).run()
    sizes = sizes_of(wanted) if wanted else {}
    entries = Translator(source, version, world_size, raw, sizes.__getitem__).run()
    sharded = any(type(e) is ShardedTensorEntry for e in entries.values())
    return Manifest(
        format_version=2 if sharded else 1,
        world_size=world_size,
        entries=entries,
        metadata={"library": f"torchsnapshot {version}", "format": "torchsnapshot"},
    )


def _parse(data: bytes, source: str) -> Any:
    """The document: torchsnapshot 0.1.0 writes JSON (which is YAML) and reads it as YAML; the
    JSON decoder reads it exactly, the YAML safe loader anything else."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptSnapshotError(f"{source} is not UTF-8 text: {e}") from None
    # Text nesting deeper than the codec's limit (or not balanced) goes to the YAML reader,
    # which refuses it without recursing; so does any YAML feature torchsnapshot never wrote
    # (its aliases would make the translation walk shared values once per reference).
    if mf.nests_within(text, mf.MAX_DEPTH):
        try:
            return json.loads(text)
        except ValueError:
            pass
    try:
        return mf.load_yaml(text, source)
    except mf.UnsafeManifestError as e:
        raise UnsafeSnapshotError(printable_message(str(e))) from None
    except mf.ManifestDecodeError as e:
        raise CorruptSnapshotError(
            printable_message(f"{source} is neither JSON nor YAML: {e}")
        ) from None
