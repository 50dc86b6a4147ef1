"""Strategy classes and the registry of default strategies.

A strategy saves or loads one part of a checkpoint: the *sharded* part or the *common* part
(everything else), in the format ``(backend, version)``; the registry maps ``(action, backend,
version)`` to the default strategy. A snapshot records who wrote each part, and a restore has
the registered load strategy check it can read that (this module installs the check in the
engine: ``serialization.set_check``). The layer calls the facade and the engine, never the reverse.
"""

from __future__ import annotations

import abc
import enum
from collections import defaultdict
from pathlib import Path
from typing import Any

from snapshot._engine.format import serialization as writers
from snapshot._engine.io.async_queue import AsyncRequest
from snapshot.errors import IncompatibleSnapshotError


class StrategyAction(enum.Enum):
    """Save or load, of the sharded or the common part."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


# action value -> {(backend, version): strategy}
default_strategies: defaultdict[str, dict[tuple[str, int], Any]] = defaultdict(dict)


def register_default_strategy(
    action: StrategyAction,
    backend: str,
    version: int,
    strategy: SaveStrategyBase | LoadStrategyBase,
) -> None:
    """Makes ``strategy`` the default for ``action`` on ``(backend, version)``."""
    if not isinstance(action, StrategyAction):
        raise TypeError(f"action must be a StrategyAction, got {action!r}")
    expected = SaveStrategyBase if action.value.startswith("save") else LoadStrategyBase
    if not isinstance(strategy, expected):
        raise TypeError(
            f"a strategy for {action.value} must be a {expected.__name__}, got "
            f"{type(strategy).__name__}"
        )
    default_strategies[action.value][(backend, version)] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> Any:
    """The strategy registered for ``action`` on ``(backend, version)``
    (``IncompatibleSnapshotError``, listing the registered pairs, when there is none)."""
    found = default_strategies[action.value].get((backend, version))
    if found is None:
        known = ", ".join(f"{b} v{v}" for b, v in sorted(default_strategies[action.value], key=str))
        raise IncompatibleSnapshotError(
            f"no {action.value} strategy is registered for backend {backend!r} version "
            f"{version}; registered: {known or 'none'}"
        )
    return found


class SaveStrategyBase(abc.ABC):  # noqa: B024 - abstract in its subclasses' methods
    """A way of saving, writing format ``version`` of ``backend``."""

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    can_handle_sharded_objects: bool = False
    """Whether this strategy also saves ``ShardedObject`` leaves."""

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, {self.version})"


class LoadStrategyBase(abc.ABC):
    """A way of loading; it says which saved backends and versions it can read."""

    @abc.abstractmethod
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raises when data saved by ``loaded_backend`` cannot be loaded by this strategy."""

    @abc.abstractmethod
    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raises when data saved in format ``loaded_version`` cannot be loaded by this
        strategy."""

    can_handle_sharded_objects: bool = False
    """Whether this strategy also loads ``ShardedObject`` leaves."""


def _check_part(part: str, backend: str, version: int) -> None:
    """The engine's check of a part written by ``(backend, version)``: both checks of the
    registered load strategy, their failures made the library's ``IncompatibleSnapshotError``."""
    action = StrategyAction.LOAD_COMMON if part == "common" else StrategyAction.LOAD_SHARDED
    strategy = get_default_strategy(action, backend, version)
    try:
        strategy.check_backend_compatibility(backend)
        strategy.check_version_compatibility(version)
    except IncompatibleSnapshotError:
        raise
    except Exception as e:
        raise IncompatibleSnapshotError(
            f"{strategy} cannot load data saved by {backend} version {version}: {e}"
        ) from e


writers.set_check(_check_part)


class LoadCommonStrategy(LoadStrategyBase):
    """Loads the common (not sharded) part of a checkpoint."""

    @abc.abstractmethod
    def load_common(self, checkpoint_dir: str | Path) -> Any:
        """The common part of the checkpoint at ``checkpoint_dir``."""

    @abc.abstractmethod
    def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: str | Path):
        """The sharded objects that ``sharded_objects_state_dict`` describes."""

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """Unique key -> data-less ``ShardedObject`` for the sharded objects saved."""
        raise NotImplementedError(f"{type(self).__name__} does not describe sharded objects")


class LoadShardedStrategy(LoadStrategyBase):
    """Loads the sharded part of a checkpoint."""

    @abc.abstractmethod
    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        """Loads what ``sharded_state_dict`` describes; returns it with values in place of the
        sharded descriptions."""

    @abc.abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """Key -> data-less ``ShardedTensor`` (global shape and dtype) for each sharded tensor
        saved."""

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """Like ``load_tensors_metadata``, with the sharded objects too."""
        if not self.can_handle_sharded_objects:
            raise NotImplementedError(f"{type(self).__name__} does not load sharded objects")
        return self.load_tensors_metadata(checkpoint_dir)

    @abc.abstractmethod
    def remove_sharded_tensors(self, checkpoint_dir: str | Path, key_prefix: str) -> None:
        """Removes the tensors whose key starts with ``key_prefix``."""


class SaveCommonStrategy(SaveStrategyBase):
    """Saves the common (not sharded) part of a checkpoint."""

    @abc.abstractmethod
    def save_common(self, common_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """Saves the common part."""

    @abc.abstractmethod
    def save_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: str | Path):
        """Saves the sharded objects."""


class SaveShardedStrategy(SaveStrategyBase):
    """Saves the sharded part of a checkpoint."""

    @abc.abstractmethod
    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """Saves ``sharded_state_dict``."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A sharded save whose ``async_save`` returns the request that finishes it (the caller
    schedules it); ``save`` runs it at once."""

    @abc.abstractmethod
    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        """Captures the state and returns the request that writes and commits it."""

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()
