"""A DistributedDataParallel module's state without DDP's ``module.`` key prefix, at
torchsnapshot's module path (``torchsnapshot.tricks.ddp``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

# What DistributedDataParallel puts before each key of the module it wraps: its state dict is
# the wrapped module's, under its attribute ``module``.
DDP_STATE_DICT_PREFIX: str = "module."


class DistributedDataParallelAdapter:
    """A :class:`~snapshot.Stateful` whose state dict is a module's without DDP's prefix.

    ``module`` (kept as ``self.module``) is a ``DistributedDataParallel`` module or a plain
    one; either way ``state_dict()`` is the plain module's, so snapshots move between DDP and
    plain modules both ways, and ``load_state_dict`` drops the prefix from a snapshot of the
    DDP module itself. Through the adapter a take does not find the module replicated: pass
    ``replicated=["model/**"]`` to write it once for all ranks.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def _unwrapped(self) -> torch.nn.Module:
        m = self.module
        return m.module if isinstance(m, torch.nn.parallel.DistributedDataParallel) else m

    def state_dict(self) -> dict[str, Any]:
        """The plain module's state dict (no ``module.`` prefix)."""
        return self._unwrapped().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads ``state_dict`` into the plain module, dropping DDP's prefix when every key has
        it (and the module's own keys do not)."""
        module = self._unwrapped()
        # A DDP module's state dict has the prefix on every key. Dropped only then, and only
        # when the module's own keys do not all start with it too (a plain module whose one
        # child is an attribute named ``module``): its own state loads as it is.
        if all(k.startswith(DDP_STATE_DICT_PREFIX) for k in state_dict) and not all(
            k.startswith(DDP_STATE_DICT_PREFIX) for k in module.state_dict(keep_vars=True)
        ):
            # In place, as torch's helper does: the dict is the one restore built for this call.
            consume_prefix_in_state_dict_if_present(state_dict, DDP_STATE_DICT_PREFIX)
        module.load_state_dict(state_dict)


__all__ = ["DDP_STATE_DICT_PREFIX", "DistributedDataParallelAdapter"]
