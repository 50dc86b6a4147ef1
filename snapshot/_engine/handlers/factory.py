"""``ShardedTensorFactory``: replaced by what it builds, whose leaves are taken in its place (take only; its merge runs after restore)."""

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
# To fill in: value_types=(ShardedTensorFactory,)
HANDLER = Handler(name="factory", take=take, restore=restore)
