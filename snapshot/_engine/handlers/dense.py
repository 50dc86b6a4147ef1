"""Dense tensors (``torch.Tensor`` and ``nn.Parameter``, strided, not quantized or nested): written from their memory, in chunks, packed into slabs when small; restored into the caller's tensor in place, or into new tensors."""

from __future__ import annotations

import torch

from snapshot._engine.handlers.table import Handler

_DENSE_TYPES = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided


def is_dense_tensor(value: object) -> bool:
    """Whether ``value`` is stored as raw bytes (a strided, non-quantized plain tensor; not a
    nested one, whose layout says strided but which has no one shape: torch.save stores it)."""
    return (
        type(value) in _DENSE_TYPES
        and value.layout is _STRIDED  # type: ignore[union-attr]
        and not value.is_quantized  # type: ignore[union-attr]
        and not value.is_nested  # type: ignore[union-attr]
    )


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
