"""The library's errors: one root, ``SnapshotError``, and a few precise kinds below it; and
``a_or_an``, which messages name a type with."""

from __future__ import annotations


def a_or_an(name: str) -> str:
    """``name`` after its indefinite article, as a message names a type: ``"an int"``,
    ``"a str"``, ``"an OrderedDict"`` (by the first letter: a vowel takes ``an``)."""
    return f"{'an' if name[:1].lower() in ('a', 'e', 'i', 'o', 'u') else 'a'} {name}"


class SnapshotError(Exception):
    """Root of every error the library raises on purpose.

    On a failed restore's error, ``modified`` maps each app_state key this rank wrote before the
    failure to ``"partially"`` or ``"fully"`` (its ``load_state_dict`` returned), and
    ``untouched`` names the keys left as they were; the message ends with the same account.
    Both are None on every other error.
    """

    modified: dict[str, str] | None = None
    untouched: tuple[str, ...] | None = None
    # The sentence that account adds to the message (empty until a restore sets it).
    restore_account: str = ""

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text}; {self.restore_account}" if self.restore_account else text


class SnapshotNotFoundError(SnapshotError):
    """No committed snapshot exists at the path."""


class IncompleteSnapshotError(SnapshotNotFoundError):
    """The path holds the debris of a take that never committed (it was interrupted or failed)."""


class MissingBaseError(SnapshotError):
    """A snapshot taken on a base (an incremental take) points at bytes of a sibling snapshot
    that is gone, or that is not a committed snapshot: ``base`` names it. Nothing of the
    snapshot is restored."""

    def __init__(self, message: str, base: str = "") -> None:
        super().__init__(message)
        self.base = base


class SnapshotExistsError(SnapshotError):
    """``take`` was pointed at a path that already holds a committed snapshot."""


class PathNotEmptyError(SnapshotExistsError):
    """``take`` was pointed at a directory (or object-store prefix) that holds files of its own:
    not a snapshot, and not what an interrupted take left there."""


class CorruptSnapshotError(SnapshotError):
    """The snapshot's bytes are not what its manifest says: unreadable manifest, missing or
    wrongly sized blob, undecodable object."""


class ChecksumError(CorruptSnapshotError):
    """Bytes read from a blob (or the manifest) do not have the CRC-32 the snapshot recorded:
    they were damaged after the take."""


class UnsafeSnapshotError(CorruptSnapshotError):
    """The snapshot holds what the library never writes and will not follow or expand: a symlink,
    a file that is not regular, a manifest over the size limit or using YAML features outside
    the subset the library emits (docs/reliability.md, "Threat model")."""


class IncompatibleSnapshotError(SnapshotError):
    """The snapshot was written in a format this version of the library cannot read."""


class UnsafeObjectError(SnapshotError):
    """An object in the snapshot would need code execution, or a type not allowed, to load."""


class StateMismatchError(SnapshotError):
    """The state being restored does not fit the snapshot (a key or path the snapshot lacks)."""


class ShapeMismatchError(StateMismatchError):
    """A tensor in the snapshot and its restore target differ in shape."""


class EntryNotFoundError(StateMismatchError):
    """``read_object`` was asked for a path the manifest does not have."""


class InvalidArgumentError(SnapshotError, ValueError):
    """An argument is refused before anything is read or written (an empty path, say).

    Also a ``ValueError``, the type Python code raises for a bad argument value.
    """


class NotStatefulError(SnapshotError, TypeError):
    """An ``app_state`` value lacks ``state_dict()`` / ``load_state_dict()`` (or ``app_state``
    is not a dict of str -> Stateful).

    Also a ``TypeError``: torchsnapshot raises ``TypeError`` here, so code written against it
    that catches ``TypeError`` keeps working.
    """


class StatefulError(SnapshotError):
    """A user object's ``state_dict()`` or ``load_state_dict()`` raised."""


class UnsupportedValueError(SnapshotError):
    """A value cannot be snapshotted (a tensor without data, on a device that cannot be read...)."""


class HollowStateError(SnapshotError):
    """A tensor-aware state dict was called out of turn: an operation that needs its tensors
    found it hollow (they were popped), or one that needs placeholders found it full."""


class StorageError(SnapshotError):
    """The storage failed to write or read a blob; the original error is chained."""


class RankFailedError(SnapshotError):
    """A take or restore failed on one or more ranks of a process group; raised on every rank.

    ``failures`` maps each failed rank to its error (``"TypeName: message"``).
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class PathMismatchWarning(UserWarning):
    """Ranks of one process group passed different paths to a take: the snapshot is written at
    rank 0's path, and each rank whose own path differs is warned with both (the returned
    snapshot's ``path`` is rank 0's)."""
