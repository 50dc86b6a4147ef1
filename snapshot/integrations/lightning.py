"""Lightning ``CheckpointIO`` plugins that store Lightning's checkpoint dict with statesnap::

    from snapshot.integrations.lightning import StatesnapCheckpointIO

    trainer = Trainer(plugins=[StatesnapCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model)
    trainer.fit(model, ckpt_path="checkpoints/last.ckpt")  # resume

The checkpoint dict is one :class:`~snapshot.StateDict` of a snapshot. A snapshot is never
overwritten, and Lightning saves to one path again and again (``last.ckpt``), so a checkpoint
path is a folder of versions: each save takes a new snapshot in ``<path>/v<counter>_<hex>``,
and only once it is committed are the older versions deleted. Loading picks the committed
version with the highest counter; a version without a manifest is debris the next save
deletes. Finding the versions needs a store that lists a folder (local, ``memory://``,
``s3://``).

Across ranks Lightning saves and removes on rank 0 only: the plugins take each snapshot in the
calling process alone (on a group of that one rank), so no other rank need join.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from snapshot._engine import state_dicts
from snapshot._engine.io.storage_calls import open_storage
from snapshot._engine.manager.steps import delete_snapshot, join, local_path, survey
from snapshot._engine.runtime import run
from snapshot._engine.take.commit import MANIFEST_NAME
from snapshot.errors import InvalidArgumentError, SnapshotError, StorageError, UnsafeSnapshotError
from snapshot.options import Options, resolve
from snapshot.pending import PendingSnapshot
from snapshot.snapshot import Snapshot
from snapshot.stateful import StateDict

logger = logging.getLogger("snapshot")

# The one app_state key of a checkpoint's snapshot: the dict is read back as "0/checkpoint".
KEY = "checkpoint"
# The counter orders the versions; the random part keeps two writers from sharing a folder.
_VERSION = re.compile(r"v([0-9]{10,18})_([0-9a-f]{12})")
# The most names a listing of a checkpoint folder may return (it holds a version or two).
LIST_LIMIT = 1000


def _checkpoint_io_base() -> type:
    """Lightning's ``CheckpointIO``: from ``lightning.pytorch``, else ``pytorch_lightning``
    (an installed package that fails to import raises its error)."""
    for package in ("lightning", "pytorch_lightning"):
        if importlib.util.find_spec(package) is not None:
            pytorch = "lightning.pytorch" if package == "lightning" else package
            return importlib.import_module(f"{pytorch}.plugins.io").CheckpointIO
    raise ImportError(
        "snapshot.integrations.lightning needs Lightning (lightning.pytorch or "
        "pytorch_lightning): pip install 'statesnap[lightning]'"
    )


CheckpointIO = _checkpoint_io_base()


@dataclass(frozen=True)
class Version:
    """One version folder of a checkpoint path; committed when it holds a manifest."""

    counter: int
    name: str
    committed: bool


def _since(t: float) -> float:
    return time.perf_counter() - t


def list_versions(
    root: str,
    storage_options: dict[str, Any] | None,
    options: Options,
    others: list[str] | None = None,
) -> list[Version]:
    """The version folders under ``root``, oldest first; empty when ``root`` does not exist
    (``others`` gets the other names there). Raises ``StorageError`` when the store cannot
    list ``root``, or it is a local file."""
    if "://" not in root and os.path.isfile(root):
        raise StorageError(
            f"{root} is a file, not a statesnap checkpoint (a folder of versions): a torch.save "
            "checkpoint loads with torch.load or Lightning's TorchCheckpointIO; save to "
            "another path, or delete it first"
        )
    found = []
    with open_storage(root, storage_options, options) as plugin:
        try:
            names = run(plugin.list_names(LIST_LIMIT))
            if names is None:
                raise StorageError(
                    f"the store at {root} cannot list a folder: a statesnap checkpoint finds its "
                    "newest version by listing its path (local disk, memory:// and s3:// can)"
                )
            if len(names) >= LIST_LIMIT:
                raise StorageError(
                    f"{root} holds {LIST_LIMIT} entries or more: not a statesnap checkpoint folder"
                )
            for name in names:
                m = _VERSION.fullmatch(name)
                if m is not None:
                    committed = run(plugin.exists(f"{name}/{MANIFEST_NAME}"))
                    found.append(Version(int(m.group(1)), name, committed))
                elif others is not None:
                    others.append(name)
        except SnapshotError:
            raise
        except Exception as e:
            raise StorageError(f"cannot list the checkpoint versions under {root}: {e}") from e
    return sorted(found, key=lambda v: (v.counter, v.name))


def _placer(map_location: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What ``map_location`` does to one tensor read onto the CPU, or None to leave them."""
    if isinstance(map_location, dict):  # tensors are read onto the CPU: its entry applies
        map_location = map_location.get("cpu")
        if map_location is not None:
            map_location = torch.device(map_location)
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        return lambda t: t.to(device)
    if callable(map_location):

        def place(t: torch.Tensor) -> torch.Tensor:
            # torch.load's f(storage, location): the tensor goes where the result is.
            out = map_location(t.untyped_storage(), "cpu")
            return t if out is None else t.to(out.device)

        return place
    raise InvalidArgumentError(
        "load_checkpoint: map_location must be None, a torch.device, a str, a dict or a "
        f"callable, as torch.load takes it; got {type(map_location).__name__}"
    )


