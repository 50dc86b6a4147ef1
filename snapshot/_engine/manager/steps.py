"""The step folders under a checkpoint manager's root, on any store: listing them, telling
what each holds, reading what each committed one records, and deleting one.

A step folder is ``<root>/step_<step>`` (``step_name``: ten digits; any ``step_<digits>`` is
read). It is committed when it holds a manifest, the commit point of every take: no pointer
file can disagree with what a restore finds. A folder is deleted only once ``survey`` found in
it nothing but a manifest and what a take writes, and no link; one without a manifest only when
it holds the pending marker (or its take is known to have failed). A committed step gets the
pending marker first, then loses its manifest, its blobs, the marker last: a deletion cut short
leaves the committed snapshot or marked debris (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from snapshot._engine.format.manifest_io import load_manifest, sibling_path
from snapshot._engine.io.storage_calls import open_storage
from snapshot._engine.runtime import run
from snapshot._engine.take.commit import (
    MANIFEST_NAME,
    PENDING_NAME,
    SIGNATURE_NAME,
    left_by_a_take,
)
from snapshot.errors import InvalidArgumentError, SnapshotError, StorageError, UnsafeSnapshotError
from snapshot.options import Options
from storage_plugins.fs import FSStoragePlugin
from storage_plugins.registry import resolve_factory, split_url

logger = logging.getLogger("snapshot")

_STEP = re.compile(r"step_([0-9]{1,18})")
LIST_LIMIT = 1_000_000  # the most names a listing of a root may return
# What a take writes in a rank's folder: blobs ``[<take id>-][r][s]<n>`` (``plan.Placer``)
# and the local plugin's temporary files (``.<name>.<12 hex digits>.tmp``).
_RANK = re.compile(r"[0-9]+")
_BLOB = re.compile(r"(?:[0-9a-f]{8}-)?r?s?[0-9]+")
_TEMP = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")
_SHOWN = 5  # how many names no take writes a refusal quotes

# The states of a step folder (``StepInfo.state``).
COMMITTED = "committed"  # a manifest this library reads: a step to restore, keep or let go
UNREADABLE = "unreadable"  # a manifest that cannot be read: kept, never the latest
INCOMPLETE = "incomplete"  # the pending marker and nothing but take debris: deleted
LEFT = "left alone"  # anything else (a link, a file, another library's or a user's): kept
# Why an entry named like a step is no step folder: it never counts as a step's folder.
A_LINK = "it is a symbolic link (never followed)"
NOT_A_FOLDER = "it is not a folder"
NOT_FOLDERS = (A_LINK, NOT_A_FOLDER)


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Raises an error of the block as a ``StorageError`` saying ``what`` failed (the library's
    own errors as they are)."""
    try:
        yield
    except SnapshotError:
        raise
    except Exception as e:
        raise StorageError(f"{what}: {e}") from e


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
    """The local path ``url`` names when the local plugin serves it (links are then told
    apart with ``lstat``), else None."""
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
    """What a folder holds, as far as deleting it goes: ``refusal`` says why it is not provably
    the library's (a link, not a folder, names no take writes), empty when it is."""

    exists: bool
    manifest: bool = False
    marker: bool = False
    refusal: str = ""


def _contents(
    entries: list[tuple[str, str]], inner: Callable[[str], list[tuple[str, str]] | None]
) -> Contents:
    """``Contents`` of a folder holding ``entries`` (name, ``"file"``, ``"dir"`` or ``"other"``);
    ``inner(name)`` lists a rank's folder (None: it cannot be listed)."""
    manifest = marker = False
    foreign: list[str] = []
    for name, kind in entries:
        if kind == "file" and name == MANIFEST_NAME:
            manifest = True
        elif kind == "file" and name == PENDING_NAME:
            marker = True
        elif kind == "file" and (_TEMP.fullmatch(name) or name == SIGNATURE_NAME):
            pass
        elif kind == "dir" and _RANK.fullmatch(name):
            blobs = inner(name)
            if blobs is None:
                foreign.append(f"{name}/ (which cannot be listed)")
                continue
            for b, k in blobs:
                if not (k == "file" and (_BLOB.fullmatch(b) or _TEMP.fullmatch(b))):
                    foreign.append(f"{name}/{b}")
        else:
            foreign.append(name)
    if not foreign:
        return Contents(True, manifest, marker)
    shown = ", ".join(repr(n) for n in foreign[:_SHOWN])
    more = f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else ""
    return Contents(True, manifest, marker, f"it holds {shown}{more}, which no take writes")


