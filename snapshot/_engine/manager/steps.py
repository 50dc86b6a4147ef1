"""The step folders under a checkpoint manager's root, on any store: listing them, telling
what each one holds, reading what each committed one records, and deleting one.

A step folder is ``<root>/step_<step>`` (``step_name``: ten digits, so that names sort as
steps do; any ``step_<digits>`` is read, and the name found is the one used). It is committed
when it holds a snapshot's manifest, the commit point of every take: nothing else (no pointer
file) says which steps exist, so the listing cannot disagree with what a restore would find.

What may be deleted (docs/reliability.md, "Checkpoint manager and deletions"): a folder is
deleted only once ``survey`` has found in it nothing but a manifest and what a take writes
(``TAKE_DEBRIS`` at the top, blobs and temporary files in the rank folders) and no link; a
folder without a manifest only when it also holds the pending marker (or its take is known to
have failed). Deleting a committed step writes the pending marker first, then removes the
manifest, then the blobs, the marker last: a deletion cut short at any point leaves either the
committed snapshot or marked debris, which the next round deletes.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from snapshot._engine.format.manifest_io import load_manifest
from snapshot._engine.io.io_loop import run
from snapshot._engine.io.storage_calls import open_storage
from snapshot._engine.take.commit import MANIFEST_NAME, PENDING_NAME, left_by_a_take
from snapshot._engine.take.incremental import sibling_path
from snapshot.errors import InvalidArgumentError, SnapshotError, StorageError, UnsafeSnapshotError
from snapshot.options import Options
from storage_plugins.fs import FSStoragePlugin
from storage_plugins.registry import resolve_factory, split_url

logger = logging.getLogger("snapshot")

_STEP = re.compile(r"step_([0-9]{1,18})")
# The most names a listing of a root may return (an S3 listing pages through 1,000 at a time).
LIST_LIMIT = 1_000_000
# What a take writes in a rank's folder: blobs ``[<take id>-][r][s]<n>`` (``plan.Placer``:
# ``r`` a replicated payload's, ``s`` a slab) and the local plugin's temporary files
# (``.<name>.<12 hex digits>.tmp``, renamed into place once written).
_RANK = re.compile(r"[0-9]+")
_BLOB = re.compile(r"(?:[0-9a-f]{8}-)?r?s?[0-9]+")
_TEMP = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")
# How many names no take writes a refusal quotes.
_SHOWN = 5

# The states of a step folder (``StepInfo.state``).
COMMITTED = "committed"  # a manifest this library reads: a step to restore, keep or let go
UNREADABLE = "unreadable"  # a manifest that cannot be read: kept, never the latest
INCOMPLETE = "incomplete"  # the pending marker and nothing but take debris: deleted
LEFT = "left alone"  # anything else (a link, a file, another library's or a user's): kept
# Why an entry named like a step is no step folder: it never counts as a step's folder.
A_LINK = "it is a symbolic link (never followed)"
NOT_A_FOLDER = "it is not a folder"
NOT_FOLDERS = (A_LINK, NOT_A_FOLDER)


def step_name(step: int) -> str:
    return f"step_{step:010d}"


def step_of(name: str) -> int | None:
    """The step a folder name says (``step_0000000100`` -> 100), or None for other names."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def join(root: str, name: str) -> str:
    """The path of ``name`` under ``root`` (a local folder, or a URL's prefix)."""
    return f"{root.rstrip('/')}/{name}" if "://" in root else sibling_path(f"{root}/x", name)


def local_path(url: str) -> str | None:
    """The local file system path ``url`` names when the local plugin serves it (links are
    then told apart with ``lstat``), else None."""
    try:
        protocol, rest = split_url(url)
        if protocol not in ("fs", "file"):
            return None
        factory, _ = resolve_factory(protocol)
    except (ValueError, ImportError):
        return None
    if not (isinstance(factory, type) and issubclass(factory, FSStoragePlugin)):
        return None
    return os.path.abspath(os.path.expanduser(rest))


@dataclass(frozen=True)
class Contents:
    """What a folder holds, as far as deleting it goes: whether it exists, holds a manifest and
    the pending marker, and ``refusal``: why it is not provably the library's (a link, not a
    folder, names no take writes), empty when it holds nothing but a manifest and take
    debris."""

    exists: bool
    manifest: bool = False
    marker: bool = False
    refusal: str = ""


