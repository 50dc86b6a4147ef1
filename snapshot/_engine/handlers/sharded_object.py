"""An object held by several ranks (``snapshot.sharding.ShardedObject``): written by the rank
holding its main replica, read by every rank that holds a replica."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from manifest import ShardedObjectEntry
from snapshot._engine.handlers import objects, sharded
from snapshot._engine.handlers.table import Kind, ReadPlanner, ShardedObjectDraft, TakeSink
from snapshot.sharding import mapping

if TYPE_CHECKING:
    from snapshot._engine.handlers.table import Planned


class ShardedObjectKind(Kind):
    """Written by the rank holding its main replica, as an object; the other ranks' entries
    are filled in from that rank's at the commit (``merge``). Read and decoded
    as an object is (``objects.decode_value``)."""

    name = "sharded_object"
    value_types = (mapping.ShardedObject,)
    entry_types = (ShardedObjectEntry,)
    merged_types = (sharded.ObjectReplica,)

    def take(
        self,
        sink: TakeSink,
        path: str,
        logical: str,
        value: mapping.ShardedObject,
        replicated: bool,
    ) -> Planned:
        key = value.unique_key
        main = mapping.is_main_replica(value.replica_id)
        sink.out.objects.append((key, main, path))
        if not main:
            return sharded.ObjectReplica(key)
        draft = objects.OBJECTS.take(sink, path, logical, value.data, False)
        return ShardedObjectDraft(key=key, draft=draft)

    def restore(
        self, reader: ReadPlanner, path: str, entry: ShardedObjectEntry, target: Any
    ) -> None:
        decode = functools.partial(objects.decode_value, path, entry)
        self.read_bytes(reader, path, entry.location, decode)

    def archived(self, entry: ShardedObjectEntry) -> bool:
        return entry.serializer == "torch_save"

    def merge(self, entries: dict[str, Any]) -> None:
        """Replaces each ``ObjectReplica`` by the entry of the rank that wrote the object."""
        objects = {e.key: e for e in entries.values() if isinstance(e, ShardedObjectEntry)}
        for path, entry in entries.items():
            if isinstance(entry, sharded.ObjectReplica):
                entries[path] = objects[entry.key]


SHARDED_OBJECT = ShardedObjectKind()
