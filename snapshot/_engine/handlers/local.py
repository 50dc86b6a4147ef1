"""``LocalNonpersistentObject``: kept on its rank, never written (recorded as None); a restore puts
the restoring rank's own object back."""

from __future__ import annotations

import typing

from manifest import PrimitiveEntry
from snapshot._engine.handlers.table import Handler
from snapshot.sharding import mapping

# ==== take ===================================================================================
# Kept on its rank, never saved: its place in the state is recorded as None, and a restore puts
# the restoring rank's own object back there.

if typing.TYPE_CHECKING:
    from snapshot._engine.take.plan import Collector


def take(
    planner: Collector, path: str, logical: str, value: typing.Any, replicated: bool
) -> PrimitiveEntry:
    """None in the manifest, in place of the object."""
    return PrimitiveEntry(value=None)


# ==== restore ================================================================================
# Whatever the snapshot holds at its path, the restoring rank keeps its own object: the loader
# calls this for every entry whose target is a ``LocalNonpersistentObject``, of any kind.

from typing import TYPE_CHECKING  # noqa: E402

from manifest import Entry  # noqa: E402

if TYPE_CHECKING:
    from snapshot._engine.restore.loader import Loader
    from snapshot.sharding.mapping import LocalNonpersistentObject


def restore(loader: Loader, path: str, entry: Entry, target: LocalNonpersistentObject) -> None:
    """The value at ``path`` is the object ``target`` wraps; nothing is read."""
    loader.local[path] = target.unwrap()


# ==== registration ===========================================================================
# Any instance of the class, a subclass's too.
HANDLER = Handler(
    name="local",
    take=take,
    restore=restore,
    value_types=(mapping.LocalNonpersistentObject,),
    accepts=lambda value: isinstance(value, mapping.LocalNonpersistentObject),
)
