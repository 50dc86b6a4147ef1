"""Which backend and version wrote each part of a snapshot: recorded at take, checked at restore.

A snapshot holds two parts of a state, the sharded part (``ShardedTensorEntry`` /
``ShardedObjectEntry`` entries) and the common part (everything else); its manifest records,
under ``metadata["strategies"]``, the ``[backend, version]`` that wrote each. The library writes
both as (``BACKEND``, ``VERSION``). A restore checks that something here can read what each part
records: by default exactly that pair; once the strategy layer (``snapshot.strategies``) is
imported, the load strategy its registry holds for the pair, which may refuse it. The strategy
layer installs that check (``set_check``): the engine never imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from snapshot.errors import IncompatibleSnapshotError

BACKEND = "statesnap"
VERSION = 1
PARTS = ("common", "sharded")
# Manifests written before strategies were recorded were written by this pair.
_UNRECORDED = {"sharded": [BACKEND, 1], "common": [BACKEND, 1]}

# (part, backend, version) -> None, or raises IncompatibleSnapshotError.
Check = Callable[[str, str, int], None]


def _builtin_check(part: str, backend: str, version: int) -> None:
    if (backend, version) != (BACKEND, VERSION):
        raise IncompatibleSnapshotError(
            f"no load_{part} strategy is registered for backend {backend!r} version {version}; "
            f"registered: {BACKEND} v{VERSION}"
        )


_check: Check = _builtin_check


def set_check(check: Check) -> None:
    """Makes ``check`` decide whether a part written by (backend, version) can be read: the
    strategy layer installs its registry's."""
    global _check
    _check = check


def recorded(backend: str = BACKEND, version: int = VERSION) -> dict[str, list[Any]]:
    """What a take records under ``metadata["strategies"]``: ``backend`` and ``version`` as the
    writer of both parts."""
    return {"sharded": [backend, version], "common": [backend, version]}


def check_readable(metadata: Mapping[str, Any], where: str) -> None:
    """Checks that each part of the snapshot ``where`` (whose manifest's metadata is
    ``metadata``) was written by a backend and version that can be read.

    Raises:
        IncompatibleSnapshotError: the manifest does not say who wrote a part, or nothing
            reads what it says.
    """
    written = metadata.get("strategies", _UNRECORDED)
    for part in PARTS:
        writer = written.get(part) if isinstance(written, dict) else None
        if (
            not isinstance(writer, list)
            or len(writer) != 2
            or not isinstance(writer[0], str)
            or type(writer[1]) is not int
        ):
            raise IncompatibleSnapshotError(
                f"snapshot {where}: the manifest does not say which backend and version wrote its "
                f"{part} part (metadata.strategies.{part}: {writer!r})"
            )
        try:
            _check(part, writer[0], writer[1])
        except IncompatibleSnapshotError as e:
            raise IncompatibleSnapshotError(f"snapshot {where}, {part} part: {e}") from None
