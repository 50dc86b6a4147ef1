"""torchsnapshot's module path for :class:`RNGState` (``torchsnapshot.rng_state``): the class
itself lives in :mod:`snapshot.stateful`; this name only re-exports it."""

from __future__ import annotations

from snapshot.stateful import RNGState

__all__ = ["RNGState"]
