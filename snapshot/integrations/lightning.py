"""Lightning ``CheckpointIO`` plugins that store Lightning's checkpoint dict with statesnap::

    from snapshot.integrations.lightning import StatesnapCheckpointIO

    trainer = Trainer(plugins=[StatesnapCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model)
    trainer.fit(model, ckpt_path="checkpoints/last.ckpt")  # resume

The checkpoint dict (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``,
``callbacks``, ``hyper_parameters``...) is one :class:`~snapshot.StateDict` of a snapshot: its
tensors are stored as raw bytes with CRC-32s, its nested dicts, lists and plain values in the
manifest, anything else pickled and read back by the safe loader.

A checkpoint path is a folder of versions. A statesnap snapshot is never overwritten, and
Lightning saves to the same path again and again (``last.ckpt``), so each save takes a new
snapshot in ``<path>/v<counter>_<random hex>`` (the counter one more than any version listed
there), and only once that snapshot is committed (its manifest written) are the older versions
deleted. A save that fails, or a process killed in the middle of one, leaves the older version
as it was: loading picks the committed version with the highest counter, and a version without
a manifest is debris that the next save deletes. Finding the versions needs a store that lists
a folder: local disk, ``memory://`` and ``s3://`` do.

Across ranks (``DDPStrategy``), Lightning saves and removes on global rank 0 only and loads on
every rank; the plugins take each snapshot in the calling process alone (on a process group of
that one rank, made once per process), so no other rank need join.
"""

from __future__ import annotations

import importlib
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

from snapshot._engine import arguments
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
# ``v<counter>_<hex>``: the counter orders the versions (ten digits or more, so names sort as
# counters do up to 10**10 saves); the random part keeps two writers from sharing a folder.
_VERSION = re.compile(r"v([0-9]{10,18})_([0-9a-f]{12})")
# The most names one listing of a checkpoint folder may return: a folder of versions holds one
# or two of them, and debris of failed saves until the next save deletes it.
LIST_LIMIT = 1000


def _checkpoint_io_base() -> type:
    """Lightning's ``CheckpointIO``: from ``lightning.pytorch``, else from ``pytorch_lightning``.

    Only a missing package falls through to the next name; a package that is there but fails
    to import raises its own error."""
    for package in ("lightning.pytorch", "pytorch_lightning"):
        target = f"{package}.plugins.io"
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            # Missing: the package, or a module on the way to ``target``; anything else (a
            # dependency the package imports) is the package's own error.
            if e.name is None or not (target == e.name or target.startswith(f"{e.name}.")):
                raise
            continue
        return module.CheckpointIO
    raise ImportError(
        "snapshot.integrations.lightning needs Lightning (lightning.pytorch or "
        "pytorch_lightning): pip install 'statesnap[lightning]'"
    )


CheckpointIO = _checkpoint_io_base()


# -- versions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Version:
    """One version folder of a checkpoint path; committed when it holds a manifest."""

    counter: int
    name: str
    committed: bool


def version_name(counter: int) -> str:
    return f"v{counter:010d}_{uuid.uuid4().hex[:12]}"


def list_versions(
    root: str, storage_options: dict[str, Any] | None, options: Options
) -> list[Version]:
    """The version folders under ``root``, oldest first; empty when ``root`` does not exist.

    Raises:
        StorageError: the store cannot list ``root``, or ``root`` is a local file (a
            ``torch.save`` checkpoint, not a folder of versions).
    """
    if "://" not in root and os.path.isfile(root):
        raise StorageError(
            f"{root} is a file, not a statesnap checkpoint (a folder of versions): a torch.save "
            "checkpoint loads with torch.load or Lightning's TorchCheckpointIO; save to "
            "another path, or delete it first"
        )
    with open_storage(root, storage_options, options) as plugin:

        async def listing() -> list[Version]:
            names = await plugin.list_names(LIST_LIMIT)
            if names is None:
                raise StorageError(
                    f"the store at {root} cannot list a folder: a statesnap checkpoint finds its "
                    "newest version by listing its path (local disk, memory:// and s3:// can)"
                )
            if len(names) >= LIST_LIMIT:
                raise StorageError(
                    f"{root} holds {LIST_LIMIT} entries or more: not a statesnap checkpoint folder"
                )
            found = []
            for name in names:
                m = _VERSION.fullmatch(name)
                if m is not None:
                    committed = await plugin.exists(f"{name}/{MANIFEST_NAME}")
                    found.append(Version(int(m.group(1)), name, committed))
            return found

        try:
            found = run(listing())
        except SnapshotError:
            raise
        except Exception as e:
            raise StorageError(f"cannot list the checkpoint versions under {root}: {e}") from e
    return sorted(found, key=lambda v: (v.counter, v.name))


