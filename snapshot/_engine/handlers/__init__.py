"""The table of kinds of values: for each kind, what a take makes of a value (its entry and the
byte payloads to write) and what a restore makes of its entry (the reads, and into what).

The take planner looks a leaf's kind up by ``for_value`` and the restore path an entry's by
``for_entry``; neither branches on kinds itself. A new kind is one module beside these with a
``HANDLER`` and one entry in ``_BUILTIN`` below (or a ``register`` call). Kind modules import no
planner or restore module: those pass themselves in (``take(planner, ...)``,
``restore(loader, ...)``), so no import runs back up.
"""

from __future__ import annotations

from snapshot._engine.handlers import (
    dense,
    factory,
    local,
    objects,
    primitive,
    sharded_object,
    sharded_tensor,
)
from snapshot._engine.handlers.table import Handler, for_entry, for_value, register

# Registration order is the order ``accepts`` is asked in: the catch-all object kind last.
_BUILTIN = (dense, primitive, sharded_tensor, sharded_object, factory, local, objects)
for _kind in _BUILTIN:
    register(_kind.HANDLER)

__all__ = ["Handler", "for_entry", "for_value", "register"]
