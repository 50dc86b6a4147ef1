"""``ShardedTensorFactory``: replaced by what it builds, whose leaves are taken in its place (take
only; its merge runs after restore)."""

from __future__ import annotations

import typing

from snapshot._engine.flatten import flatten
from snapshot._engine.handlers.table import Handler
from snapshot.sharding import mapping

# ==== take ===================================================================================
# What the factory builds is taken in its place: its leaves and containers, under the
# factory's path (each leaf by its own kind, never replicated).

if typing.TYPE_CHECKING:
    from snapshot._engine.take.plan import Collector, Planned


def take(
    planner: Collector,
    path: str,
    logical: str,
    value: mapping.ShardedTensorFactory,
    replicated: bool,
) -> Planned:
    """Records what ``value`` builds under ``path``; returns the entry at ``path`` itself."""
    entries = planner.out.entries
    cut = len(path) - len(logical)
    root = None
    for p, node, leaf in flatten(value.build(), path):
        entry = node if node is not None else planner.leaf(p, p[cut:], leaf, False)
        if p == path:
            root = entry
        entries[p] = entry
    return root


# ==== restore ================================================================================
# A restore replaces each factory among the targets by what it builds before it plans any
# read, and hands what was read to the factory's merge afterwards (``restore._targets``,
# ``apply_factory_merges``): no entry is a factory's, and the loader never asks for this.

from typing import TYPE_CHECKING, Any  # noqa: E402

from manifest import Entry  # noqa: E402

if TYPE_CHECKING:
    from snapshot._engine.restore.loader import Loader


def restore(loader: Loader, path: str, entry: Entry, target: Any) -> None:
    raise NotImplementedError(f"{path}: a ShardedTensorFactory is restored through what it builds")


# ==== registration ===========================================================================
# Any instance of the class, a subclass's too.
HANDLER = Handler(
    name="factory",
    take=take,
    restore=restore,
    value_types=(mapping.ShardedTensorFactory,),
    accepts=lambda value: isinstance(value, mapping.ShardedTensorFactory),
)