def delete_version(
    root: str, name: str, storage_options: dict[str, Any] | None, options: Options
) -> None:
    """Deletes the version folder ``name`` once it is checked to hold nothing but a manifest
    and what a take writes (no link): a committed one gets the pending marker, then loses its
    manifest (from then on it is not committed), then the rest (``steps.delete_snapshot``).
    A version folder's name is the plugin's own, so one without a manifest nor a marker (what
    a failed save left) is deleted too."""
    delete_snapshot(join(root, name), storage_options, options, unmarked=True)


def remove_all(root: str, storage_options: dict[str, Any] | None, options: Options) -> None:
    """Deletes the checkpoint at ``root``, once all of it is checked: ``root`` is no link, and
    holds nothing but version folders, each holding nothing but a manifest and what a take
    writes. Then each version, oldest first (so that an interrupted removal never leaves an
    older version as the newest committed one), and ``root`` itself.

    Raises:
        UnsafeSnapshotError: ``root`` is a link, or holds what no save of the plugin wrote;
            nothing was deleted.
    """
    local = local_path(root)
    if local is not None and os.path.islink(local):
        raise UnsafeSnapshotError(
            f"the checkpoint {root} is not removed: it is a symbolic link (never followed); "
            "nothing was deleted"
        )
    versions = list_versions(root, storage_options, options)
    with open_storage(root, storage_options, options) as plugin:
        try:
            names = run(plugin.list_names(LIST_LIMIT)) or []
        except Exception as e:
            raise StorageError(f"cannot list the checkpoint {root}: {e}") from e
    ours = {v.name for v in versions}
    problems = [repr(n) for n in sorted(names) if n not in ours]
    for v in versions:
        found = survey(join(root, v.name), storage_options, options)
        if found.refusal:
            problems.append(f"{v.name!r} ({found.refusal})")
    if problems:
        raise UnsafeSnapshotError(
            f"the checkpoint {root} is not removed: it holds {', '.join(problems[:5])}, which "
            "no save of statesnap wrote; nothing was deleted: move those away first"
        )
    for v in versions:
        delete_version(root, v.name, storage_options, options)
    with open_storage(root, storage_options, options) as plugin:
        try:
            run(plugin.delete_all())
        except Exception as e:
            raise StorageError(f"cannot remove the checkpoint {root}: {e}") from e


# -- map_location -----------------------------------------------------------------------------


