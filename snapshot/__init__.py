"""statesnap: snapshots of a PyTorch application's whole state, to local disk or object storage.

Public API: :class:`Snapshot`, :class:`PendingSnapshot`, :class:`StateDict`, :class:`RNGState`,
:class:`Stateful`, :class:`Options` (the tunables of one call), :class:`CheckpointManager`
(step folders, retention, resume) with its :class:`MemoryTier` (alone:
:class:`MemoryTierStore`), the errors below
:class:`SnapshotError` (and :class:`PathMismatchWarning`), and ``__version__``. Sharded state is
described with :mod:`snapshot.sharding`. A new kind of value is a :class:`Kind` given to
:func:`register_kind` (a tensor subclass with attributes of its own, say).

The names are imported when first used (PEP 562 ``__getattr__``): ``import snapshot`` itself
loads no torch, so that ``statesnap --version`` (whose ``snapshot.cli`` runs this file first)
answers at once; ``from snapshot import Snapshot`` loads what ``Snapshot`` needs.
"""

import importlib
from typing import TYPE_CHECKING, Any

from snapshot.version import __version__

if TYPE_CHECKING:
    from snapshot._engine.handlers import Kind, TensorLayout
    from snapshot._engine.handlers import register as register_kind
    from snapshot.errors import (
        ChecksumError,
        CorruptSnapshotError,
        EntryNotFoundError,
        HollowStateError,
        IncompatibleSnapshotError,
        IncompleteSnapshotError,
        InvalidArgumentError,
        MissingBaseError,
        NotStatefulError,
        PathMismatchWarning,
        PathNotEmptyError,
        RankFailedError,
        ShapeMismatchError,
        SnapshotError,
        SnapshotExistsError,
        SnapshotNotFoundError,
        StatefulError,
        StateMismatchError,
        StorageError,
        UnsafeObjectError,
        UnsafeSnapshotError,
        UnsupportedValueError,
    )
    from snapshot.manager import CheckpointManager
    from snapshot.options import MemoryTier, Options
    from snapshot.pending import PendingSnapshot
    from snapshot.snapshot import Snapshot
    from snapshot.stateful import RNGState, StateDict, Stateful
    from snapshot.tier_store import MemoryTierStore

# Each public name -> the module defining it (imported on first use, then kept here); the
# other names of ``__all__`` are the errors, of ``snapshot.errors``.
_HOMES = {
    "Kind": "snapshot._engine.handlers",
    "TensorLayout": "snapshot._engine.handlers",
    "register_kind": "snapshot._engine.handlers",
    "CheckpointManager": "snapshot.manager",
    "MemoryTier": "snapshot.options",
    "MemoryTierStore": "snapshot.tier_store",
    "Options": "snapshot.options",
    "PendingSnapshot": "snapshot.pending",
    "Snapshot": "snapshot.snapshot",
    "RNGState": "snapshot.stateful",
    "StateDict": "snapshot.stateful",
    "Stateful": "snapshot.stateful",
}
_RENAMED = {"register_kind": "register"}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module the first time it is asked for; a submodule's
    name (``snapshot.errors``) imports that submodule, as an eager import of the names did."""
    home = _HOMES.get(name, "snapshot.errors" if name in __all__ else None)
    if home is not None:
        value = getattr(importlib.import_module(home), _RENAMED.get(name, name))
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "CheckpointManager",
    "ChecksumError",
    "CorruptSnapshotError",
    "EntryNotFoundError",
    "HollowStateError",
    "IncompatibleSnapshotError",
    "IncompleteSnapshotError",
    "InvalidArgumentError",
    "Kind",
    "MemoryTier",
    "MemoryTierStore",
    "MissingBaseError",
    "NotStatefulError",
    "Options",
    "PathMismatchWarning",
    "PathNotEmptyError",
    "PendingSnapshot",
    "RNGState",
    "RankFailedError",
    "ShapeMismatchError",
    "Snapshot",
    "SnapshotError",
    "SnapshotExistsError",
    "SnapshotNotFoundError",
    "StateDict",
    "StateMismatchError",
    "Stateful",
    "StatefulError",
    "StorageError",
    "TensorLayout",
    "UnsafeObjectError",
    "UnsafeSnapshotError",
    "UnsupportedValueError",
    "__version__",
    "register_kind",
]
