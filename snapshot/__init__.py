"""statesnap: snapshots of a PyTorch application's whole state, to local disk or object storage.

Public API: :class:`Snapshot`, :class:`PendingSnapshot`, :class:`StateDict`, :class:`RNGState`,
:class:`Stateful`, :class:`Options` (the tunables of one call), :class:`CheckpointManager`
(step folders, retention, resume), the errors below
:class:`SnapshotError` (and :class:`PathMismatchWarning`), and ``__version__``. Sharded state is
described with :mod:`snapshot.sharding`. A new kind of value is a :class:`Kind` given to
:func:`register_kind` (a tensor subclass with attributes of its own, say).
"""

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
from snapshot.options import Options
from snapshot.pending import PendingSnapshot
from snapshot.snapshot import Snapshot
from snapshot.stateful import RNGState, StateDict, Stateful
from snapshot.version import __version__

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