def _scan_local(path: str) -> list[tuple[str, str]]:
    """The entries of a local folder and their kinds, never following a link."""
    with os.scandir(path) as found:
        return [(e.name, _kind(e)) for e in found]


def _kind(entry: os.DirEntry[str]) -> str:
    if entry.is_symlink():
        return "link"
    if entry.is_file(follow_symlinks=False):
        return "file"
    return "dir" if entry.is_dir(follow_symlinks=False) else "other"


def _survey_store(path: str, storage_options: dict[str, Any] | None, options: Options) -> Contents:
    """``survey`` through the storage plugin (object stores hold no links): a rank-named
    name is a folder, the manifest and the marker count when they are objects."""
    with open_storage(path, storage_options, options) as plugin:
        names = run(plugin.list_names(LIST_LIMIT))
        if names is None:
            return Contents(True, refusal=f"the store at {path} cannot list what it holds")
        marked = (MANIFEST_NAME, PENDING_NAME)
        prefixes = {n for n in marked if n in names and not run(plugin.exists(n))}
    entries = [
        (n, "other" if n in prefixes else "dir" if _RANK.fullmatch(n) else "file") for n in names
    ]
    if not entries:
        return Contents(False)

    def inner(name: str) -> list[tuple[str, str]] | None:
        with open_storage(join(path, name), storage_options, options) as rank:
            blobs = run(rank.list_names(LIST_LIMIT))
        return None if blobs is None else [(b, "file") for b in blobs]

    return _contents(entries, inner)


def survey(path: str, storage_options: dict[str, Any] | None, options: Options) -> Contents:
    """What the folder at ``path`` holds (``Contents``): on local disk by ``lstat`` and
    ``scandir``, never following a link; elsewhere through the storage plugin (object stores
    hold no links).

    Raises:
        StorageError: the store failed to list it.
    """
    local = local_path(path)
    with storage_errors(f"cannot list what {path} holds"):
        if local is None:
            return _survey_store(path, storage_options, options)
        try:
            mode = os.lstat(local).st_mode
            if stat.S_ISLNK(mode):
                return Contents(True, refusal=A_LINK)
            if not stat.S_ISDIR(mode):
                return Contents(True, refusal=NOT_A_FOLDER)
            return _contents(_scan_local(local), lambda n: _scan_local(os.path.join(local, n)))
        except FileNotFoundError:  # (or deleted since, by the manager's worker)
            return Contents(False)


@dataclass(frozen=True)
class StepInfo:
    """One step folder: its ``state``; for a committed one, what its manifest records (metrics,
    the names of the steps whose bytes it needs, the bytes of its own blobs); else ``reason``,
    why it is not committed or deleted. ``debris``: nothing but what a take writes, with or
    without the pending marker. Retention takes the committed ones
    (``retention.Step(step, name, metrics, bases)``)."""

    step: int
    name: str
    metrics: Mapping[str, Any] = field(default_factory=dict)
    bases: tuple[str, ...] = ()
    state: str = COMMITTED
    nbytes: int = 0
    reason: str = ""
    debris: bool = False

    @property
    def committed(self) -> bool:
        """A committed snapshot this library reads."""
        return self.state == COMMITTED


