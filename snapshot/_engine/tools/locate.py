"""Which snapshot a path given to the command line names: the path itself when it holds a
manifest; else, under a checkpoint manager's root (``step_<N>`` folders), the latest committed
step; else, in a Lightning checkpoint path (``StatesnapCheckpointIO``'s ``v<counter>_<hex>``
version folders), the latest committed version. The command says on stderr which it opened.
"""

from __future__ import annotations

import os
import re
from typing import Any

from snapshot._engine.io.storage_calls import open_storage
from snapshot._engine.manager.steps import NOT_FOLDERS, Steps, join, local_path
from snapshot._engine.runtime import run
from snapshot._engine.take.commit import MANIFEST_NAME
from snapshot.errors import SnapshotError, SnapshotNotFoundError
from snapshot.options import Options

# A Lightning checkpoint's version folder, as ``snapshot.integrations.lightning`` names it
# (that module imports Lightning, which the command line does without).
VERSION = re.compile(r"v([0-9]{10,18})_([0-9a-f]{12})")
_LIST_LIMIT = 1000  # a checkpoint path holds a version or two


def _names(path: str, storage_options: dict[str, Any] | None, options: Options) -> list[str]:
    """The names directly under ``path`` ([] when it cannot be listed, or is no folder)."""
    local = local_path(path)
    try:
        if local is not None:
            return os.listdir(local) if os.path.isdir(local) else []
        with open_storage(path, storage_options, options) as plugin:
            return run(plugin.list_names(_LIST_LIMIT)) or []
    except (OSError, SnapshotError):
        return []


def _has_manifest(path: str, storage_options: dict[str, Any] | None, options: Options) -> bool:
    local = local_path(path)
    if local is not None:
        return os.path.lexists(os.path.join(local, MANIFEST_NAME))
    try:
        with open_storage(path, storage_options, options) as plugin:
            return bool(run(plugin.exists(MANIFEST_NAME)))
    except Exception:
        return False  # the command's own open says what is wrong


def snapshot_at(path: str, storage_options: dict[str, Any] | None) -> tuple[str, str]:
    """``(the snapshot to open, what it is)`` for a ``path`` given to a command: ``(path, "")``
    when it holds a manifest or is neither a manager's root nor a Lightning checkpoint (the
    command then says what is missing); else the latest committed step or version and
    ``"step"`` or ``"version"``.

    Raises:
        SnapshotNotFoundError: a manager's root or a Lightning checkpoint with nothing committed.
    """
    options = Options.from_env()
    if _has_manifest(path, storage_options, options):
        return path, ""
    names = _names(path, storage_options, options)
    if not names:
        return path, ""
    if any(n.startswith("step_") for n in names):
        found = Steps(path, storage_options, options).scan()
        folders = [s for s in found if s.reason not in NOT_FOLDERS]
        committed = [s for s in found if s.committed]
        if committed:
            return join(path, committed[-1].name), "step"
        if folders:
            raise SnapshotNotFoundError(
                f"no committed step under the checkpoint manager's root {path}: "
                f"{len(folders)} step folder(s), none committed (`statesnap steps {path}` "
                "says what each holds)"
            )
    versions = sorted(
        (int(m.group(1)), n) for n in names if (m := VERSION.fullmatch(n)) is not None
    )
    if not versions:
        return path, ""
    for _, name in reversed(versions):
        if _has_manifest(join(path, name), storage_options, options):
            return join(path, name), "version"
    raise SnapshotNotFoundError(
        f"no committed version in the Lightning checkpoint {path}: {len(versions)} "
        "incomplete save(s) there"
    )
