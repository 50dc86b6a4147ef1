"""``LocalNonpersistentObject``: kept on its rank, never written (recorded as None); a restore puts the restoring rank's own object back."""

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
# To fill in: value_types=(LocalNonpersistentObject,)
HANDLER = Handler(name="local", take=take, restore=restore)
