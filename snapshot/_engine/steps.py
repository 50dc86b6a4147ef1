"""The step folders under a checkpoint manager's root, on any store: listing them, telling
committed from incomplete, reading what each committed one records, and deleting one.

A step folder is ``<root>/step_<step>`` (``step_name``: ten digits, so that names sort as
steps do; any ``step_<digits>`` is read). It is committed when it holds a snapshot's manifest,
the commit point of every take: nothing else (no pointer file) says which steps exist, so the
listing cannot disagree with what a restore would find. Deleting a step removes the manifest
first, so that from that moment on it no longer looks committed; a crash in the middle leaves
an incomplete folder, which the next scan reports and the manager cleans.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

from snapshot._engine.commit import MANIFEST_NAME, PENDING_NAME
from snapshot._engine.incremental import sibling_path
from snapshot._engine.io_loop import run
from snapshot._engine.manifest_io import load_manifest
from snapshot._engine.storage_calls import open_storage
from snapshot.errors import SnapshotError, StorageError
from snapshot.options import Options

logger = logging.getLogger("snapshot")

_STEP = re.compile(r"step_([0-9]{1,18})")
# The most names a listing of a root may return (an S3 listing pages through 1,000 at a time).
LIST_LIMIT = 1_000_000


def step_name(step: int) -> str:
    return f"step_{step:010d}"


def step_of(name: str) -> int | None:
    """The step a folder name says (``step_0000000100`` -> 100), or None for other names."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def join(root: str, name: str) -> str:
    """The path of ``name`` under ``root`` (a local folder, or a URL's prefix)."""
    return f"{root.rstrip('/')}/{name}" if "://" in root else sibling_path(f"{root}/x", name)


@dataclass(frozen=True)
class StepInfo:
    """One step folder: committed or not; for a committed one, what its manifest records (the
    ``metrics`` and the bases it needs), or why it could not be read (``damaged``)."""

    step: int
    name: str
    committed: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    bases: tuple[str, ...] = ()
    nbytes: int = 0  # the bytes its own blobs hold (from its manifest)
    damaged: str = ""


class Steps:
    """Step folders under ``root``: ``scan`` and ``delete``. What a committed step's manifest
    records is read once per folder name and remembered (a committed snapshot never
    changes; a deleted one is forgotten)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None, options: Options):
        self.root = root
        self.storage_options = storage_options
        self.options = options
        self._read: dict[str, StepInfo] = {}

    def path(self, name: str) -> str:
        return join(self.root, name)

    def scan(self) -> list[StepInfo]:
        """Every step folder under the root, by step; an empty list when the root does not
        exist yet."""
        t = time.perf_counter()
        with open_storage(self.root, self.storage_options, self.options) as plugin:

            async def listing() -> list[tuple[str, bool]]:
                names = await plugin.list_names(LIST_LIMIT)
                if names is None:
                    raise StorageError(
                        f"the store at {self.root} cannot list its folders: a checkpoint "
                        "manager finds its steps by listing the root"
                    )
                found = [n for n in names if step_of(n) is not None]
                return [(n, await plugin.exists(f"{n}/{MANIFEST_NAME}")) for n in found]

            try:
                found = run(listing())
            except SnapshotError:
                raise
            except Exception as e:
                raise StorageError(f"cannot list the steps under {self.root}: {e}") from e
        out = []
        for name, committed in found:
            step = step_of(name)
            assert step is not None
            if not committed:
                out.append(StepInfo(step, name, False))
                continue
            info = self._read.get(name)
            if info is None:
                info = self._read[name] = self._read_step(step, name)
            out.append(info)
        out.sort(key=lambda s: s.step)
        logger.debug(
            "steps under %s: %d folders (%d committed) in %.3f s",
            self.root,
            len(out),
            sum(s.committed and not s.damaged for s in out),
            time.perf_counter() - t,
        )
        return out

    def _read_step(self, step: int, name: str) -> StepInfo:
        try:
            m = load_manifest(self.path(name), self.storage_options, self.options)
        except SnapshotError as e:
            return StepInfo(step, name, True, damaged=str(e))
        user = m.metadata.get("user")
        metrics = user.get("metrics") if isinstance(user, dict) else None
        own = sum(end for blob, end in m.blob_sizes.items() if not blob.startswith("../"))
        return StepInfo(
            step,
            name,
            True,
            metrics=dict(metrics) if isinstance(metrics, dict) else {},
            bases=m.bases,
            nbytes=own,
        )

    def delete(self, name: str) -> None:
        """Deletes the step folder ``name`` (``delete_snapshot``)."""
        self._read.pop(name, None)
        t = time.perf_counter()
        delete_snapshot(self.path(name), self.storage_options, self.options)
        logger.info("deleted %s in %.3f s", self.path(name), time.perf_counter() - t)


def delete_snapshot(path: str, storage_options: dict[str, Any] | None, options: Options) -> None:
    """Deletes the snapshot (or the debris of a take) at ``path``: its manifest first (from
    then on it is not committed), then its pending marker (so that it does not look like a take
    under way either), then everything else (``StoragePlugin.delete_all``).

    Raises:
        StorageError: the store refused or failed; what was deleted stays deleted.
    """
    with open_storage(path, storage_options, options) as plugin:

        async def remove() -> None:
            for marker in (MANIFEST_NAME, PENDING_NAME):
                try:
                    await plugin.delete(marker)
                except FileNotFoundError:
                    pass
            await plugin.delete_all()

        try:
            run(remove())
        except Exception as e:
            raise StorageError(f"cannot delete {path}: {e}") from e