class Steps:
    """Step folders under ``root``: ``scan`` and ``delete``. A committed step's manifest is
    read once per folder name (a committed snapshot never changes)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None, options: Options):
        self.root = root
        self.storage_options = storage_options
        self.options = options
        self._read: dict[str, StepInfo] = {}
        self._local = local_path(root)

    def path(self, name: str) -> str:
        return join(self.root, name)

    def committed_steps(self) -> list[int]:
        """The steps whose folders hold a manifest, found by listing (no manifest is read)."""
        return sorted({step for step, _, kind in self._kinds() if kind == "committed"})

    def _kinds(self) -> list[tuple[int, str, str]]:
        """Each step-named entry under the root, its step and what it is: ``"committed"`` (a
        manifest there), ``"folder"`` (none), or why it is no step folder (a link, a file)."""
        if self._local is None:
            with open_storage(self.root, self.storage_options, self.options) as plugin:
                names = run(plugin.list_names(LIST_LIMIT))
                if names is None:
                    raise StorageError(
                        f"the store at {self.root} cannot list its folders: a checkpoint manager "
                        "finds its steps by listing the root"
                    )
                out = []
                for n in names:
                    if (step := step_of(n)) is not None:
                        there = run(plugin.exists(f"{n}/{MANIFEST_NAME}"))
                        out.append((step, n, "committed" if there else "folder"))
                return out
        try:
            found = _scan_local(self._local)
        except FileNotFoundError:
            return []
        out = []
        for n, kind in found:
            if (step := step_of(n)) is None:
                continue
            if kind == "dir":
                # A manifest that is a link counts: reading it says why it is refused.
                there = os.path.lexists(os.path.join(self._local, n, MANIFEST_NAME))
                out.append((step, n, "committed" if there else "folder"))
            else:
                out.append((step, n, A_LINK if kind == "link" else NOT_A_FOLDER))
        return out

    def scan(self) -> list[StepInfo]:
        """Every step-named entry under the root, by step ([] when the root does not exist).

        Raises:
            StorageError: the root, or a folder's contents, could not be listed.
            InvalidArgumentError: two folders hold the same step (``step_5``, ``step_05``).
        """
        with storage_errors(f"cannot list the steps under {self.root}"):
            kinds = self._kinds()
        out = []
        for step, name, kind in kinds:
            if kind == "committed":
                info = self._read.get(name) or self._read_step(step, name)
                if info.committed:
                    self._read[name] = info
            elif kind != "folder":
                info = StepInfo(step, name, state=LEFT, reason=kind)
            else:
                # No manifest: INCOMPLETE when it holds the pending marker and only take
                # debris, else LEFT; skipped when it is gone (or empty, on an object store).
                c = survey(self.path(name), self.storage_options, self.options)
                if not c.exists:
                    continue
                if c.refusal:
                    info = StepInfo(step, name, state=LEFT, reason=c.refusal)
                elif not c.marker:
                    why = "it holds no pending marker: nothing proves a take of statesnap left it"
                    info = StepInfo(step, name, state=LEFT, reason=why, debris=True)
                else:
                    why = "a take that never finished"
                    info = StepInfo(step, name, state=INCOMPLETE, reason=why, debris=True)
            out.append(info)
        out.sort(key=lambda s: (s.step, s.name))
        folders = [s for s in out if s.reason not in NOT_FOLDERS]
        for a, b in itertools.pairwise(folders):
            if a.step == b.step:
                raise InvalidArgumentError(
                    f"two folders under {self.root} hold step {a.step}: {self.path(a.name)} and "
                    f"{self.path(b.name)}; the checkpoint manager does not choose between them "
                    "(nothing was deleted): move one away"
                )
        return out

    def _read_step(self, step: int, name: str) -> StepInfo:
        try:
            m = load_manifest(self.path(name), self.storage_options, self.options)
        except SnapshotError as e:
            return StepInfo(step, name, state=UNREADABLE, reason=str(e))
        user = m.metadata.get("user")
        metrics = user.get("metrics") if isinstance(user, dict) else None
        own = sum(end for blob, end in m.blob_sizes.items() if not blob.startswith("../"))
        metrics = dict(metrics) if isinstance(metrics, dict) else {}
        return StepInfo(step, name, metrics, m.bases, nbytes=own)

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
    """Deletes the snapshot, or a take's debris, at ``path`` once ``survey`` found nothing there
    but a manifest and what a take writes, and the manifest or the pending marker
    (``unmarked``: a take known to have failed, which may lack it), in the order the module
    says.

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
    with (
        open_storage(path, storage_options, options) as plugin,
        storage_errors(f"cannot delete {path}"),
    ):
        if c.manifest:
            if not c.marker:
                run(plugin.write(PENDING_NAME, [b"deleting\n"]))
                run(plugin.sync())
            with contextlib.suppress(FileNotFoundError):
                run(plugin.delete(MANIFEST_NAME))
        for n in run(plugin.list_names(LIST_LIMIT)) or ():
            if _RANK.fullmatch(n):
                with open_storage(join(path, n), storage_options, options) as rank:
                    run(rank.delete_all())
            elif n != PENDING_NAME and left_by_a_take(n):
                run(plugin.delete(n))
        with contextlib.suppress(FileNotFoundError):
            run(plugin.delete(PENDING_NAME))
        run(plugin.delete_all())
