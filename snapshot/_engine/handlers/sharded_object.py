"""An object held by several ranks (``snapshot.sharding.ShardedObject``): written by the rank
holding its main replica."""

from __future__ import annotations

import typing

from snapshot._engine.handlers import objects, sharded
from snapshot._engine.handlers.table import Handler
from snapshot._engine.take.plan import ShardedObjectDraft
from snapshot.sharding import mapping

# ==== take ===================================================================================
# Written by the rank holding its main replica, as an object (``objects.take``); the other
# ranks' entries are filled in from that rank's at the commit (``sharded.merge_entries``).

if typing.TYPE_CHECKING:
    from snapshot._engine.take.plan import Collector, Planned


def take(
    planner: Collector,
    path: str,
    logical: str,
    value: mapping.ShardedObject,
    replicated: bool,
) -> Planned:
    """The draft of the object on its main replica's rank, a placeholder on the others."""
    key = value.unique_key
    main = mapping.is_main_replica(value.replica_id)
    planner.out.objects.append((key, main, path))
    if not main:
        return sharded.ObjectReplica(key)
    return ShardedObjectDraft(
        key=key, draft=objects.take(planner, path, logical, value.data, False)
    )


# ==== restore ================================================================================
# Read and decoded as an object is (``objects.plan_object_read``), by every rank that holds a
# replica of it.

from typing import TYPE_CHECKING, Any  # noqa: E402

from manifest import ShardedObjectEntry  # noqa: E402
from snapshot._engine.handlers.objects import plan_object_read  # noqa: E402

if TYPE_CHECKING:
    from snapshot._engine.restore.loader import Loader


def restore(loader: Loader, path: str, entry: ShardedObjectEntry, target: Any) -> None:
    """Plans the read of the object's bytes, decoded into the loader's ``objects``."""
    loader.claim()  # a buffer of the stored length
    need = plan_object_read(path, entry, loader.objects, loader.verify)
    loader.add_needs([need], into_target=False)


# ==== registration ===========================================================================
# Any instance of the class, a subclass's too.
HANDLER = Handler(
    name="sharded_object",
    take=take,
    restore=restore,
    value_types=(mapping.ShardedObject,),
    accepts=lambda value: isinstance(value, mapping.ShardedObject),
    entry_types=(ShardedObjectEntry,),
)
