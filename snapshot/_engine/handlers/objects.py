"""Any other value: pickled with torch.save (and checked to be restorable at take); torchsnapshot's pickled tensors are read here too."""

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
# To fill in: accepts=lambda value: True (the catch-all, registered last), entry_types=(ObjectEntry, PickledTensorEntry)
HANDLER = Handler(name="objects", take=take, restore=restore)
