"""Dense tensors (``torch.Tensor`` and ``nn.Parameter``, strided, not quantized or nested): written from their memory, in chunks, packed into slabs when small; restored into the caller's tensor in place, or into new tensors."""

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
# To fill in: value_types=(torch.Tensor, torch.nn.Parameter), accepts=<is_dense_tensor>, entry_types=(TensorEntry,)
HANDLER = Handler(name="dense", take=take, restore=restore)
