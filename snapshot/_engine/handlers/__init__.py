"""The kinds of values: for each kind, what a take makes of a value (its entry and the byte
payloads to write) and what a restore makes of its entry (the reads, and into what).

Every path looks a leaf's kind up in the table (``table``: ``for_value``, ``for_entry``) and
asks it through the ``Kind`` contract; none branches on kinds itself. A new kind is a ``Kind``
subclass given to ``register`` (``snapshot.register_kind``). Kind modules import no planner or
restore module: those pass themselves in (a ``TakeSink``, a ``ReadPlanner``).
"""

from __future__ import annotations

from snapshot._engine.handlers.dense import DENSE
from snapshot._engine.handlers.local import FACTORY, LOCAL
from snapshot._engine.handlers.objects import OBJECTS, PRIMITIVE
from snapshot._engine.handlers.sharded import SHARDED_OBJECT, SHARDED_TENSOR
from snapshot._engine.handlers.table import (
    Kind,
    ReadPlanner,
    TakeSink,
    TensorLayout,
    for_entry,
    for_value,
    register,
)

# The kind registered last is asked first: the catch-all object kind first, so asked last.
for _kind in (OBJECTS, LOCAL, FACTORY, SHARDED_OBJECT, SHARDED_TENSOR, PRIMITIVE, DENSE):
    register(_kind)

__all__ = [
    "Kind",
    "ReadPlanner",
    "TakeSink",
    "TensorLayout",
    "for_entry",
    "for_value",
    "register",
]
