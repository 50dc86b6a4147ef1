"""An object held by several ranks (``snapshot.sharding.ShardedObject``): written by the rank holding its main replica."""

from __future__ import annotations

from snapshot._engine.handlers.table import Handler

# ==== take ===================================================================================
# (the take side's imports and code go here)


def take(planner, path, logical, value, replicated):
    raise NotImplementedError


# ==== restore ================================================================================
# (the restore side's imports and code go here)


def restore(loader, path, entry, target):
    raise NotImplementedError


# ==== registration ===========================================================================
# To fill in: value_types=(ShardedObject,), entry_types=(ShardedObjectEntry,)
HANDLER = Handler(name="sharded_object", take=take, restore=restore)
