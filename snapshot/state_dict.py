"""torchsnapshot's module path for :class:`StateDict` (``torchsnapshot.state_dict``): the class
itself lives in :mod:`snapshot.stateful`; this name only re-exports it."""

from __future__ import annotations

from snapshot.stateful import StateDict

__all__ = ["StateDict"]
