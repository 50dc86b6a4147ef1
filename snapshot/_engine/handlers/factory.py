"""``ShardedTensorFactory``: replaced by what it builds, whose leaves are taken in its place (take
only; its merge runs after restore)."""

from __future__ import annotations

import typing

from snapshot._engine.handlers.table import Kind, ReadPlanner, TakeSink
from snapshot._engine.state_dicts import flatten
from snapshot.sharding import mapping

if typing.TYPE_CHECKING:
    from snapshot._engine.handlers.table import Planned


class Factory(Kind):
    """What the factory builds is taken in its place: its leaves and containers, under the
    factory's path (each leaf by its own kind, never replicated). A restore replaces each
    factory among the targets by what it builds before it plans any read, and hands what was
    read to the factory's merge afterwards: no entry is a factory's."""

    name = "factory"
    value_types = (mapping.ShardedTensorFactory,)

    def take(
        self,
        sink: TakeSink,
        path: str,
        logical: str,
        value: mapping.ShardedTensorFactory,
        replicated: bool,
    ) -> Planned:
        entries = sink.out.entries
        cut = len(path) - len(logical)
        for p, node, leaf in flatten(value.build(), path):
            entries[p] = node if node is not None else sink.leaf(p, p[cut:], leaf, False)
        return entries[path]  # ``flatten`` yields ``path`` itself first

    def restore(
        self, reader: ReadPlanner, path: str, entry: typing.Any, target: typing.Any
    ) -> None:
        raise NotImplementedError(
            f"{path}: a ShardedTensorFactory is restored through what it builds"
        )


FACTORY = Factory()
