"""Pieces of a global tensor (DTensor, torch's ShardedTensor, snapshot.sharding.ShardedTensor): each rank writes the pieces whose main replica it holds; a restore reads the boxes of the stored pieces that the target's regions cover."""

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
# To fill in: accepts=<is sharded>, entry_types=(ShardedTensorEntry,)
HANDLER = Handler(name="sharded_tensor", take=take, restore=restore)