def _mapped(value: Any, place: Callable[[torch.Tensor], torch.Tensor], memo: dict[int, Any]) -> Any:
    """``value`` with every tensor moved by ``place``; one tensor object met twice (tied
    weights) is moved once, and an ``nn.Parameter`` stays one."""
    if isinstance(value, torch.Tensor):
        moved = memo.get(id(value))
        if moved is None:
            moved = place(value)
            if isinstance(value, torch.nn.Parameter) and not isinstance(moved, torch.nn.Parameter):
                moved = torch.nn.Parameter(moved, requires_grad=value.requires_grad)
            memo[id(value)] = moved
        return moved
    kind = type(value)
    if kind is dict or kind is OrderedDict:
        return kind((k, _mapped(v, place, memo)) for k, v in value.items())
    if kind is list or kind is tuple:
        return kind(_mapped(v, place, memo) for v in value)
    return value


_group_lock = threading.Lock()
_group: tuple[Any, Any] | None = None  # (the default group it was made under, the group)


def alone() -> Any | None:
    """The ``pg`` for a take by this process alone: None outside ``torch.distributed``, else a
    gloo group of this one rank, made once per default group, by this rank alone
    (``use_local_synchronization``): Lightning saves on rank 0 while the others train on."""
    global _group
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    with _group_lock:
        world = dist.group.WORLD
        if _group is None or _group[0] is not world:
            group = dist.new_group(
                [dist.get_rank()], backend="gloo", use_local_synchronization=True
            )
            _group = (world, group)
        return _group[1]


