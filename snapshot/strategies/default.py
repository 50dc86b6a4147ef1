"""The library's own strategies (backend ``"statesnap"``, version 1): the strategy API on top
of the engine that ``Snapshot.take`` / ``restore`` run. One snapshot holds both parts of a
state; its manifest records who wrote each (``metadata["strategies"]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from manifest import ShardedObjectEntry, ShardedTensorEntry
from snapshot._engine import state_dicts
from snapshot._engine.format import serialization as writers
from snapshot._engine.format.serialization import dtype_from_name
from snapshot._engine.io.async_queue import AsyncRequest
from snapshot.errors import IncompatibleSnapshotError, SnapshotError
from snapshot.sharding.mapping import ShardedObject, ShardedTensor
from snapshot.snapshot import Snapshot, take_job
from snapshot.stateful import StateDict
from snapshot.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    StrategyAction,
    register_default_strategy,
)

BACKEND = writers.BACKEND
VERSION = writers.VERSION

# The app_state key under which the strategy API keeps a plain (sharded) state dict.
_STATE = "state"


class SnapshotSaveStrategy(AsyncSaveShardedStrategy, SaveCommonStrategy):
    """Takes a snapshot of a whole state, both parts, in one pass; for callers that save the
    parts separately, the common part and the sharded objects each in a snapshot of its own
    under the checkpoint directory (``common``, ``sharded_objects``)."""

    can_handle_sharded_objects = True

    def __init__(self, backend: str = BACKEND, version: int = VERSION) -> None:
        super().__init__(backend, version)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        where = _dir(checkpoint_dir, "save")
        state = state_dicts.state_mapping(sharded_state_dict, "save", "sharded_state_dict", where)
        # The strategy API takes no options (the environment's), and records this strategy as
        # the writer of both parts.
        job, background = take_job(
            "save",
            where,
            {_STATE: StateDict(state)},
            asynchronous=True,
            strategies=writers.recorded(self.backend, self.version),
        )
        job.start()
        job.release_writes()
        return AsyncRequest(async_fn=job.finish, async_fn_args=(background,))

    def save_common(self, common_state_dict: Any, checkpoint_dir: str | Path) -> None:
        self.save(common_state_dict, _part_dir(checkpoint_dir, "common"))

    def save_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: str | Path):
        self.save(sharded_objects_state_dict, _part_dir(checkpoint_dir, "sharded_objects"))


class SnapshotLoadStrategy(LoadShardedStrategy, LoadCommonStrategy):
    """Loads snapshots whose parts were written by ``backend`` in one of ``versions``."""

    can_handle_sharded_objects = True

    def __init__(self, backend: str = BACKEND, versions: tuple[int, ...] = (VERSION,)) -> None:
        self.backend = backend
        self.versions = versions

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, versions {list(self.versions)})"

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != self.backend:
            raise IncompatibleSnapshotError(
                f"{self} loads data saved by backend {self.backend!r}, not {loaded_backend!r}"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version not in self.versions:
            raise IncompatibleSnapshotError(
                f"{self} cannot load version {loaded_version} of {self.backend!r}"
            )

    def load(
        self, sharded_state_dict: Any, checkpoint_dir: str | Path, *, verify_first: bool = False
    ) -> Any:
        """Loads ``sharded_state_dict``'s tensors in place and returns the loaded state
        (``verify_first``: as ``Snapshot.restore`` takes it)."""
        where = _dir(checkpoint_dir, "load")
        given = state_dicts.state_mapping(sharded_state_dict, "load", "sharded_state_dict", where)
        state = StateDict(given)
        Snapshot(where).restore({_STATE: state}, verify_first=verify_first)
        return dict(state)

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        return _described(checkpoint_dir, objects=False)

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        return _described(checkpoint_dir, objects=True)

    def remove_sharded_tensors(self, checkpoint_dir: str | Path, key_prefix: str) -> None:
        raise SnapshotError(
            f"{checkpoint_dir}: a committed snapshot is never changed in place; take a new one "
            f"without the tensors under {key_prefix!r}"
        )

    def load_common(self, checkpoint_dir: str | Path) -> Any:
        return Snapshot(_part_dir(checkpoint_dir, "common")).read_object(f"0/{_STATE}")

    def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: str | Path):
        return self.load(sharded_objects_state_dict, _part_dir(checkpoint_dir, "sharded_objects"))


class SnapshotSaveCommonStrategy(SnapshotSaveStrategy):
    """The strategy registered for the common part: :class:`SnapshotSaveStrategy`, which also
    saves the parts apart."""


def _dir(checkpoint_dir: object, call: str) -> str:
    """A checkpoint directory as a str (an empty one, or a non-path such as None, refused)."""
    return state_dicts.snapshot_path(checkpoint_dir, call, "checkpoint_dir")


def _part_dir(checkpoint_dir: str | Path, part: str) -> str:
    """Where a part saved apart (``common``, ``sharded_objects``) is, under the checkpoint
    directory."""
    return f"{_dir(checkpoint_dir, f'the {part} part').rstrip('/')}/{part}"


def _described(checkpoint_dir: str | Path, objects: bool) -> dict[str, Any]:
    """Key -> data-less ``ShardedTensor`` (whole: its global shape and dtype) for each sharded
    tensor of the snapshot at ``checkpoint_dir``; then, with ``objects``, unique key ->
    data-less ``ShardedObject`` for each sharded object."""
    entries = Snapshot(_dir(checkpoint_dir, "reading the metadata")).get_manifest()
    found: dict[str, Any] = {}
    for path, entry in entries.items():
        if isinstance(entry, ShardedTensorEntry) and entry.key not in found:
            shape, dtype = tuple(entry.shape), dtype_from_name(entry.dtype, path)
            whole = ((0,) * len(shape), (1,) * len(shape))
            found[entry.key] = ShardedTensor(entry.key, None, dtype, shape, shape, *whole)
    for entry in entries.values() if objects else ():
        if isinstance(entry, ShardedObjectEntry):
            found.setdefault(entry.key, ShardedObject.empty_from_unique_key(entry.key))
    return found


# The library's strategies for (``statesnap``, 1), registered on import.
_loader = SnapshotLoadStrategy()
register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, SnapshotSaveStrategy())
register_default_strategy(
    StrategyAction.SAVE_COMMON, BACKEND, VERSION, SnapshotSaveCommonStrategy()
)
register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, _loader)
register_default_strategy(StrategyAction.LOAD_COMMON, BACKEND, VERSION, _loader)


__all__ = [
    "BACKEND",
    "VERSION",
    "SnapshotLoadStrategy",
    "SnapshotSaveCommonStrategy",
    "SnapshotSaveStrategy",
]
