"""``LocalNonpersistentObject``: kept on its rank, never written (recorded as None); a restore puts
the restoring rank's own object back."""

from __future__ import annotations

import typing

from manifest import PrimitiveEntry
from snapshot._engine.handlers.table import Kind, ReadPlanner, TakeSink
from snapshot.sharding import mapping


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