def _placer(map_location: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What ``map_location`` does to one tensor read onto the CPU, or None to leave them."""
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        return lambda t: t.to(device)
    if isinstance(map_location, dict):
        # torch.load's dict maps the location a tensor was saved from to another; tensors are
        # read onto the CPU here, so the entry for "cpu" is the one that applies.
        target = map_location.get("cpu")
        if target is None:
            return None
        device = torch.device(target)
        return lambda t: t.to(device)
    if callable(map_location):

        def place(t: torch.Tensor) -> torch.Tensor:
            # torch.load's form: f(storage, location) returns the storage to use, or None for
            # the default. The tensor goes to the device of the storage returned.
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


# -- the process group of one rank ------------------------------------------------------------

_group_lock = threading.Lock()
_group: tuple[Any, Any] | None = None  # (the default group it was made under, the group)


def alone() -> Any | None:
    """The ``pg`` for a take by this process alone: None outside ``torch.distributed``, else a
    gloo group of this one rank, made once per default group. Only this rank joins its making
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


# -- the plugins ------------------------------------------------------------------------------


class StatesnapCheckpointIO(CheckpointIO):  # type: ignore[misc, valid-type]
    """A Lightning ``CheckpointIO`` that stores each checkpoint as a statesnap snapshot:
    ``Trainer(plugins=[StatesnapCheckpointIO()])``.

    ``save_checkpoint`` returns once the checkpoint is committed; the version it replaces at
    the same path is deleted after that (a failed deletion is logged, and the next save of
    that path tries again). Paths are local folders or URLs (``s3://bucket/run/last.ckpt``,
    ``memory://name``): see the module's docstring for the folder of versions a path becomes.

    Args:
        storage_options: for the storage plugin, as :meth:`Snapshot.take` takes them (S3
            credentials and endpoint, ``{"fsync": False}``...), for every save, load and
            removal. The ``storage_options`` Lightning passes to one save
            (``trainer.save_checkpoint(path, storage_options=...)``) are added to these for that
            save only.
        options: the :class:`~snapshot.Options` of every take and read.
    """

    def __init__(
        self, storage_options: dict[str, Any] | None = None, *, options: Options | None = None
    ) -> None:
        super().__init__()
        self.storage_options = arguments.options(
            storage_options, type(self).__name__, "its checkpoints"
        )
        self.options = resolve(options)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Stores ``checkpoint`` (Lightning's dict) at ``path`` as a new version, then deletes
        the versions that were there before.

        Raises:
            SnapshotError: the take failed (a value that cannot be stored, a storage error...);
                the earlier version at ``path``, if any, is as it was.
        """
        _, root, _, older, store, t = self._save(Snapshot.take, checkpoint, path, storage_options)
        logger.info("checkpoint %s saved in %.3f s", root, time.perf_counter() - t)
        self._retire(root, older, store)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict of the newest committed version at ``path``.

        Tensors are read onto the CPU, then moved as ``map_location`` says: None leaves them
        there (``torch.load`` would put them back on the device they were saved from); a
        ``torch.device`` or a str (``"cuda:0"``) moves every tensor there; a dict maps
        locations as ``torch.load``'s does, and since every tensor is read from ``"cpu"``,
        only its ``"cpu"`` entry applies; a callable is called as ``torch.load`` calls it,
        ``f(storage, "cpu")``, and each tensor goes to the device of the storage it returns
        (None: it stays). ``weights_only`` is accepted for Lightning's sake and changes
        nothing: objects are always read by the safe loader (``torch.load(weights_only=True)``'s),
        and a save refused any a load could not read.

        Raises:
            FileNotFoundError: ``path`` holds no committed version.
            SnapshotError: the newest version cannot be read (damaged, unsafe...).
        """
        self._settle()
        root = arguments.snapshot_path(path, f"{type(self).__name__}.load_checkpoint")
        place = _placer(map_location)
        versions = list_versions(root, self.storage_options, self.options)
        committed = [v for v in versions if v.committed]
        if not committed:
            debris = f" ({len(versions)} incomplete save(s) there)" if versions else ""
            raise FileNotFoundError(f"no committed statesnap checkpoint at {root}{debris}")
        newest = join(root, committed[-1].name)
        t = time.perf_counter()
        snapshot = Snapshot(newest, storage_options=self.storage_options, options=self.options)
        checkpoint = snapshot.read_object(f"0/{KEY}", options=self.options)
        if place is not None:
            checkpoint = _mapped(checkpoint, place, {})
        logger.info("checkpoint %s loaded in %.3f s", newest, time.perf_counter() - t)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Deletes the checkpoint at ``path``, every version of it; nothing when there is
        none."""
        self._settle()
        root = arguments.snapshot_path(path, f"{type(self).__name__}.remove_checkpoint")
        remove_all(root, self.storage_options, self.options)
        logger.info("checkpoint %s removed", root)

    # -- shared steps ---------------------------------------------------------------------------

    def _settle(self) -> None:
        """Before a load or a removal: nothing to wait for (the async plugin waits for its
        save under way)."""

    def _begin(
        self, checkpoint: Any, path: Any, storage_options: Any | None
    ) -> tuple[str, dict[str, Any] | None, str, list[Version]]:
        """The arguments of a save checked: its root, its storage options, the name of the
        new version and the versions it replaces."""
        call = f"{type(self).__name__}.save_checkpoint"
        root = arguments.snapshot_path(path, call)
        if not isinstance(checkpoint, dict):
            raise InvalidArgumentError(
                f"{call} of {root}: checkpoint must be a dict, got {type(checkpoint).__name__}"
            )
        extra = arguments.options(storage_options, call, root)
        store = {**(self.storage_options or {}), **extra} if extra else self.storage_options
        older = list_versions(root, store, self.options)
        counter = older[-1].counter + 1 if older else 1
        return root, store, version_name(counter), older

    def _save(
        self,
        take: Callable[..., Any],
        checkpoint: dict[str, Any],
        path: Any,
        storage_options: Any | None,
    ) -> tuple[Any, str, str, list[Version], dict[str, Any] | None, float]:
        """Begins a new version at ``path`` and calls ``take`` (``Snapshot.take`` or
        ``Snapshot.async_take``) into it, in this process alone; what a failure left is deleted
        and the error raised. Returns what ``take`` returned, the checkpoint's root, the new
        version's name, the versions it replaces, the storage options and when it began."""
        root, store, target, older = self._begin(checkpoint, path, storage_options)
        t = time.perf_counter()
        try:
            result = take(
                join(root, target),
                {KEY: StateDict(checkpoint)},
                pg=alone(),
                storage_options=store,
                options=self.options,
            )
        except Exception:
            self._discard(root, target, store)
            raise
        return result, root, target, older, store, t

    def _discard(self, root: str, name: str, store: dict[str, Any] | None) -> None:
        """What a failed save left of its version (the take deleted its blobs; a folder may
        remain) is deleted; a failure to do so is logged (the next save deletes it)."""
        try:
            delete_version(root, name, store, self.options)
        except Exception as e:
            logger.warning("cannot delete the failed save %s: %s", join(root, name), e)

    def _retire(self, root: str, older: list[Version], store: dict[str, Any] | None) -> None:
        """After a commit: the versions it replaced are deleted, committed or not (a version
        listed before the new one began is older). A failure is logged; the next save of
        ``root`` lists and deletes them again."""
        for v in older:
            try:
                delete_version(root, v.name, store, self.options)
            except Exception as e:
                logger.warning("cannot delete the replaced version %s: %s", join(root, v.name), e)


class AsyncStatesnapCheckpointIO(StatesnapCheckpointIO):
    """Like :class:`StatesnapCheckpointIO`, but ``save_checkpoint`` returns once the state is
    captured (:meth:`Snapshot.async_take`: every tensor copied into staging buffers, within
    ``STATESNAP_MEMORY_BUDGET_BYTES``); training may change the weights at once while the
    writes go on.

    One save is under way at a time: the next ``save_checkpoint``, ``load_checkpoint``,
    ``remove_checkpoint``, ``wait`` and ``teardown`` (which Lightning calls at the end of
    ``fit``) first wait for it to commit, and raise its error if it failed (that save's path
    then still holds the version before it). The versions it replaces are deleted by a thread
    of its own once it commits.
    """

    def __init__(
        self, storage_options: dict[str, Any] | None = None, *, options: Options | None = None
    ) -> None:
        super().__init__(storage_options, options=options)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Captures ``checkpoint`` for a new version at ``path`` and returns; the commit, and
        the deletion of the versions it replaces, follow in the background.

        Raises:
            SnapshotError: the previous save failed in the background (this one is not
                begun), or capturing this one failed.
        """
        self.wait()
        pending, root, target, older, store, t = self._save(
            Snapshot.async_take, checkpoint, path, storage_options
        )
        logger.info("checkpoint %s captured in %.3f s", root, time.perf_counter() - t)
        thread = threading.Thread(
            target=self._commit,
            args=(pending, root, target, older, store, t),
            name="statesnap-lightning-commit",
            daemon=True,
        )
        with self._lock:
            self._thread = thread
        thread.start()

    def _commit(
        self,
        pending: PendingSnapshot,
        root: str,
        target: str,
        older: list[Version],
        store: dict[str, Any] | None,
        t0: float,
    ) -> None:
        """On a thread of its own: waits for the commit, then deletes what it replaced; or
        records the error and deletes what the failed save left."""
        try:
            pending.wait()
        except BaseException as e:
            logger.error("checkpoint %s failed: %s", root, e)
            with self._lock:
                self._errors.append(e)
            self._discard(root, target, store)
            return
        logger.info("checkpoint %s committed %.3f s after it began", root, time.perf_counter() - t0)
        self._retire(root, older, store)

    def wait(self) -> None:
        """Waits for the save under way (its commit and the deletions after it); raises its
        error if it failed."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
            with self._lock:
                if self._thread is thread:
                    self._thread = None
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def _settle(self) -> None:
        self.wait()

    def teardown(self) -> None:
        """Called by Lightning when the strategy tears down: waits for the save under way."""
        self.wait()


def _register_with_the_other() -> None:
    """When both ``lightning`` and ``pytorch_lightning`` are installed, their two
    ``CheckpointIO`` classes differ, and a Trainer of either accepts only its own. The plugins
    derive from ``lightning.pytorch``'s; if ``pytorch_lightning`` was imported before this
    module, they are registered as virtual subclasses of its class too (both are ABCs)."""
    for package in ("lightning.pytorch.plugins.io", "pytorch_lightning.plugins.io"):
        module = sys.modules.get(package)
        other = getattr(module, "CheckpointIO", None)
        if other is not None and other is not CheckpointIO:
            other.register(StatesnapCheckpointIO)


_register_with_the_other()

__all__ = ["AsyncStatesnapCheckpointIO", "StatesnapCheckpointIO"]
