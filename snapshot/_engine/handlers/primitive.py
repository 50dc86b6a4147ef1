"""Primitives (bool, int, float, None, and short str / bytes) kept in the manifest itself; longer str / bytes get a payload of their own."""

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
# To fill in: value_types=(bool, int, float, type(None), str, bytes), entry_types=(PrimitiveEntry,)
HANDLER = Handler(name="primitive", take=take, restore=restore)
