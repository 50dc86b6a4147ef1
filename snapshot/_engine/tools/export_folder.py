"""The output folder of an export: its files put in place whole, never mixed with another
export's.

Every file is written into a staging folder inside the output folder (``stage``), and put in
place only once all of them are whole and synced (``put_in_place``). An output folder that
holds an earlier export is refused, unless ``overwrite``; then the earlier export's files (only
those its record ``.statesnap-export.json`` lists, of the names an export writes, and regular
files: checked first, moved second) are moved aside, the new files moved in, and the old ones
deleted with the staging folder only after; a failure before that moves everything back. Every
old file leaves before any new one enters, an index before its files and after them: at no
moment does the folder hold files of both exports, or an index naming a file not there. The
user's other files (``config.json``...) are never moved.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Sequence
from typing import BinaryIO

from snapshot.errors import InvalidArgumentError, StorageError
from storage_plugins.fs import missing_folders

logger = logging.getLogger("snapshot")


def write_file(path: str, fill: Callable[[BinaryIO], object]) -> None:
    """Creates the file ``path`` (never one that exists), has ``fill`` write it, and syncs it."""
    with open(path, "xb") as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())


def sync_folder(path: str) -> None:
    """Makes the entries of folder ``path`` (files created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# The record of the files an export put in a folder: what a later export with ``overwrite``
# may replace, and nothing else.
RECORD = ".statesnap-export.json"
# The folder inside the output folder that an export writes into before putting its files in
# place (inside, not beside it: the output folder may be a mount point, and a rename does not
# cross file systems).
STAGING_PREFIX = ".statesnap-export-"
# The names an export (of either format) writes; files of these names are an earlier export.
EXPORT_NAME = re.compile(
    r"model(-\d{5,}-of-\d{5,})?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model(-\d{5,}-of-\d{5,})?\.bin|pytorch_model\.bin\.index\.json"
)
# A record larger than this is not one an export wrote (it lists a few names per shard).
_MAX_RECORD_BYTES = 1 << 20


def recorded_names(out_dir: str) -> set[str]:
    """The names ``out_dir``'s record lists that an export writes (anything else it lists is
    ignored: the record is a file anyone can edit). Empty when there is no record, or it is a
    link, not a regular file, too large or not an export's JSON."""
    try:
        fd = os.open(os.path.join(out_dir, RECORD), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return set()
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return set()
        data = f.read(_MAX_RECORD_BYTES + 1)
    try:
        record = json.loads(data) if len(data) <= _MAX_RECORD_BYTES else None
    except ValueError:
        return set()
    listed = record.get("files") if isinstance(record, dict) else None
    if not isinstance(listed, list):
        return set()
    return {n for n in listed if isinstance(n, str) and EXPORT_NAME.fullmatch(n)}


def earlier_export(out_dir: str, overwrite: bool) -> list[str]:
    """The names of the files of an earlier export in ``out_dir`` that this export replaces
    (none when the folder is missing or holds none). Reads only: a folder holding an export is
    refused without ``overwrite``; with it, every file of an export's name must be one that the
    folder's record says an export wrote, and a regular file (a link is never followed nor
    removed); otherwise it is refused, naming them, and the user's files stay as they are. A
    record that is not a regular file is refused too: the new record would replace it."""
    try:
        names = os.listdir(out_dir)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise InvalidArgumentError(f"export: {out_dir} is not a folder") from None
    except OSError as e:
        raise StorageError(f"export: cannot list the folder {out_dir}: {e}") from e
    found = sorted(n for n in names if EXPORT_NAME.fullmatch(n))
    if RECORD in names and not stat.S_ISREG(os.lstat(os.path.join(out_dir, RECORD)).st_mode):
        raise InvalidArgumentError(
            f"export: {os.path.join(out_dir, RECORD)} is not a regular file (a link, or a "
            "folder), where an export keeps its record: remove it yourself, or choose another "
            "folder"
        )
    if not found:
        return []
    if not overwrite:
        raise InvalidArgumentError(
            f"export: {out_dir} already holds an export ({', '.join(found)}); pass "
            "overwrite=True (statesnap export --overwrite) to replace it, or choose another "
            "folder"
        )
    recorded = recorded_names(out_dir)
    unrecorded = [n for n in found if n not in recorded]
    if unrecorded:
        raise InvalidArgumentError(
            f"export: {out_dir} holds {', '.join(unrecorded)}, which no statesnap export "
            f"recorded writing ({RECORD} does not list them); an export replaces only files it "
            "wrote: remove them yourself, or choose another folder"
        )
    for n in found:
        if not stat.S_ISREG(os.lstat(os.path.join(out_dir, n)).st_mode):
            raise InvalidArgumentError(
                f"export: {os.path.join(out_dir, n)} is not a regular file (a link, or a "
                "folder); an export replaces only files it wrote: remove it yourself, or "
                "choose another folder"
            )
    return found


def _leaving(names: Sequence[str]) -> list[str]:
    """The earlier export's ``names`` in the order they leave the folder: an index before the
    files it names (so that no index names a file gone), the record last."""
    return sorted(names, key=lambda n: (n == RECORD, not n.endswith(".index.json"), n))


def _entering(names: Sequence[str]) -> list[str]:
    """The new export's ``names`` in the order they enter the folder: an index after the files
    it names (so that no index names a file not there yet), the record last."""
    return sorted(names, key=lambda n: (n == RECORD, n.endswith(".index.json"), n))


def put_in_place(out_dir: str, staging: str, names: Sequence[str], overwrite: bool) -> None:
    """Moves the files ``names`` of the complete export in ``staging`` into ``out_dir``. The
    earlier export's files (checked again: the folder may have changed while the export was
    written) are first moved aside into ``staging/previous``, where they are deleted with the
    staging folder once the new files are in. When a move fails, every move made is undone
    before the error is raised: the folder then holds the earlier export as it was."""
    old = earlier_export(out_dir, overwrite)
    if os.path.lexists(os.path.join(out_dir, RECORD)):
        old.append(RECORD)  # replaced by the new record (the files it listed are in ``old``)
    previous = os.path.join(staging, "previous")
    os.mkdir(previous)
    # Every old file leaves before any new one enters: at no moment does the folder hold
    # files of both.
    moves = [(os.path.join(out_dir, n), os.path.join(previous, n)) for n in _leaving(old)]
    moves += [(os.path.join(staging, n), os.path.join(out_dir, n)) for n in _entering(names)]
    done: list[tuple[str, str]] = []
    try:
        for src, dst in moves:
            os.rename(src, dst)
            done.append((src, dst))
        sync_folder(out_dir)
    except BaseException:
        try:
            for src, dst in reversed(done):
                os.rename(dst, src)
            sync_folder(out_dir)
        except OSError as e:
            logger.error(
                "export: could not put back the earlier export in %s (%s); its files are in %s",
                out_dir,
                e,
                previous,
            )
        raise


def stage(
    out_dir: str,
    overwrite: bool,
    write: Callable[[str], list[str]],
) -> list[str]:
    """Runs ``write`` (which writes an export's files into the folder it is given and returns
    their names) in a new staging folder inside ``out_dir``, adds the record, and puts the
    files in place (``put_in_place``); returns their paths. The staging folder is removed
    whatever happens (unless it holds files of the earlier export that could not be put back),
    and so is ``out_dir`` when this made it and the export failed. A failure of the local
    file system (a full disk, a permission) is a ``StorageError`` naming ``out_dir``."""
    try:
        return _stage(out_dir, overwrite, write)
    except OSError as e:
        raise StorageError(f"export: cannot write the export into {out_dir}: {e}") from e


def _stage(out_dir: str, overwrite: bool, write: Callable[[str], list[str]]) -> list[str]:
    made = missing_folders(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    staging = os.path.join(out_dir, f"{STAGING_PREFIX}{uuid.uuid4().hex[:12]}")
    os.mkdir(staging)
    try:
        names = write(staging)
        record = json.dumps({"written_by": "statesnap export", "files": names}, indent=2)
        write_file(os.path.join(staging, RECORD), lambda f: f.write(record.encode() + b"\n"))
        sync_folder(staging)
        put_in_place(out_dir, staging, [*names, RECORD], overwrite)
    except BaseException:
        previous = os.path.join(staging, "previous")
        if not (os.path.isdir(previous) and os.listdir(previous)):
            shutil.rmtree(staging, ignore_errors=True)
        for folder in made:
            try:
                os.rmdir(folder)  # only when empty: nothing but what this export made
            except OSError:
                break
        raise
    try:
        shutil.rmtree(staging)  # the new files moved out; the earlier export's files, if any
    except OSError as e:  # the export is in place: say what is left, and return it
        logger.warning("export: could not remove the staging folder %s: %s", staging, e)
    return [os.path.join(out_dir, n) for n in names]