def _refusal(foreign: list[str]) -> str:
    shown = ", ".join(repr(n) for n in foreign[:_SHOWN])
    more = f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else ""
    return f"it holds {shown}{more}, which no take writes"


def _survey_local(path: str) -> Contents:
    """``survey`` on local disk: ``lstat`` and ``scandir``, never following a link."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return Contents(False)
    if stat.S_ISLNK(mode):
        return Contents(True, refusal=A_LINK)
    if not stat.S_ISDIR(mode):
        return Contents(True, refusal=NOT_A_FOLDER)
    manifest = marker = False
    foreign: list[str] = []
    try:
        entries = os.scandir(path)
    except FileNotFoundError:  # deleted since (by the manager's worker)
        return Contents(False)
    with entries:
        for e in entries:
            is_file = e.is_file(follow_symlinks=False)
            if e.name == MANIFEST_NAME and is_file:
                manifest = True
            elif e.name == PENDING_NAME and is_file:
                marker = True
            elif _TEMP.fullmatch(e.name) and is_file:
                pass
            elif _RANK.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
                try:
                    blobs = os.scandir(e.path)
                except FileNotFoundError:
                    continue
                with blobs:
                    for b in blobs:
                        if not (
                            b.is_file(follow_symlinks=False)
                            and (_BLOB.fullmatch(b.name) or _TEMP.fullmatch(b.name))
                        ):
                            foreign.append(f"{e.name}/{b.name}")
            else:
                foreign.append(e.name)
    return Contents(True, manifest, marker, _refusal(foreign) if foreign else "")


def _list(url: str, storage_options: dict[str, Any] | None, options: Options) -> list[str] | None:
    with open_storage(url, storage_options, options) as plugin:
        return run(plugin.list_names(LIST_LIMIT))


def _survey_store(path: str, storage_options: dict[str, Any] | None, options: Options) -> Contents:
    """``survey`` through the storage plugin (object stores hold no links): the names at the
    top, and those in each rank's folder."""
    with open_storage(path, storage_options, options) as plugin:

        async def top() -> tuple[list[str] | None, bool, bool]:
            names = await plugin.list_names(LIST_LIMIT)
            if names is None:
                return None, False, False
            manifest = MANIFEST_NAME in names and await plugin.exists(MANIFEST_NAME)
            marker = PENDING_NAME in names and await plugin.exists(PENDING_NAME)
            return names, manifest, marker

        names, manifest, marker = run(top())
    if names is None:
        return Contents(True, refusal=f"the store at {path} cannot list what it holds")
    if not names:
        return Contents(False)
    foreign = []
    for n in names:
        if (n == MANIFEST_NAME and manifest) or (n == PENDING_NAME and marker):
            continue
        if _TEMP.fullmatch(n):
            continue
        if _RANK.fullmatch(n):
            inner = _list(join(path, n), storage_options, options)
            if inner is None:
                foreign.append(f"{n}/ (which cannot be listed)")
                continue
            foreign += [f"{n}/{b}" for b in inner if not (_BLOB.fullmatch(b) or _TEMP.fullmatch(b))]
            continue
        foreign.append(n)
    return Contents(True, manifest, marker, _refusal(foreign) if foreign else "")


def survey(path: str, storage_options: dict[str, Any] | None, options: Options) -> Contents:
    """What the folder at ``path`` holds (``Contents``).

    Raises:
        StorageError: the store failed to list it.
    """
    try:
        local = local_path(path)
        if local is not None:
            return _survey_local(local)
        return _survey_store(path, storage_options, options)
    except SnapshotError:
        raise
    except Exception as e:
        raise StorageError(f"cannot list what {path} holds: {e}") from e


