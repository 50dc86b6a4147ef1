"""The wrappers of ``snapshot.sharding.mapping`` that are not values of their own: a
``LocalNonpersistentObject``, kept on its rank and never written (recorded as None; a restore puts
the restoring rank's own object back), and a ``ShardedTensorFactory``, replaced by what it
builds, whose leaves are taken in its place (take only; its merge runs after restore)."""

from __future__ import annotations

import typing

from manifest import PrimitiveEntry
from snapshot._engine.handlers.table import Kind, ReadPlanner, TakeSink
from snapshot._engine.state_dicts import flatten
from snapshot.sharding import mapping

if typing.TYPE_CHECKING:
    from snapshot._engine.handlers.table import Planned


class Local(Kind):
    """Kept on its rank, never saved: its place in the state is recorded as None. Whatever the
    snapshot holds at its path, a restore keeps the restoring rank's own object: the loader
    asks this kind for every entry whose target is a ``LocalNonpersistentObject``."""

    name = "local"
    value_types = (mapping.LocalNonpersistentObject,)

    def take(
        self, sink: TakeSink, path: str, logical: str, value: typing.Any, replicated: bool
    ) -> PrimitiveEntry:
        return PrimitiveEntry(value=None)

    def restore(
        self,
        reader: ReadPlanner,
        path: str,
        entry: typing.Any,
        target: mapping.LocalNonpersistentObject,
    ) -> None:
        reader.objects[path] = target.unwrap()

    def allocates(self, entry: typing.Any, target: typing.Any) -> bool:
        return False  # nothing is read


LOCAL = Local()


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