class StatesnapCheckpointIO(CheckpointIO):  # type: ignore[misc, valid-type]
    """A Lightning ``CheckpointIO`` that stores each checkpoint as a statesnap snapshot.

    ``save_checkpoint`` returns once the checkpoint is committed, then deletes the versions it
    replaces (a failed deletion is logged; the next save tries again).

    Args:
        storage_options: for the storage plugin, for every save, load and removal; those
            Lightning passes to one save are added to these for that save.
        options: the :class:`~snapshot.Options` of every take and read.
    """

    # AsyncStatesnapCheckpointIO: a save returns once captured, its commit on a thread.
    _async = False

    def __init__(
        self, storage_options: dict[str, Any] | None = None, *, options: Options | None = None
    ) -> None:
        super().__init__()
        # The Trainer this plugin is built for is imported by now: with both Lightning
        # distributions installed, the one imported after this module is registered here.
        _register_with_the_other()
        self.storage_options = state_dicts.options(
            storage_options, type(self).__name__, "its checkpoints"
        )
        self.options = resolve(options)
        self._thread: threading.Thread | None = None  # the async save under way
        self._error: BaseException | None = None  # of the async save under way, once it failed

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Stores ``checkpoint`` at ``path`` as a new version, in this process alone, then
        deletes the older ones. Raises ``SnapshotError`` when the take failed (the earlier
        version is as it was; what the failed one left is deleted)."""
        self.wait()
        call = f"{type(self).__name__}.save_checkpoint"
        root = state_dicts.snapshot_path(path, call)
        if not isinstance(checkpoint, dict):
            raise InvalidArgumentError(
                f"{call} of {root}: checkpoint must be a dict, got {type(checkpoint).__name__}"
            )
        extra = state_dicts.options(storage_options, call, root)
        store = {**(self.storage_options or {}), **extra} if extra else self.storage_options
        older = list_versions(root, store, self.options)
        counter = older[-1].counter + 1 if older else 1
        target = join(root, f"v{counter:010d}_{uuid.uuid4().hex[:12]}")
        t = time.perf_counter()
        try:
            taken = (Snapshot.async_take if self._async else Snapshot.take)(
                target,
                {KEY: StateDict(checkpoint)},
                pg=alone(),
                storage_options=store,
                options=self.options,
            )
        except Exception:
            self._delete([target], store)
            raise
        replaced = [join(root, v.name) for v in older]
        if not isinstance(taken, PendingSnapshot):
            logger.info("checkpoint %s saved in %.3f s", root, _since(t))
            self._delete(replaced, store)
            return
        logger.info("checkpoint %s captured in %.3f s", root, _since(t))
        pending = taken

        def commit() -> None:
            """On a thread of its own: waits for the commit, then deletes the versions it
            replaces; or records its error and deletes what it left."""
            try:
                pending.wait()
                logger.info("checkpoint %s committed %.3f s after it began", root, _since(t))
            except BaseException as e:
                logger.error("checkpoint %s failed: %s", root, e)
                self._error = e
                self._delete([target], store)
            else:
                self._delete(replaced, store)

        self._thread = threading.Thread(
            target=commit, name="statesnap-lightning-commit", daemon=True
        )
        self._thread.start()

    def _delete(self, versions: list[str], store: dict[str, Any] | None) -> None:
        """Deletes version folders; a failure is logged, the next save tries again."""
        for version in versions:
            try:
                # A version's name is the plugin's own: unmarked debris goes too.
                delete_snapshot(version, store, self.options, unmarked=True)
            except Exception as e:
                logger.warning("cannot delete %s: %s", version, e)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict of the newest committed version at ``path``.

        Tensors are read onto the CPU, then moved as ``map_location`` says, as ``torch.load``
        takes it (a device or str; a dict, whose ``"cpu"`` entry applies; a callable called
        as ``f(storage, "cpu")``); None leaves them on the CPU. ``weights_only`` changes
        nothing: objects are always read by the safe loader.

        Raises:
            FileNotFoundError: ``path`` holds no committed version.
            SnapshotError: the newest version cannot be read (damaged, unsafe...).
        """
        self.wait()
        root = state_dicts.snapshot_path(path, f"{type(self).__name__}.load_checkpoint")
        place = _placer(map_location)
        versions = list_versions(root, self.storage_options, self.options)
        committed = [v for v in versions if v.committed]
        if not committed:
            debris = f" ({len(versions)} incomplete save(s) there)" if versions else ""
            raise FileNotFoundError(f"no committed statesnap checkpoint at {root}{debris}")
        newest = join(root, committed[-1].name)
        t = time.perf_counter()
        snapshot = Snapshot(newest, storage_options=self.storage_options, options=self.options)
        checkpoint: dict[str, Any] = snapshot.read_object(f"0/{KEY}", options=self.options)
        if place is not None:
            checkpoint = _mapped(checkpoint, place, {})
        logger.info("checkpoint %s loaded in %.3f s", newest, _since(t))
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Deletes every version of the checkpoint at ``path`` (nothing when there is none),
        once all of it is checked to be no link and to hold only version folders of what a
        take writes: each version oldest first (an interrupted removal never leaves an older
        one the newest), then ``path``. Otherwise raises ``UnsafeSnapshotError`` and deletes
        nothing."""
        self.wait()
        root = state_dicts.snapshot_path(path, f"{type(self).__name__}.remove_checkpoint")
        store, options = self.storage_options, self.options
        local = local_path(root)
        if local is not None and os.path.islink(local):
            raise UnsafeSnapshotError(
                f"the checkpoint {root} is not removed: it is a symbolic link (never followed); "
                "nothing was deleted"
            )
        others: list[str] = []
        versions = list_versions(root, store, options, others)
        problems = [repr(n) for n in sorted(others)]
        for v in versions:
            found = survey(join(root, v.name), store, options)
            if found.refusal:
                problems.append(f"{v.name!r} ({found.refusal})")
        if problems:
            raise UnsafeSnapshotError(
                f"the checkpoint {root} is not removed: it holds {', '.join(problems[:5])}, which "
                "no save of statesnap wrote; nothing was deleted: move those away first"
            )
        for v in versions:
            delete_snapshot(join(root, v.name), store, options, unmarked=True)
        with open_storage(root, store, options) as plugin:
            try:
                run(plugin.delete_all())
            except Exception as e:
                raise StorageError(f"cannot remove the checkpoint {root}: {e}") from e
        logger.info("checkpoint %s removed", root)

    def wait(self) -> None:
        """Waits for the async save under way and its deletions; raises its error if it
        failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def teardown(self) -> None:
        """Called by Lightning when the strategy tears down: waits for the save under way."""
        self.wait()


class AsyncStatesnapCheckpointIO(StatesnapCheckpointIO):
    """Like :class:`StatesnapCheckpointIO`, but ``save_checkpoint`` returns once the state is
    captured (:meth:`Snapshot.async_take`); the writes go on in the background.

    One save is under way at a time: the next ``save_checkpoint``, ``load_checkpoint``,
    ``remove_checkpoint``, ``wait`` and ``teardown`` first wait for it to commit, and raise
    its error if it failed (the next save is then not begun). Its thread deletes the versions
    it replaces once it commits.
    """

    _async = True


def _register_with_the_other() -> None:
    """With both ``lightning`` and ``pytorch_lightning`` installed, a Trainer of either accepts
    only its own ``CheckpointIO``: the plugins (``lightning.pytorch``'s subclasses) are made
    virtual subclasses of the other's too, where it is imported already (both are ABCs): at
    this module's import, and again as each plugin is made."""
    for package in ("lightning.pytorch.plugins.io", "pytorch_lightning.plugins.io"):
        module = sys.modules.get(package)
        other = getattr(module, "CheckpointIO", None)
        if other is not None and other is not CheckpointIO:
            other.register(StatesnapCheckpointIO)


_register_with_the_other()

__all__ = ["AsyncStatesnapCheckpointIO", "StatesnapCheckpointIO"]