@dataclass(frozen=True)
class StepInfo:
    """One step folder: its ``state`` (``COMMITTED``, ``UNREADABLE``, ``INCOMPLETE``,
    ``LEFT``); for a committed one, what its manifest records (the ``metrics``, the bases it
    needs, the bytes of its own blobs); else ``reason``, why it is not committed or not
    deleted. ``debris``: it holds nothing but what a take writes, with or without the pending
    marker (a take may write there)."""

    step: int
    name: str
    state: str
    metrics: dict[str, Any] = field(default_factory=dict)
    bases: tuple[str, ...] = ()
    nbytes: int = 0
    reason: str = ""
    debris: bool = False

    @property
    def committed(self) -> bool:
        """A committed snapshot this library reads."""
        return self.state == COMMITTED


class Steps:
    """Step folders under ``root``: ``scan`` and ``delete``. What a committed step's manifest
    records is read once per folder name and remembered (a committed snapshot never
    changes; a deleted one is forgotten)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None, options: Options):
        self.root = root
        self.storage_options = storage_options
        self.options = options
        self._read: dict[str, StepInfo] = {}
        self._local = local_path(root)

    def path(self, name: str) -> str:
        return join(self.root, name)

    def _kinds(self) -> list[tuple[str, str]]:
        """Each step-named entry under the root and what it is: ``"committed"`` (a manifest
        there), ``"folder"`` (none), or why it is no step folder (a link, a file)."""
        if self._local is not None:
            try:
                with os.scandir(self._local) as entries:
                    names = [e.name for e in entries if step_of(e.name) is not None]
            except FileNotFoundError:
                return []
            out = []
            for n in names:
                try:
                    mode = os.lstat(os.path.join(self._local, n)).st_mode
                except FileNotFoundError:  # deleted since (by the manager's worker)
                    continue
                if stat.S_ISLNK(mode):
                    out.append((n, A_LINK))
                elif not stat.S_ISDIR(mode):
                    out.append((n, NOT_A_FOLDER))
                else:
                    # A manifest that is a link or not a file counts: reading it says why
                    # the step cannot be read (``load_manifest`` refuses it).
                    there = os.path.lexists(os.path.join(self._local, n, MANIFEST_NAME))
                    out.append((n, "committed" if there else "folder"))
            return out
        with open_storage(self.root, self.storage_options, self.options) as plugin:

            async def listing() -> list[tuple[str, str]]:
                names = await plugin.list_names(LIST_LIMIT)
                if names is None:
                    raise StorageError(
                        f"the store at {self.root} cannot list its folders: a checkpoint "
                        "manager finds its steps by listing the root"
                    )
                found = [n for n in names if step_of(n) is not None]
                return [
                    (n, "committed" if await plugin.exists(f"{n}/{MANIFEST_NAME}") else "folder")
                    for n in found
                ]

            return run(listing())

    def scan(self) -> list[StepInfo]:
        """Every step-named entry under the root, by step; an empty list when the root does not
        exist yet.

        Raises:
            StorageError: the root, or a folder's contents, could not be listed.
            InvalidArgumentError: two folders hold the same step (``step_5`` and
                ``step_0000000005``): the manager does not choose between them.
        """
        t = time.perf_counter()
        try:
            kinds = self._kinds()
        except SnapshotError:
            raise
        except Exception as e:
            raise StorageError(f"cannot list the steps under {self.root}: {e}") from e
        out = []
        for name, kind in kinds:
            step = step_of(name)
            assert step is not None
            if kind == "committed":
                info = self._read.get(name)
                if info is None:
                    info = self._read_step(step, name)
                    if info.committed:
                        self._read[name] = info
            elif kind == "folder":
                found = self._incomplete(step, name)
                if found is None:
                    continue
                info = found
            else:
                info = StepInfo(step, name, LEFT, reason=kind)
            out.append(info)
        folders: dict[int, list[str]] = {}
        for s in out:
            if s.reason not in NOT_FOLDERS:
                folders.setdefault(s.step, []).append(s.name)
        for step, names in folders.items():
            if len(names) > 1:
                shown = " and ".join(self.path(n) for n in sorted(names))
                raise InvalidArgumentError(
                    f"two folders under {self.root} hold step {step}: {shown}; the checkpoint "
                    "manager does not choose between them (nothing was deleted): move one away"
                )
        out.sort(key=lambda s: s.step)
        logger.debug(
            "steps under %s: %d folders (%d committed) in %.3f s",
            self.root,
            len(out),
            sum(s.committed for s in out),
            time.perf_counter() - t,
        )
        return out

    def _incomplete(self, step: int, name: str) -> StepInfo | None:
        """A folder without a manifest: ``INCOMPLETE`` when it holds the pending marker and
        nothing but take debris, else ``LEFT``; None when it is gone (or, on an object store,
        holds nothing)."""
        c = survey(self.path(name), self.storage_options, self.options)
        if not c.exists:
            return None
        if c.refusal:
            return StepInfo(step, name, LEFT, reason=c.refusal)
        if not c.marker:
            return StepInfo(
                step,
                name,
                LEFT,
                reason="it holds no pending marker: nothing proves a take of statesnap left it",
                debris=True,
            )
        return StepInfo(step, name, INCOMPLETE, reason="a take that never finished", debris=True)

    def _read_step(self, step: int, name: str) -> StepInfo:
        try:
            m = load_manifest(self.path(name), self.storage_options, self.options)
        except SnapshotError as e:
            return StepInfo(step, name, UNREADABLE, reason=str(e))
        user = m.metadata.get("user")
        metrics = user.get("metrics") if isinstance(user, dict) else None
        own = sum(end for blob, end in m.blob_sizes.items() if not blob.startswith("../"))
        return StepInfo(
            step,
            name,
            COMMITTED,
            metrics=dict(metrics) if isinstance(metrics, dict) else {},
            bases=m.bases,
            nbytes=own,
        )

    def delete(self, name: str, *, unmarked: bool = False) -> None:
        """Deletes the step folder ``name`` (``delete_snapshot``)."""
        self._read.pop(name, None)
        t = time.perf_counter()
        delete_snapshot(self.path(name), self.storage_options, self.options, unmarked=unmarked)
        logger.info("deleted %s in %.3f s", self.path(name), time.perf_counter() - t)


def delete_snapshot(
    path: str,
    storage_options: dict[str, Any] | None,
    options: Options,
    *,
    unmarked: bool = False,
) -> None:
    """Deletes the snapshot, or the debris of a take, at ``path``, once ``survey`` has found
    nothing there but a manifest and what a take writes, and the manifest or the pending
    marker (``unmarked``: a folder of a take known to have failed, which may lack the marker).
    A committed snapshot gets the pending marker first, then loses its manifest (from then on
    it is debris, never a snapshot that looks committed), then its blobs, the marker last.
    Nothing there: nothing to do.

    Raises:
        UnsafeSnapshotError: ``path`` is a link, or holds what the library did not write, or
            nothing proves a take wrote it; nothing was deleted.
        StorageError: the store refused or failed; what was deleted stays deleted.
    """
    c = survey(path, storage_options, options)
    if not c.exists:
        return
    if c.refusal:
        raise UnsafeSnapshotError(f"{path} is not deleted: {c.refusal}")
    if not (c.manifest or c.marker or unmarked):
        raise UnsafeSnapshotError(
            f"{path} is not deleted: it holds neither a manifest nor the pending marker of a "
            "take, so nothing proves statesnap wrote it"
        )
    with open_storage(path, storage_options, options) as plugin:

        async def mark() -> list[str]:
            if c.manifest:
                if not c.marker:
                    await plugin.write(PENDING_NAME, [b"deleting\n"])
                    await plugin.sync()
                try:
                    await plugin.delete(MANIFEST_NAME)
                except FileNotFoundError:
                    pass
            names = await plugin.list_names(LIST_LIMIT)
            return [n for n in names or () if n != PENDING_NAME]

        try:
            rest = run(mark())
            # The blobs, each rank's folder at once; the marker and the folder last.
            for n in rest:
                if _RANK.fullmatch(n):
                    with open_storage(join(path, n), storage_options, options) as rank:
                        run(rank.delete_all())
                elif left_by_a_take(n):
                    run(plugin.delete(n))

            async def finish() -> None:
                try:
                    await plugin.delete(PENDING_NAME)
                except FileNotFoundError:
                    pass
                await plugin.delete_all()

            run(finish())
        except SnapshotError:
            raise
        except Exception as e:
            raise StorageError(f"cannot delete {path}: {e}") from e
